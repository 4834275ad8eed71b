#!/usr/bin/env bash
# Container entrypoint: run the given command as PID 1's child with signals forwarded (exec).
set -euo pipefail
if [ -n "${U1SERVE_MODEL_DIR:-}" ] && [ ! -f "${U1SERVE_MODEL_DIR}/config.json" ]; then
    echo "u1serve: no config.json in U1SERVE_MODEL_DIR=${U1SERVE_MODEL_DIR} (mount the checkpoint there)" >&2
    exit 2
fi
exec "$@"
