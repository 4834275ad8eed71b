#!/usr/bin/env bash
# Ray smoke test on CPU: a real multi-node Ray cluster on this machine (a head and two worker nodes, each its own
# `ray start` with its own resources and a private /dev/shm, i.e. its own shared-memory domain), the application
# deployed by `u1serve ray up` on the tiny checkpoint, checked through the Serve ingress with the openai SDK:
#   1. images bit-identical to `u1serve up`'s for fixed seeds (prefixes crossing nodes over NIXL and within a node
#      over shared memory), and the same greedy chat answer;
#   2. generation scaled up (2 -> 3 replicas) on its own queue depth under load;
#   3. a node SIGKILLed mid-load: no request lost or hung, the replica counts restored;
# and, when run as root with iproute2, the KV transport between two network namespaces joined by a veth pair.
# Exit status 0 only if every check passed. Needs `pip install -e '.[ray,test]'`. A few minutes on 2 idle cores.
#
#   deploy/ray/smoke.sh            # everything
#   deploy/ray/smoke.sh -k kill    # pytest's selection, passed on
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import ray.serve, openai, nixl" 2>/dev/null; then
    echo "ray smoke: needs Ray Serve, the openai SDK and NIXL: pip install -e '.[ray,test]'" >&2
    exit 2
fi
status=0
nice -n 10 python3 -m pytest -q -p no:cacheprovider tests/ray/test_ray_serve.py "$@" || status=1
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && [ $# -eq 0 ]; then
    UCX_TLS=tcp nice -n 10 python3 -m bench.bench_handoff --smoke --transport network --netns || status=1
else
    echo "ray smoke: the network-namespace KV check needs root and iproute2: skipped" >&2
fi
if [ "$status" = 0 ]; then echo "ray smoke: every check passed"; else echo "ray smoke: FAILED" >&2; fi
exit "$status"
