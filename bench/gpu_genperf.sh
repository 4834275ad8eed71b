#!/usr/bin/env bash
# Issue 12 on a 1- or 2-GPU H200 machine: fp8, step caching, the 8-step preset, warm start, the
# output path. Needs only torch (+ numpy, safetensors; Pillow optional) - engine-level, no HTTP stack.
#
#   bash bench/gpu_genperf.sh                   # every part (< 8 min on one H200, 8B random weights)
#   bash bench/gpu_genperf.sh --only fp8,cache  # some parts: fp8 cache preset warmstart pixels cfgp
#   bash bench/gpu_genperf.sh --smoke           # CPU, tiny geometry, seconds (checks the script)
#
# Writes $OUT/<part>.md (the markdown tables) and $OUT/<part>.json, then $OUT/genperf.json (all of
# them); OUT defaults to ./out. Each part runs under its own time limit; a part that fails or times
# out is reported and the others still run (exit status 1 at the end if any failed).
set -euo pipefail

cd "$(dirname "$0")/.."
. bench/parts.sh
parse_args "fp8,cache,preset,warmstart,pixels,cfgp" "$@"

if [ "$SMOKE" = 1 ]; then
  GEO=(--device cpu --tiny --size 128 --sizes 128 --steps 2 --warmup 1)
  JOBSTEPS="128:6"; PIXSIZES="256"; LIMIT=300; NGPU=0
else
  GEO=(--device cuda --sizes 1024,2048 --size 2048 --steps 5 --warmup 2)
  JOBSTEPS="1024:20,2048:10"; PIXSIZES="1024,2048"; LIMIT=240
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
  nvidia-smi -L | tee "$OUT/gpus.txt" || true
fi
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"


B=bench/bench_generation.py
# fp8 vs bf16 single-branch step (1024², 2048²), fp8 velocity error (8B, 2048², 8-step trajectory),
# _scaled_mm vs emulation, Triton quantiser bits
run fp8 "$LIMIT" python $B --part fp8 "${GEO[@]}"
# whole-job time and computed steps vs first-block threshold (CFG 4)
run cache "$LIMIT" python $B --part cache "${GEO[@]}" --thresholds 0,0.05,0.1,0.2 --job-steps "$JOBSTEPS"
# the 8-step preset (guidance 1), bf16 and fp8
run preset "$LIMIT" python $B --part preset "${GEO[@]}"
# first vs steady step of a fresh process, with and without the warm-up; a fresh Triton cache each,
# so kernels compile inside the measured process as on a new machine
for mode in warm cold; do
  flag=(); [ "$mode" = cold ] && flag=(--no-warmup)
  export TRITON_CACHE_DIR; TRITON_CACHE_DIR="$(mktemp -d)"
  run "warmstart-$mode" "$LIMIT" python $B --part warmstart "${GEO[@]}" ${flag[@]+"${flag[@]}"}
  unset TRITON_CACHE_DIR
done
# pixels -> uint8 -> host, and encoders (Pillow rows only where Pillow is installed)
run pixels 120 python bench/bench_breakdown.py --part engine --device "${GEO[1]}" --sizes "$PIXSIZES"
# CFG-parallel over 2 GPUs, bf16 and fp8 (proxy of colocate TP2+CFG2: target <= 0.095 s/step fp8)
if [ "$NGPU" -ge 2 ]; then
  run cfgp-bf16 "$LIMIT" python $B --cfg-parallel 2 --size 2048 --steps 5 --warmup 2
  run cfgp-fp8 "$LIMIT" python $B --cfg-parallel 2 --size 2048 --steps 5 --warmup 2 --quantization fp8
elif [ "$SMOKE" = 1 ]; then
  run cfgp-fp8 "$LIMIT" python $B --cfg-parallel 2 --device cpu --tiny --size 128 --steps 2 --warmup 1 --quantization fp8
fi

finish genperf
