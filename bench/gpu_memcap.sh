#!/usr/bin/env bash
# Issue 42 on one H100 (80 GB) or H200, in ONE call (about 6-7 minutes; each part under its own limit):
#   accuracy  per format and layer group, the logit error of one decode step and the velocity error of one denoise
#             step against bf16, 8B geometry, random weights (int8 and fp8: the serving code's W8A8 on the GPU; the
#             GGUF types are CPU-bound in their encoder and are measured on the tiny checkpoint only)
#   cap24     both engines colocated, the card capped at 24 GiB (memory fractions that sum to it, enforced as each
#             process's allocator cap): every format pair `u1serve plan` says fits; chat, 1024² and 2048² images, an
#             edit, a short interleaved answer, the over-budget requests; peak memory per engine next to the plan
#   cap24fused  (--only cap24fused) the same at 24 GiB with both engines in one process (`--colocate-engines fused`:
#             the prefix KV pool in device memory; one peak for the process)
#   cap48     the same at 48 GiB (bf16 / bf16; PAIRS48=bf16/bf16,int8/int8 adds int8 if there is time)
#   cap24sep  (--only cap24sep, 2 GPUs) each engine on a card of its own, both capped at 24 GiB (`--mode separate`:
#             two 24 GB cards; bf16 / bf16, PAIRSSEP overrides)
#   loadpeak  (not in the default parts: --only loadpeak, ~5 minutes) int8 from a FLOAT 8B checkpoint per branch,
#             loaded layer by layer under that engine's 24 GiB share: the measured load peak next to the plan's
#             (bench/bench_load_peak.py; writes ~35 GB of checkpoints under $OUT/loadpeak-ckpt, removed after)
# GGUF (Q8_0, Q4_K, a per-layer mix) is not run here: it is dequantised to bf16 at load, so its memory and speed on
# the GPU are bf16's by construction (docs/model.md); its accuracy is bench_format_accuracy's tiny-CPU table.
# PAIRS24 / PAIRS48 (und/gen,...) and STEPS override the defaults.
#
#   bash bench/gpu_memcap.sh                    # the GPU run
#   bash bench/gpu_memcap.sh --smoke            # CPU, tiny checkpoint (checks the script; CI: tests/bench)
#   bash bench/gpu_memcap.sh --only cap24       # one part
#
# Writes $OUT/<part>.md / .json, the plans ($OUT/plan-*.txt), then $OUT/memcap.json; OUT defaults to ./out.
set -euo pipefail

cd "$(dirname "$0")/.."
. bench/parts.sh
parse_args "accuracy,cap24,cap48" "$@"
. deploy/carried_wheels.sh
use_carried_wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee "$OUT/env.txt"

if [ "$SMOKE" = 1 ]; then
  ACC=(--tiny); CAP=(--tiny --sizes 64,128 --steps 2 --up-args "--default-size 64x64"); C24=4; C48=6
  LP=(--tiny); LACC=300; L24=500; L48=500; LLP=120
  ONLY=$([ "$ONLY" = "accuracy,cap24,cap48" ] && echo "accuracy,cap24,cap24fused,cap24sep" || echo "$ONLY")   # CI: 3 stacks
else
  nvidia-smi -L | tee "$OUT/gpus.txt" || true
  ACC=(--device cuda --variant u1-8b --formats int8,fp8)
  CAP=(--sizes 1024,2048 --steps "${STEPS:-8}"); C24=24; C48=48
  LP=(--dir "$OUT/loadpeak-ckpt"); LACC=120; L24=160; L48=200; LLP=480
  python -m services.launch.cli tiny-checkpoint "$OUT/u1-8b" --variant u1-8b >/dev/null
  for cap in 24 48; do   # what the plan predicts, before anything runs
    python -m services.launch.cli plan --model "$OUT/u1-8b" --gpu-memory "${cap}GiB" --gpu-total "$(nvidia-smi \
      --query-gpu=memory.total --format=csv,noheader,nounits -i 0)MiB" > "$OUT/plan-$cap.txt" || true
  done
fi

run accuracy accuracy "$LACC" python -m bench.bench_format_accuracy "${ACC[@]}"
run cap24 cap24 "$L24" python -m bench.bench_memcap "${CAP[@]}" --caps "$C24" \
  --pairs "${PAIRS24:-int8/int8}" --log-dir "$OUT/logs-cap24"
run cap24fused cap24fused "$L24" python -m bench.bench_memcap "${CAP[@]}" --caps "$C24" --engines fused \
  --pairs "${PAIRS24:-int8/int8}" --log-dir "$OUT/logs-cap24fused"
run cap24sep cap24sep "$L24" python -m bench.bench_memcap "${CAP[@]}" --caps "$C24" --mode separate \
  --pairs "${PAIRSSEP:-$([ "$SMOKE" = 1 ] && echo int8/int8 || echo bf16/bf16)}" --log-dir "$OUT/logs-cap24sep"
run loadpeak loadpeak "$LLP" python -m bench.bench_load_peak "${LP[@]}"
run cap48 cap48 "$L48" python -m bench.bench_memcap "${CAP[@]}" --caps "$C48" \
  --pairs "${PAIRS48:-bf16/bf16}" --log-dir "$OUT/logs-cap48"
finish memcap
