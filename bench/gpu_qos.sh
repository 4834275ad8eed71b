#!/usr/bin/env bash
# Colocate QoS side by side on one H200 (issue 25), one GPU call of ~7-8 min:
#   the same mixed load (bench/bench_load.py: 64 clients x 120 s, 1024² 8 steps, chats of exactly 64 tokens)
#   against `u1serve up --mode colocate --und-gpus 0 --gpu-sharing time-slice --qos-yield-share 0` (the behaviour
#   before the QoS defaults) and `u1serve up --mode colocate --und-gpus 0` (the defaults: time slicing, MPS being
#   opt-in for now, the yield gate at 0.05; services/launch/colocate_qos.py), then per side one 1024² 50-step image with
#   the step cache and the same one exact (the steps each CFG branch reused). One markdown table: chat p50 / p99,
#   images/min and its share of the first side's, 5xx, the sharing and gate in force, the cache, the targets.
#
#   bash bench/gpu_qos.sh                                            # the A/B above
#   QOS_PROFILES=colocate-1-mps-nogate,colocate-1 bash bench/gpu_qos.sh   # other sides (bench/stack.py PROFILES)
#   QOS_UP_ARGS="--gen-sm-percent 70" QOS_PROFILES=colocate-1 bash bench/gpu_qos.sh   # one side, other flags
#   QOS_PROFILES=colocate-1,colocate-1-fused bash bench/gpu_qos.sh   # fused engines (issue 38): + GIL under load
#   QOS_DURATION=90 QOS_TIMEOUT=540 bash bench/gpu_qos.sh                  # a shorter load, another limit
#   QOS_RATE=4 bash bench/gpu_qos.sh      # open loop: 4 requests/s on every side (the same offered work), <= 64 in flight
#   bash bench/gpu_qos.sh --smoke                                    # CPU, tiny checkpoint: checks the script
#
# Writes $OUT/qos.md, $OUT/qos.json and the stacks' logs under $OUT/qos-logs; OUT defaults to ./out.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
. deploy/carried_wheels.sh
use_carried_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1:-}" = "--smoke" ]; then
  exec python -m bench.bench_qos --tiny --profiles "${QOS_PROFILES:-cpu-colocate-timeslice,cpu-colocate}" \
    --clients 6 --duration 4 ${QOS_RATE:+--rate "$QOS_RATE"} --up-args "${QOS_UP_ARGS:-}" --log-dir "$OUT/qos-logs" --json "$OUT/qos.json" \
    --markdown "$OUT/qos.md"
fi
nvidia-smi -L | tee "$OUT/gpus.txt" || true
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"
# the load's size warmed up too (the default warm-up covers 2048² only), so no side pays a cold first request
timeout "${QOS_TIMEOUT:-570}" python -m bench.bench_qos --profiles "${QOS_PROFILES:-colocate-1-timeslice,colocate-1}" \
  --clients 64 --duration "${QOS_DURATION:-120}" --startup-timeout 150 ${QOS_RATE:+--rate "$QOS_RATE"} \
  --up-args "--gen-args '--warmup-sizes 1024x1024' ${QOS_UP_ARGS:-}" \
  --log-dir "$OUT/qos-logs" --json "$OUT/qos.json" --markdown "$OUT/qos.md"
