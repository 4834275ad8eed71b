#!/usr/bin/env bash
# Builds the folder that carries Ray Serve to the GPU machine (Python 3.12, no package index, a 64 MiB copy of the
# repository): Ray trimmed to what Serve runs (deploy/trim_wheel.py), the wheels of Ray's and Serve's needs that
# the GPU image lacks, and u1serve's own (what deploy/gpu_smoke.sh lists). The GPU command unpacks it as
# deploy/carried_wheels.sh does (`mv .raycarry .whl; . deploy/carried_wheels.sh; use_carried_wheels`); the steps
# and sizes are in docs/benchmarks/ray.md ("Carrying Ray to the GPU machine").
#
#   deploy/ray/build_carry.sh [OUT]        # OUT defaults to .raycarry (ignored by git); needs pip, binutils' strip
#
# Pinned versions: what was verified together (Python 3.12 venv holding only the GPU image's packages, a
# one-node cluster, Serve, a request through its proxy). Two on purpose:
#   grpcio-reflection 1.62.3: Serve's controller imports it; later versions refuse a grpcio older than the one
#     they were generated with (1.85.1 raises at import), and the GPU image's grpcio version is not known;
#   protobuf 7.36.2: googleapis-common-protos / proto-plus / opentelemetry-proto check the protobuf runtime at
#     import (>= 6.33.5); the image's own protobuf is not known either, the carried one comes first on sys.path.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.raycarry}

RAY=ray==2.60.0
RAY_DEPS="aiohttp-cors==0.8.1 cachetools==8.0.2 colorful==0.5.8 google-api-core==2.44.0 google-auth==2.63.0
googleapis-common-protos==1.76.0 grpcio-reflection==1.62.3 httptools==0.9.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 mmh3==5.3.1 opencensus==0.11.4 opencensus-context==0.1.3
opentelemetry-api==1.45.2 opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 proto-plus==1.29.0 protobuf==7.36.2
pyasn1==0.6.3 pyasn1-modules==0.4.2 referencing==0.37.0 rpds-py==0.30.0 rsa==4.7.2 smart-open==9.0.2
watchfiles==1.3.0 websockets==17.4"
# u1serve's own (deploy/gpu_smoke.sh's list, less what the image has) and gguf (services/model/gguf_io.py)
OWN_DEPS="annotated-doc==0.0.7 annotated-types==0.7.0 fastapi==0.165.0 gguf==0.19.0 prometheus-client==0.26.0
pydantic==2.13.4 pydantic-core==2.46.4 python-multipart==0.0.34 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0
tqdm==4.70.1 typing-extensions==4.16.0 typing-inspection==0.4.2 uvicorn==0.54.0"

download() {    # cp312 manylinux wheels, no dependencies resolved (every need is named above)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$@"
}

rm -rf "$out"; mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
download "$tmp" "$RAY"
# Ray's native core (the worker extension, the raylet, the GCS server) and the extension of its vendored psutil
# (ray/thirdparty_files comes first on sys.path: without that .so, `import ray` fails); the runtime-env agent's
# vendored aiohttp stack keeps its pure-Python fallbacks only (its C speedups: 1.8 MB); RLlib, Data and LLM are
# never imported
python3 -m deploy.trim_wheel "$tmp"/ray-2.60.0-cp312-*.whl --root 'ray/_raylet.so' \
    --root 'ray/core/src/ray/raylet/raylet' --root 'ray/core/src/ray/gcs/gcs_server' \
    --root 'ray/thirdparty_files/psutil/*.so' \
    --drop 'ray/rllib/*' --drop 'ray/data/*' --drop 'ray/llm/*' --strip --out "$out/ray-2.60.0-slim-cp312.site.tar.xz"
# shellcheck disable=SC2086
download "$out" $RAY_DEPS $OWN_DEPS

tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
du -b "$out"/* | awk -v out="$out" -v tracked="$tracked" '{s += $1; n += 1} END {
    printf "%s: %d files, %.1f MiB; the tracked tree %.1f MiB; together %.1f MiB (the limit: 64 MiB)\n",
        out, n, s / 1048576, tracked / 1048576, (s + tracked) / 1048576}'
