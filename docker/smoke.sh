#!/usr/bin/env bash
# The compose stack for real, on CPU: build the CPU image (and its local base if absent), `up` compose.cpu.yaml,
# chat / streamed chat / image / edit / interleaved answer through the published port with the API key (openai
# SDK), engines unreachable from the host, an engine crash -> restarted and the gateway serving again, `down -v`
# -> nothing left. A markdown summary on stdout; exit 0 only if every check passed.
#   docker/smoke.sh [--no-build] [--image u1serve:cpu] [--crash understanding|generation] [--json FILE] [--keep]
# Needs a running Docker daemon (root: it kills an engine's process), a compose client (docker compose or
# docker-compose), debootstrap when the base must be made, and python3 with openai, pillow and httpx.
set -euo pipefail
exec python3 "$(dirname "$0")/smoke.py" "$@"
