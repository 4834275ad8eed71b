#!/usr/bin/env bash
# Smoke test: one request against every public endpoint of a running stack.
#   BASE=http://127.0.0.1:8000 [API_KEY=...] [SIZE=64x64] [STEPS=4] deploy/smoke_test.sh
# Exits non-zero at the first failure. Needs curl and python3.
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8000}
SIZE=${SIZE:-64x64}
STEPS=${STEPS:-4}
AUTH=()
if [ -n "${API_KEY:-}" ]; then AUTH=(-H "Authorization: Bearer ${API_KEY}"); fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass() { printf '  ok   %s\n' "$1"; }
fail() { printf '  FAIL %s\n' "$1"; exit 1; }

call() {  # call NAME EXPECTED_STATUS curl-args... ; body lands in $TMP/out
    local name=$1 want=$2; shift 2
    local got
    got=$(curl -sS -o "$TMP/out" -w '%{http_code}' "${AUTH[@]}" "$@") || fail "$name (curl error)"
    [ "$got" = "$want" ] || { cat "$TMP/out"; echo; fail "$name: HTTP $got, want $want"; }
    pass "$name"
}
json() { python3 -c "import json,sys; d=json.load(open('$TMP/out')); $1"; }

echo "u1serve smoke test against $BASE"
call "GET /health" 200 "$BASE/health"
call "GET /v1/models" 200 "$BASE/v1/models"
MODEL=$(json 'print(d["data"][0]["id"])')
call "GET /metrics" 200 "$BASE/metrics"
grep -q u1serve_gateway_requests_total "$TMP/out" || fail "metrics content"

call "POST /v1/chat/completions" 200 "$BASE/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}]}"
json 'assert d["choices"][0]["message"]["role"] == "assistant"'
call "POST /v1/chat/completions (stream)" 200 -N "$BASE/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"max_tokens\":8,\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}"
grep -q 'data: \[DONE\]' "$TMP/out" || fail "chat stream ends with [DONE]"

call "POST /v1/images/generations" 200 "$BASE/v1/images/generations" -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"a red cube\",\"size\":\"$SIZE\",\"num_inference_steps\":$STEPS,\"seed\":1}"
json 'import base64; open("'"$TMP"'/img.png","wb").write(base64.b64decode(d["data"][0]["b64_json"]))'
call "POST /v1/images/generations (stream)" 200 -N "$BASE/v1/images/generations" \
    -H 'content-type: application/json' \
    -d "{\"prompt\":\"a blue ball\",\"size\":\"$SIZE\",\"num_inference_steps\":$STEPS,\"stream\":true}"
grep -q 'image_generation.progress' "$TMP/out" || fail "stream has progress events"
grep -q 'image_generation.completed' "$TMP/out" || fail "stream has the image"

call "POST /v1/images/edits" 200 "$BASE/v1/images/edits" -F prompt="make it green" \
    -F "image[]=@$TMP/img.png" -F "image[]=@$TMP/img.png" -F num_inference_steps="$STEPS"
json 'assert d["data"][0]["b64_json"]'

call "POST /v1/chat/completions (modalities image)" 200 "$BASE/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"modalities\":[\"image\"],\"messages\":[{\"role\":\"user\",\"content\":\"a small house\"}],\"image_config\":{\"size\":\"$SIZE\",\"num_inference_steps\":$STEPS}}"
json 'assert d["choices"][0]["message"]["images"][0]["image_url"]["url"].startswith("data:image/")'

call "bad size -> 400" 400 "$BASE/v1/images/generations" -H 'content-type: application/json' \
    -d '{"prompt":"x","size":"100x100"}'
echo "all endpoints OK"
