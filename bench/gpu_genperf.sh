#!/usr/bin/env bash
# The speed options on a 2-GPU H200 machine (1 GPU: everything but cfgp): fp8, where an fp8 step's time goes,
# warm start, the 8-step preset, the output path, CFG-parallel. Engine-level, no HTTP stack: torch, numpy,
# safetensors, pydantic (the request contract; carried in .whl/ where the GPU image lacks it), Pillow
# optional. Under 5 minutes on 2x H200 (8B random weights).
#
#   bash bench/gpu_genperf.sh                        # the default parts (below)
#   bash bench/gpu_genperf.sh --only fp8,fp8-profile # some parts: fp8 fp8-profile warmstart preset pixels cfgp cache graphs
#                                                    # addnorm fp8-fused
#   bash bench/gpu_genperf.sh --smoke                # CPU, tiny geometry (checks the script)
#
# Writes $OUT/<name>.md (the markdown tables) and $OUT/<name>.json, then $OUT/genperf.json (all of
# them); OUT defaults to ./out. Each part runs under its own time limit; a part that fails or times
# out is reported and the others still run (exit status 1 at the end if any failed).
set -euo pipefail

cd "$(dirname "$0")/.."
. bench/parts.sh
parse_args "fp8,fp8-profile,warmstart,preset,pixels,cfgp" "$@"   # cache (step caching), graphs, addnorm when asked for
. deploy/carried_wheels.sh
use_carried_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  GEO=(--device cpu --tiny --size 128 --sizes 128 --steps 2 --warmup 1)
  JOBSTEPS="128:6"; PIXSIZES="256"; LIMIT=300; NGPU=0
else
  GEO=(--device cuda --sizes 1024,2048 --size 2048 --steps 5 --warmup 2)
  JOBSTEPS="1024:20,2048:10"; PIXSIZES="1024,2048"; LIMIT=150
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
  nvidia-smi -L | tee "$OUT/gpus.txt" || true
fi
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"


B="-m bench.bench_generation"
# single-branch step at 1024² / 2048²: bf16 vs fp8 (serving policy, every GEMM fp8, fast accumulation),
# fp8 velocity error (accurate and fast accumulation), every layer GEMM by row count, kernels vs torch bits
run fp8 fp8 "$LIMIT" python $B --part fp8 "${GEO[@]}"
# torch.profiler of one 2048² single-branch step, bf16 vs fp8: time per kernel category, top kernels
run fp8-profile fp8-profile "$LIMIT" python $B --part fp8-profile "${GEO[@]}"
# first vs steady step of a fresh process (then a new prompt length, then a guidance-1 job), each with an
# empty Triton cache so kernels compile inside the measured process as on a new machine:
#   warm: the service's warm-up, cuDNN plans bucketed by length (the service's setting)
#   warm-perlength: the warm-up with cuDNN's per-length plans (TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0, run 1)
#   cold: no warm-up
for mode in warm warm-perlength cold; do
  flag=(); [ "$mode" = cold ] && flag=(--no-warmup)
  export TRITON_CACHE_DIR; TRITON_CACHE_DIR="$(mktemp -d)"
  if [ "$mode" = warm-perlength ]; then export TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0; fi
  run warmstart "warmstart-$mode" "$LIMIT" python $B --part warmstart "${GEO[@]}" ${flag[@]+"${flag[@]}"}
  unset TRITON_CACHE_DIR TORCH_CUDNN_SDPA_AVOID_RECOMPILE
done
# the 8-step preset (guidance 1): bf16, fp8 as served, fp8 on every GEMM
run preset preset "$LIMIT" python $B --part preset "${GEO[@]}"
# pixels -> uint8 -> host, and encoders (Pillow rows only where Pillow is installed)
run pixels pixels 120 python -m bench.bench_breakdown --part engine --device "${GEO[1]}" --sizes "$PIXSIZES"
# CFG-parallel over 2 GPUs, bf16 and fp8 (proxy of colocate TP2+CFG2: target <= 0.095 s/step fp8)
if [ "$NGPU" -ge 2 ]; then
  run cfgp cfgp-bf16 "$LIMIT" python $B --cfg-parallel 2 --size 2048 --steps 5 --warmup 2 --skip-batching
  run cfgp cfgp-fp8 "$LIMIT" python $B --cfg-parallel 2 --size 2048 --steps 5 --warmup 2 --skip-batching --quantization fp8
elif [ "$SMOKE" = 1 ]; then
  run cfgp cfgp-fp8 "$LIMIT" python $B --cfg-parallel 2 --device cpu --tiny --size 128 --steps 2 --warmup 1 --quantization fp8
fi
# whole-job time and computed steps vs first-block threshold (CFG 4); not in the default set
run cache cache "$LIMIT" python $B --part cache "${GEO[@]}" --thresholds 0,0.05,0.1,0.2 --job-steps "$JOBSTEPS"
# CUDA graphs of the denoise layer stack vs eager (1024², 2048²; guidance 1 and 4; bf16, fp8 at 2048²): s/step,
# speedup, final x bit-equal, capture failures; two 1024² jobs together; a job dropped mid-way then a new one
run graphs graphs 300 python $B --part graphs "${GEO[@]}"
# the residual add fused into the next RMSNorm (-> fp8) vs apart (U1SERVE_FUSED_ADD_NORM flipped): single-branch
# s/step at 1024² / 2048², bf16 and fp8 as served, eager and CUDA graphs; final x bit-equal; the kernels alone
# (bits vs torch add + norm kernel, us); not in the default set
run addnorm addnorm 300 python $B --part addnorm "${GEO[@]}"
# fp8 quantised by the producers (RMSNorm / silu*mul -> fp8) vs in the GEMM layers vs as served today vs bf16:
# single-branch s/step at 1024² / 2048², eager and CUDA graphs; not in the default set
run fp8-fused fp8-fused 300 python $B --part fp8-fused "${GEO[@]}"

finish genperf
