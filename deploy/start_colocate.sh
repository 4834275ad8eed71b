#!/usr/bin/env bash
# Colocate: understanding and generation share the same GPUs (memory split by fractions).
#   MODEL=/models/SenseNova-U1-8B-MoT GPUS=0,1 deploy/start_colocate.sh
# 1 GPU:  GPUS=0 UND_TP=1 GEN_CFG=1.   2 GPUs (default): TP2 understanding + CFG2 generation.
set -euo pipefail
MODEL=${MODEL:?set MODEL to the checkpoint directory (or 'tiny')}
GPUS=${GPUS:-0,1}
UND_TP=${UND_TP:-2}
GEN_CFG=${GEN_CFG:-2}
PORT=${PORT:-8000}
# KV_POOL_GB: the KV pool's size (u1serve up's default when unset: 16 on GPUs, 0.25 on CPU)
exec u1serve up --model "$MODEL" --mode colocate \
    --und-gpus "$GPUS" --gen-gpus "$GPUS" --und-tp "$UND_TP" --gen-cfg-parallel "$GEN_CFG" \
    --und-memory-fraction "${UND_MEMORY_FRACTION:-0.35}" \
    --gen-memory-fraction "${GEN_MEMORY_FRACTION:-0.55}" \
    ${KV_POOL_GB:+--kv-pool-gb "$KV_POOL_GB"} --port "$PORT" "$@"
