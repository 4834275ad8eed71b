#!/usr/bin/env bash
# CI's Docker step (.ci/run): when Docker can be started here, run docker/smoke.sh (build the CPU image, the compose
# stack end to end); else say why and return 0. Installs Debian's docker.io / docker-compose / debootstrap when
# absent (root + apt), starts dockerd when none runs and stops it again afterwards.
#   docker/ci.sh [smoke.sh options]      exit status: smoke.sh's, or 0 when Docker cannot be started here
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp -d)/dockerd.log
started=""

skip() { echo "docker smoke not run: $*"; exit 0; }

if [ "$(id -u)" != 0 ]; then skip "needs root (dockerd, and smoke.sh kills an engine's process)"; fi
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || skip "no apt-get to install ${missing[*]}"
    echo "installing ${missing[*]} (Debian packages)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } >"$log.apt" 2>&1 \
        || { tail -n 20 "$log.apt"; skip "apt-get install ${missing[*]} failed"; }
fi

if ! docker info >/dev/null 2>&1; then
    for driver in overlay2 vfs; do
        dockerd --storage-driver "$driver" >"$log" 2>&1 &
        started=$!
        for _ in $(seq 60); do
            docker info >/dev/null 2>&1 && break 2
            kill -0 "$started" 2>/dev/null || break
            sleep 1
        done
        kill "$started" 2>/dev/null; wait "$started" 2>/dev/null
        echo "dockerd --storage-driver $driver did not start: $(tail -n 3 "$log")"
        started=""
    done
    [ -n "$started" ] || skip "dockerd does not start here"
    echo "dockerd started (pid $started, storage $driver)"
fi

stop_dockerd() {
    [ -n "$started" ] || return 0
    kill "$started" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$started" 2>/dev/null || break; sleep 1; done
    echo "dockerd stopped"
}
trap stop_dockerd EXIT

# smoke.py drives the API with the openai SDK (the README's install brings it; CI runs this step before that)
python3 -c "import openai, PIL, httpx" 2>/dev/null || python3 -m pip install -q openai pillow httpx

start=$(date +%s)
docker/smoke.sh "$@"
rc=$?
# keep the image and the base (the next run's build is then cached); drop dangling layers of earlier builds
docker image prune -f >/dev/null 2>&1
echo "docker smoke: exit $rc in $(( $(date +%s) - start )) s"
exit $rc
