#!/usr/bin/env bash
# End-to-end benchmark sweep through the gateway; results go to docs/benchmarks/e2e-*.json.
#   BASE=http://127.0.0.1:8000 deploy/bench_e2e.sh
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8000}
OUT=${OUT:-docs/benchmarks}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
for cfg in "1024x1024 1 1" "1024x1024 8 4" "2048x2048 4 1"; do
    read -r size requests conc <<<"$cfg"
    python3 "$here/bench_e2e.py" --base "$BASE" --size "$size" --requests "$requests" \
        --concurrency "$conc" --steps "${STEPS:-50}" ${API_KEY:+--api-key "$API_KEY"} \
        --json "$OUT/e2e-${size}-c${conc}.json"
done
