#!/usr/bin/env bash
# The serving defaults of issue 25 on one H200, in ONE call (about 4-6 minutes; each side under a 260 s limit):
# today's defaults ("before": graphs off, default size warmed only, 16,384-row batches) beside the new ones
# ("after": CUDA graphs on, the size table warmed, 8,192-row batches), each a `u1serve up --mode colocate
# --und-gpus 0 --quantization fp8` stack (8B geometry, random weights) through the public API:
#   startup_s; per size of the size table the first request after ready vs the second (target <= 1.2x);
#   the steady step time of 1024² / 2048² (before: eager, after: graphs); two concurrent 2048² CFG requests vs
#   one alone (together / (2 x alone) <= 1: never slower than one after the other); `applied` of a request.
#
#   bash bench/gpu_defaults.sh                 # the GPU run
#   bash bench/gpu_defaults.sh --smoke         # CPU, tiny checkpoint, the new side only (checks the script; CI)
#   STEPS=50 bash bench/gpu_defaults.sh        # steps per request (default 20: stricter for the 1.2x target)
#
# Writes $OUT/defaults-<side>.md / .json, then $OUT/defaults.json; OUT defaults to ./out.
set -euo pipefail

cd "$(dirname "$0")/.."
. bench/parts.sh
parse_args "before,after" "$@"
. deploy/carried_wheels.sh
use_carried_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  # the modes that compose, in one stack: separate, CFG-parallel 2, SP 2, fp8 (emulated on a CPU)
  ARGS=(--tiny --profiles cpu-separate-cfg2-sp2 --sizes 64x64 --pair-size 64x64 --steps 2
        --up-args "--default-size 64x64 --quantization fp8")
  ONLY="after"; LIMIT=400
else
  ARGS=(--profiles colocate-1 --up-args "--quantization fp8" --steps "${STEPS:-20}")
  LIMIT=260
  nvidia-smi -L | tee "$OUT/gpus.txt" || true
fi
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"

for side in before after; do
  run "$side" "defaults-$side" "$LIMIT" python -m bench.bench_defaults --sides "$side" "${ARGS[@]}" \
    --log-dir "$OUT/logs-$side"
done
finish defaults
