#!/usr/bin/env bash
# Build the u1serve image with BuildKit, the host's pip configuration passed in at build time (never in a layer).
#   docker/build.sh                      # GPU image u1serve:latest on the CUDA runtime base
#   docker/build.sh --variant cpu        # CPU image u1serve:cpu on a local Debian base (made offline if absent),
#                                        # torch's CPU wheel and the tiny checkpoint at /opt/models/tiny
# Options: --tag T, --base IMAGE (instead of the default base), --torch SPEC (the torch requirement).
# Environment: DOCKER (client), DEBIAN_MIRROR (else the host apt's bookworm mirror), U1SERVE_DOCKER_CACHE (the
# base's rootfs tarball is kept there: later builds import it instead of running debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
variant=gpu tag="" base="" torch=""
while [ $# -gt 0 ]; do
    case $1 in
        --variant) variant=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        --base) base=$2; shift 2 ;;
        --torch) torch=$2; shift 2 ;;
        *) echo "usage: docker/build.sh [--variant gpu|cpu] [--tag T] [--base IMAGE] [--torch SPEC]" >&2; exit 2 ;;
    esac
done
case $variant in
    gpu) tag=${tag:-u1serve:latest}; torch=${torch:-torch} ;;
    # the README's pin: on machines with a local CPU build it resolves to it (pip's find-links)
    cpu) tag=${tag:-u1serve:cpu}; torch=${torch:-torch==2.13.0}; base=${base:-u1serve-base:bookworm} ;;
    *) echo "--variant gpu or cpu" >&2; exit 2 ;;
esac

# A client that builds with BuildKit: docker >= 23 needs the buildx plugin; Debian's 20.10 client has it built in.
docker_client() {
    local c
    for c in ${DOCKER:-} docker /usr/bin/docker; do
        command -v "$c" >/dev/null || continue
        if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return; fi
        local major
        major=$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ]; then echo "$c"; return; fi
    done
    echo "no docker client with BuildKit (install docker-buildx, or Debian's docker.io)" >&2
    return 1
}
DOCKER=$(docker_client)

# The local base: debootstrap minbase bookworm from the host apt's mirror, imported as an image (no registry).
make_base() {
    local image=$1 cache=${U1SERVE_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/u1serve/docker}
    local tarball=$cache/debian-bookworm-minbase.tar
    if [ ! -s "$tarball" ]; then
        local mirror=${DEBIAN_MIRROR:-}
        if [ -z "$mirror" ] && command -v apt-get >/dev/null; then
            mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Release: bookworm' 2>/dev/null | head -n 1)
        fi
        [ -n "$mirror" ] || { echo "set DEBIAN_MIRROR (no bookworm source in the host's apt configuration)" >&2; exit 2; }
        command -v debootstrap >/dev/null || { echo "debootstrap is needed to make $image" >&2; exit 2; }
        local root
        root=$(mktemp -d)
        echo "making $image: debootstrap --variant=minbase bookworm (mirror from the host's apt configuration)"
        nice -n 10 debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 \
            || { tail -n 20 "$root.log" >&2; exit 1; }
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
        mkdir -p "$cache"
        tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$root"
    fi
    "$DOCKER" import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' "$tarball" "$image" >/dev/null
    echo "imported $image from $tarball"
}
if [ "$variant" = cpu ] && ! "$DOCKER" image inspect "$base" >/dev/null 2>&1; then make_base "$base"; fi

# The host's pip configuration as secrets, its local wheels in docker/wheels (removed again on exit).
secrets=$(mktemp -d)
linked=()
cleanup() {
    rm -rf "$secrets"
    local w
    for w in "${linked[@]}"; do rm -f "docker/wheels/$w"; done
}
trap cleanup EXIT
before=$(ls docker/wheels)
python3 docker/pip_for_build.py "$secrets" docker/wheels
mapfile -t linked < <(comm -13 <(echo "$before") <(ls docker/wheels))
args=(--secret "id=pip.conf,src=$secrets/pip.conf")
if [ -f "$secrets/pip-cert" ]; then args+=(--secret "id=pip-cert,src=$secrets/pip-cert"); fi
if [ -n "$base" ]; then args+=(--build-arg "BASE_IMAGE=$base"); fi

start=$(date +%s)
DOCKER_BUILDKIT=1 nice -n 10 "$DOCKER" build --network host --progress plain -f docker/Dockerfile \
    --build-arg "VARIANT=$variant" --build-arg "TORCH=$torch" "${args[@]}" -t "$tag" .
size=$("$DOCKER" image inspect "$tag" --format '{{.Size}}')
echo "built $tag ($variant) in $(( $(date +%s) - start )) s: $(( size / 1000000 )) MB"
