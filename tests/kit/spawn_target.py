"""The child of tests/kit/spawn_probe.py: in a module of its own, as engine ranks are (pickled by name)."""
import sys


def report(conn) -> None:
    conn.send({"fastapi": "fastapi" in sys.modules, "ran": True})
    conn.close()
