# Sourced by the GPU hand-off scripts: the wheels carried in .whl/ (the GPU machine has no package index) are
# installed into a private site dir and put on PYTHONPATH. Wheels built for another Python (a CPU machine
# running a --smoke/--cpu mode) are skipped: the packages installed there are used.
# .whl/*-cpXY.site.tar.xz: a native wheel too large to carry whole, trimmed to what we import by
# deploy/trim_wheel.py (NIXL: its bindings, core and UCX plugin with their libraries; the command is in its
# docstring; Ray: deploy/ray/build_carry.sh), unpacked as is into the same site dir when the Python matches.
# CARRY_SITE_DIR names another site dir (a check of a carry on a machine where another one is unpacked).
# build_carried_wheels (on the CPU machine) fills .whl/ for the GPU machine's Python 3.12: the serving packages at
# the versions installed here WITH their dependencies (a new one, e.g. FastAPI 0.165's opentelemetry-api, travels
# too); use_carried_wheels then checks that the stack's imports resolve before anything starts.
CARRIED_PACKAGES="fastapi uvicorn openai pyzmq python-multipart pydantic httpx"
build_carried_wheels() {
    local pins
    pins=$(python3 -c 'import sys, importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' \
        $CARRIED_PACKAGES) || return 1
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl $pins
}
use_carried_wheels() {
    compgen -G ".whl/*.whl" >/dev/null || compgen -G ".whl/*.site.tar.xz" >/dev/null || return 0
    local site=${CARRY_SITE_DIR:-/tmp/u1serve-site} tag bundle
    tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if ! compgen -G ".whl/*.whl" >/dev/null ||
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl 2>/dev/null; then
        for bundle in .whl/*-"$tag".site.tar.xz; do
            [ -e "$bundle" ] && mkdir -p "$site" && tar xJf "$bundle" -C "$site"
        done
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        python3 -c "import fastapi, uvicorn, openai, zmq, pydantic, httpx" ||
            { echo "carried wheels in .whl/ miss a dependency: rebuild with build_carried_wheels" >&2; return 1; }
    else
        echo "carried wheels in .whl/ do not fit $(python3 -V); using the installed packages" >&2
    fi
}
