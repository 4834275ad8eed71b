#!/usr/bin/env bash
# Multi-GPU images on a 2-GPU H200 machine (< 6 min): sequence parallelism, 4K, colocate QoS.
#
#   bash bench/gpu_sp_qos.sh                 # every part: sp 4k comm qos
#   bash bench/gpu_sp_qos.sh --only sp,4k    # torch-only parts (no HTTP stack needed)
#   bash bench/gpu_sp_qos.sh --smoke         # CPU, tiny geometry, seconds (checks the script; no qos)
#   bash bench/gpu_sp_qos.sh --only sp,comm --sp-mode kv-gather   # one SP mode (default both)
#   QOS_PROFILES=colocate-tp2-cfg2,colocate-tp2-cfg2-yield bash bench/gpu_sp_qos.sh --only qos
#
# Parts (each under its own time limit; a failed part is reported and the others still run):
#   sp    u1-8b 2048²: guidance 1 SP1 vs SP2 (target SP2 <= 0.072 s/step; 0.132 s on one GPU), CFG over
#         SP2 and over CFG2 (CFG2 x SP2 runs only with 4 GPUs); every SP case in each --sp-mode
#         (ulysses, kv-gather; default both), each eagerly and from CUDA graphs       [torch only]
#   4k    u1.5-8b 4096²: SP1, CFG on one GPU, SP2, CFG SP2, CFG2; peak memory (target SP2 >= 1.8x SP1);
#         SP cases in Ulysses mode
#   comm  the SP collectives alone: one layer's collective of each --sp-mode (Ulysses: all-to-all there
#         and back; kv-gather: the K/V all-gather), the per-step gather
#   qos   the whole stack colocated (TP2 + CFG2 on 2 GPUs) with the generation engine yielding to
#         decode steps: chat ITL p50/p90 alone and with 2 concurrent 2048² image jobs, image s/step
#         alone and while the chats run (needs fastapi/uvicorn/pyzmq/pydantic/httpx: wheels in .whl/ are installed first)
#
# Writes $OUT/<part>.md and $OUT/<part>.json, then $OUT/sp_qos.json; OUT defaults to ./out.
set -euo pipefail

cd "$(dirname "$0")/.."
. bench/parts.sh
SP_MODE=both
rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sp-mode) SP_MODE="$2"; shift 2 ;;
    *) rest+=("$1"); shift ;;
  esac
done
case "$SP_MODE" in ulysses|kv-gather|both) ;; *) echo "--sp-mode must be ulysses, kv-gather or both" >&2; exit 2 ;; esac
parse_args "sp,4k,comm,qos" ${rest[@]+"${rest[@]}"}

. deploy/carried_wheels.sh
use_carried_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  SP=(--smoke --steps 1 --warmup 1); LIMIT=300; ONLY="${ONLY//qos/}"
else
  SP=(--steps 3 --warmup 2); LIMIT=200
  nvidia-smi -L | tee "$OUT/gpus.txt" || true
fi
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"


run sp sp "$LIMIT" python -m bench.bench_sp --part sp --sp-mode "$SP_MODE" --cuda-graphs both "${SP[@]}"
run 4k 4k "$LIMIT" python -m bench.bench_sp --part 4k --sp-mode ulysses "${SP[@]}"
run comm comm 90 python -m bench.bench_sp --part comm --sp-mode "$SP_MODE" "${SP[@]}"
# 2048², 12 steps, CFG 4; 8 chat streams x 128 tokens, alone and with 2 image jobs (load delay 2 s)
run qos qos 200 python -m bench.bench_deployment --profiles "${QOS_PROFILES:-colocate-tp2-cfg2-yield}" \
  --size 2048x2048 --steps 12 --requests 1 --chat-streams 8 --chat-tokens 128 --image-load 2 \
  --load-delay 2 --startup-timeout 150 --log-dir "$OUT/qos-logs"

finish sp_qos
