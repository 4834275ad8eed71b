"""`u1serve up --dry-run` and `u1serve plan` in the test process: the CLI's own parser and planner, its output and
exit status as a child process would give them, without a child's interpreter start (a dry run or a plan starts
nothing and reads only its flags and the checkpoint's config; tens of them per file, ~5 s each as a child)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback


@contextlib.contextmanager
def environment(env: dict[str, str] | None):
    """`env` added to os.environ for the block (the CLI reads its U1SERVE_* knobs from there), then restored."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dry_run(model: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`u1serve up --model MODEL --device cuda FLAGS --dry-run` with `env` added to the environment."""
    return cli("up", "--model", model, "--device", "cuda", *flags, "--dry-run", env=env)


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`u1serve ARGV` (a command that starts nothing) with `env` added to the environment."""
    from services.launch.cli import main
    out, err = io.StringIO(), io.StringIO()
    with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0                        # (main always exits; kept for a main that returns)
        except SystemExit as done:          # main exits with the command's status; argparse and usage errors: 2
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:                           # SystemExit("why"): the interpreter prints it, status 1
                err.write(f"{done.code}\n")
                code = 1
        except Exception:                   # as the interpreter would: the traceback on stderr, status 1
            traceback.print_exc(file=err)
            code = 1
    return subprocess.CompletedProcess(["u1serve", *argv], code, out.getvalue(), err.getvalue())
