#!/usr/bin/env bash
# Container entrypoint: secrets from files into the server's environment, a sanity check of the model mount,
# then the given command as PID 1's child with signals forwarded (exec).
set -euo pipefail
for var in U1SERVE_INTERNAL_TOKEN U1SERVE_API_KEY; do
    file_var="${var}_FILE"
    file="${!file_var:-}"
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "u1serve: ${file_var}=${file} is not readable (mount the secret file)" >&2
            exit 2
        fi
        value=$(head -n 1 "$file" | tr -d '\r\n')
        if [ -n "$value" ]; then export "$var=$value"; fi
        unset "$file_var"
    fi
done
case "${U1SERVE_INTERNAL_TOKEN:-}" in
    "" | change-me*)
        echo "u1serve: set the internal token (a random string) in the internal_token secret file" >&2
        exit 2 ;;
esac
if [ -n "${U1SERVE_MODEL_DIR:-}" ] && [ ! -f "${U1SERVE_MODEL_DIR}/config.json" ]; then
    echo "u1serve: no config.json in U1SERVE_MODEL_DIR=${U1SERVE_MODEL_DIR} (mount the checkpoint there)" >&2
    exit 2
fi
exec "$@"
