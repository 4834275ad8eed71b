#!/usr/bin/env bash
# Container entrypoint: secrets from files, a sanity check of the model mount, then the given command as PID 1's
# child with signals forwarded (exec).
#   U1SERVE_INTERNAL_TOKEN_FILE   first line -> U1SERVE_INTERNAL_TOKEN in the server's environment
#   U1SERVE_API_KEY_FILE          the tenants' keys      -> the gateway's --api-key-file FILE
#   U1SERVE_ADMIN_API_KEY_FILE    the operators' keys    -> the gateway's --admin-api-key-file FILE
# A key file holds one key per line (blank lines and '#' comment lines allowed); the gateway reads the file
# itself, so every key of it counts. The entrypoint refuses (exit 2) a file that has no key, a line that is not
# one key (spaces inside, control characters, a trailing comment), a key shorter than 16 characters, and a key
# that is both a tenant's and an operator's: each of those used to start a keyless or wrongly keyed gateway.
set -euo pipefail

fail() { echo "u1serve: $*" >&2; exit 2; }

readable() {   # $1: the *_FILE variable's name, $2: its value
    [ -r "$2" ] && [ -f "$2" ] || fail "$1=$2 is not a readable file (mount the secret file)"
}

key_lines() {  # the keys of file $1: every line but blank and '#' comment ones, trimmed
    sed -e 's/\r$//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$1" | grep -v -e '^$' -e '^#' || true
}

check_key_file() {   # $1: the variable's name, $2: the file; fails unless every line is one well-formed key
    readable "$1" "$2"
    local keys n=0 key
    keys=$(key_lines "$2")
    while IFS= read -r key; do
        [ -n "$key" ] || continue
        n=$((n + 1))
        if ! printf '%s' "$key" | LC_ALL=C grep -q -x -E '[!-~]+'; then
            fail "$1=$2: key line $n is not one key (spaces, a trailing comment or control characters inside)"
        fi
        [ ${#key} -ge 16 ] || fail "$1=$2: key line $n is shorter than 16 characters (e.g. sk-\$(openssl rand -hex 16))"
        case "$key" in change-me*) fail "$1=$2: key line $n is the placeholder; write a random key" ;; esac
    done <<< "$keys"
    [ "$n" -gt 0 ] || fail "$1=$2 holds no key (one per line; '#' comments and blank lines are skipped)"
}

# the internal token: one line, exported (the engines and the gateway read U1SERVE_INTERNAL_TOKEN)
if [ -n "${U1SERVE_INTERNAL_TOKEN_FILE:-}" ]; then
    readable U1SERVE_INTERNAL_TOKEN_FILE "$U1SERVE_INTERNAL_TOKEN_FILE"
    value=$(head -n 1 "$U1SERVE_INTERNAL_TOKEN_FILE" | tr -d '\r\n')
    if [ -n "$value" ]; then export U1SERVE_INTERNAL_TOKEN="$value"; fi
    unset U1SERVE_INTERNAL_TOKEN_FILE
fi
case "${U1SERVE_INTERNAL_TOKEN:-}" in
    "" | change-me*) fail "set the internal token (a random string) in the internal_token secret file" ;;
esac

# the key files: checked here, then handed to the gateway as paths (it reads every key; no key in the environment).
# The commands that take them: the gateway (python -m services.gateway.server) and the whole stack (u1serve up)
is_gateway="" prev=""
for arg in "$@"; do
    case "$arg" in services.gateway.server) is_gateway=1 ;; esac
    case "$prev:$arg" in u1serve:up | */u1serve:up | services.launch.cli:up) is_gateway=1 ;; esac
    prev=$arg
done
key_flags=()
for pair in U1SERVE_API_KEY_FILE:--api-key-file U1SERVE_ADMIN_API_KEY_FILE:--admin-api-key-file; do
    var=${pair%%:*} flag=${pair#*:}
    file="${!var:-}"
    [ -n "$file" ] || continue
    [ -n "$is_gateway" ] || fail "$var is the gateway's; this command is neither services.gateway.server nor u1serve up"
    check_key_file "$var" "$file"
    key_flags+=("$flag" "$file")
    unset "$var"
done
if [ ${#key_flags[@]} -eq 4 ] && \
        [ -n "$(comm -12 <(key_lines "${key_flags[1]}" | sort -u) <(key_lines "${key_flags[3]}" | sort -u))" ]; then
    fail "a key is in both ${key_flags[1]} (tenants) and ${key_flags[3]} (operators): keep operator keys apart"
fi

if [ -n "${U1SERVE_MODEL_DIR:-}" ] && [ ! -f "${U1SERVE_MODEL_DIR}/config.json" ]; then
    fail "no config.json in U1SERVE_MODEL_DIR=${U1SERVE_MODEL_DIR} (mount the checkpoint there)"
fi
exec "$@" ${key_flags[@]+"${key_flags[@]}"}
