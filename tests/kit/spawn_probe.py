"""Run as `python -m tests.kit.spawn_probe`: a main module that imports FastAPI (as a server does), then starts two
`spawn` children, one as multiprocessing does and one with kit.proc.start_without_main, each printing whether it
has FastAPI and whether its target ran (test_spawn_without_main.py)."""
import multiprocessing as mp
import sys

import fastapi  # noqa: F401  (what a server's __main__ imports)

from services.kit.proc import start_without_main
from tests.kit.spawn_target import report

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for how in ("plain", "without_main"):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=report, args=(w,))
        p.start() if how == "plain" else start_without_main(p)
        w.close()
        print(how, r.recv(), flush=True)
        p.join()
    print("main_keeps", getattr(sys.modules["__main__"].__spec__, "name", None), flush=True)
