#!/usr/bin/env bash
# Separate: understanding (TP) and generation (CFG-parallel) on disjoint GPU groups.
#   MODEL=/models/SenseNova-U1-8B-MoT UND_GPUS=0,1 GEN_GPUS=2,3 deploy/start_separate.sh
set -euo pipefail
MODEL=${MODEL:?set MODEL to the checkpoint directory (or 'tiny')}
UND_GPUS=${UND_GPUS:-0,1}
GEN_GPUS=${GEN_GPUS:-2,3}
UND_TP=${UND_TP:-2}
GEN_CFG=${GEN_CFG:-2}
PORT=${PORT:-8000}
# KV_POOL_GB: the KV pool's size (u1serve up's default when unset: 16 on GPUs, 0.25 on CPU)
exec u1serve up --model "$MODEL" --mode separate \
    --und-gpus "$UND_GPUS" --gen-gpus "$GEN_GPUS" --und-tp "$UND_TP" --gen-cfg-parallel "$GEN_CFG" \
    ${KV_POOL_GB:+--kv-pool-gb "$KV_POOL_GB"} --port "$PORT" "$@"
