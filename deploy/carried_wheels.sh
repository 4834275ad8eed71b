# Sourced by the GPU hand-off scripts: the wheels carried in .whl/ (the GPU machine has no package index) are
# installed into a private site dir and put on PYTHONPATH. Wheels built for another Python (a CPU machine
# running a --smoke/--cpu mode) are skipped: the packages installed there are used.
use_carried_wheels() {
    compgen -G ".whl/*.whl" >/dev/null || return 0
    local site=/tmp/u1serve-site
    if python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl 2>/dev/null; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "carried wheels in .whl/ do not fit $(python3 -V); using the installed packages" >&2
    fi
}
