"""The environment knobs are declared once (services/base/knobs.py): every U1SERVE_* name anywhere in the tree is one of
them, the code outside kernels/ reads none behind the registry's back, and docs/configuration.md lists them all."""
import ast
import os
import re

import pytest

from services.base import knobs
from services.gateway.config import flag_knobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = re.compile(r"U1SERVE_[A-Z0-9_]*[A-Z0-9]")
TEXT = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".json", ".env", ".txt", ".cfg", ".html", ".js", "Dockerfile")
SKIP_DIRS = {".git", "__pycache__", "node_modules", "test-artifacts", ".pytest_cache"}
READERS = ("services", "shm_transfer", "deploy", "bench")   # kernels/ imports nothing of services: it reads os.environ


def _files(folders=None, suffixes=TEXT):
    for top in folders or [""]:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            for f in files:
                if f.endswith(suffixes):
                    yield os.path.join(folder, f)


def test_every_name_in_the_tree_is_declared():
    declared = set(knobs.KNOBS) | {k.name for k in flag_knobs()}
    unknown = {}
    for path in _files():
        with open(path, encoding="utf-8", errors="ignore") as f:
            for name in set(NAME.findall(f.read())) - declared:
                unknown.setdefault(name, os.path.relpath(path, ROOT))
    assert not unknown, f"U1SERVE_* names not declared in services/base/knobs.py: {unknown}"


def _env_reads(tree: ast.AST):
    """Line numbers of os.environ.get("U1SERVE_..."), os.environ["U1SERVE_..."] (read) and os.getenv("U1SERVE_...")."""
    def literal(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("U1SERVE_")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and literal(node.args[0]):
            owner = node.func.value
            if (node.func.attr == "get" and isinstance(owner, ast.Attribute) and owner.attr == "environ") or \
                    node.func.attr == "getenv":
                yield node.lineno
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and literal(node.slice) and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            yield node.lineno


def test_code_reads_knobs_through_the_registry():
    found = []
    for path in _files(READERS, (".py",)):
        if path.endswith(os.path.join("services", "base", "knobs.py")):
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _env_reads(ast.parse(f.read(), path))]
    assert not found, f"read these through services/base/knobs.py: {found}"


def test_the_reader_finds_a_direct_read():
    p = "U1SERVE" + "_"      # (names that are not knobs, kept out of the tree-wide check above)
    tree = ast.parse(f'import os\na = os.environ.get("{p}X")\nb = os.environ["{p}Y"]\n'
                     f'os.environ["{p}Z"] = "1"\nc = os.getenv("{p}W")\n')
    assert list(_env_reads(tree)) == [2, 3, 5]


def test_docs_list_the_registry():
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("<!-- knobs:begin", 1)[1].split("-->", 1)[1].split("<!-- knobs:end -->", 1)[0]
    assert table.strip() == knobs.markdown(flag_knobs()).strip(), \
        "docs/configuration.md is stale: paste `u1serve knobs --markdown` between its markers"


def test_typed_reads(monkeypatch):
    monkeypatch.setenv(knobs.KV_SAME_HOST_SHM.name, " off ")
    assert knobs.KV_SAME_HOST_SHM.get() is False
    monkeypatch.setenv(knobs.PNG_THREADS.name, "3")
    assert knobs.PNG_THREADS.get() == 3
    monkeypatch.delenv(knobs.FP8_MIN_TOKENS.name, raising=False)
    assert knobs.FP8_MIN_TOKENS.get(default=7) == 7          # a default computed where it is read
    monkeypatch.setenv(knobs.TIMELINE.name, "maybe")
    with pytest.raises(ValueError, match="U1SERVE_TIMELINE must be 0 or 1"):
        knobs.TIMELINE.get()
    assert knobs.CUDA_GRAPHS.get({knobs.CUDA_GRAPHS.name: "1"}) is True   # from a given environment


def test_u1serve_knobs_lists_them(capsys):
    from services.launch.cli import main
    with pytest.raises(SystemExit) as done:
        main(["knobs"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*knobs.KNOBS, "U1SERVE_MAX_STEPS"])
