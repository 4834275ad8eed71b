"""The flags of the three services and `u1serve up` are the ones the project had before they were generated from
the typed configs: same names, defaults, choices and actions (data/flag_sets.json, written from the hand-written
parsers; regenerate it with `python -m tests.structure.flag_sets` only for a deliberate change of the command
line). Run in a child process without U1SERVE_* variables, since several defaults come from the environment."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _current() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("U1SERVE_")}
    out = subprocess.run([sys.executable, "-m", "tests.structure.flag_sets"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


def test_flags_unchanged():
    with open(os.path.join(HERE, "data", "flag_sets.json"), encoding="utf-8") as f:
        before = json.load(f)
    now = _current()
    for service in before:
        assert sorted(now[service]) == sorted(before[service]), service
        changed = {flag: (before[service][flag], now[service][flag]) for flag in before[service]
                   if before[service][flag] != now[service][flag]}
        assert not changed, f"{service}: {changed}"
