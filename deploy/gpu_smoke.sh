#!/usr/bin/env bash
# Smoke test of every deployment profile this machine can hold, through the public API (deploy/gpu_smoke.py
# has the checks): 1 GPU: colocate, colocate with generation's weight streaming (--weight-streaming-layers 2), and
# both engines in one process (--colocate-engines fused --gen-sm-percent 75);
# 2+ GPUs: also colocate TP2 + CFG2, separate 1 + 1, colocate TP2 + SP2 and colocate TP2 + CFG2 with QoS
# (--qos-yield-share). On request only (--profiles): colocate-1-mps,
# colocate-1-mps-normal (--gen-priority normal) and colocate-tp2-cfg2-mps (--gpu-sharing mps; they need
# nvidia-cuda-mps-control), colocate-tp2-sp2-kv (colocate-tp2-sp2 with --gen-sp-mode kv-gather),
# colocate-tp2-sp2-kv-graphs (that with --cuda-graphs on: checks that steps replayed graphs).
# GPU profiles run the random-weight 8B geometry (`u1serve tiny-checkpoint DIR --variant u1-8b` + U1SERVE_RANDOM_WEIGHTS=1); --cpu runs
# the tiny checkpoint on CPU (what CI runs, a minute or two).
#
#   deploy/gpu_smoke.sh [--cpu] [--profiles colocate-1,separate-1-1] [--out DIR]
#   deploy/gpu_smoke.sh --profiles colocate-1-mps,colocate-1-mps-normal,colocate-tp2-cfg2-mps  # MPS (2 GPUs, ~4 min)
#   deploy/gpu_smoke.sh --profiles colocate-tp2-sp2,colocate-tp2-sp2-kv      # both SP modes (2 GPUs)
#   deploy/gpu_smoke.sh --profiles colocate-tp2-sp2-kv-graphs               # SP with CUDA graphs (2 GPUs)
#
# Each profile gets a time limit (PROFILE_LIMIT_S, default 170 s on GPU: the seven profiles of a 2-GPU machine
# finish in about 8 minutes: under a 10-minute limit, run them in two calls with --profiles; 240 s on CPU).
# Results: a markdown table on stdout, OUT/<profile>.json, OUT/summary.json
# and OUT/summary.md (OUT defaults to $OUT, else /tmp/u1serve-gpu-smoke). Exit code 0 only if every check passed.
#
# Needs python3 (3.11+) with torch 2.11-2.14 (+ triton on GPU), numpy, pillow, safetensors, tokenizers, jinja2,
# and these, which a bare GPU image may lack: fastapi starlette pydantic pydantic-core annotated-types
# typing-inspection typing-extensions uvicorn click h11 anyio sniffio idna httpx httpcore certifi
# python-multipart pyzmq prometheus-client. Wheels in .whl/ are installed first, without an index:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/u1serve-site .whl/*.whl
#   export PYTHONPATH=/tmp/u1serve-site
set -euo pipefail
cd "$(dirname "$0")/.."

cpu=0
profiles=""
out="${OUT:-/tmp/u1serve-gpu-smoke}"
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) cpu=1 ;;
        --profiles) profiles="$2"; shift ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

. deploy/carried_wheels.sh
use_carried_wheels
missing=$(python3 - <<'PY'
import importlib
mods = ["torch", "numpy", "PIL", "safetensors", "tokenizers", "jinja2", "fastapi", "starlette", "pydantic",
        "uvicorn", "httpx", "multipart", "zmq", "prometheus_client"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_smoke: missing Python packages: $missing (see the top of $0)" >&2
    exit 2
fi

if [ "$cpu" = 1 ]; then
    profiles=${profiles:-cpu}
    limit=${PROFILE_LIMIT_S:-240}
else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" -lt 1 ]; then
        echo "gpu_smoke: no GPU found (nvidia-smi -L); use --cpu for the CPU mode" >&2
        exit 2
    fi
    profiles=${profiles:-$(python3 -m deploy.gpu_smoke profiles --gpus "$gpus")}
    limit=${PROFILE_LIMIT_S:-170}
fi
mkdir -p "$out"
echo "gpu_smoke: profiles $profiles, ${limit} s each, results in $out"
IFS=',' read -r -a list <<<"$profiles"
for p in "${list[@]}"; do
    rm -f "$out/$p.json"
    start=$(date +%s)
    # SIGTERM at the limit reaches the launcher too (it dies with its parent) and stops the stack cleanly
    timeout --kill-after=30 "$limit" python3 -m deploy.gpu_smoke run --profile "$p" --out "$out/$p.json" \
        || echo "gpu_smoke: $p failed or hit its time limit ($(( $(date +%s) - start )) s)"
done
python3 -m deploy.gpu_smoke report "$out" --profiles "$profiles"
