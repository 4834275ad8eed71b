"""The floors of the tree, read from the source with ast (nothing is imported): no import circles among the modules
of services/, shm_transfer/, kernels/, bench/ and deploy/, and each package imports only the floors below it
(`MAY_IMPORT`). Every import counts, at module level, inside a function or under TYPE_CHECKING (a lazy import still
ties two modules together)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("services", "shm_transfer", "kernels", "bench", "deploy")

# Circles tolerated for a while, each with its owner and its cut (none today: keep it that way). A circle listed
# here that no longer exists fails the test too, so the set only shrinks.
KNOWN_CIRCLES: set[frozenset] = set()


def _modules() -> dict[str, str]:
    """dotted name -> file path, for every module of PACKAGES (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(folder, f)
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules of `modules` that the file imports (`from pkg import mod` is pkg.mod when that is a module)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[frozenset]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = set(_circles(graph))
    new = [sorted(c) for c in circles - KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES - circles]
    assert not gone, f"these known circles are gone: remove them from KNOWN_CIRCLES: {gone}"


# The floors, bottom up: a module of the key's package may import modules of these packages (and of its own). The
# ground floor (services.base: knobs, timeouts, networking, content runs, checkpoint file names) imports nothing of the project; the
# packages not listed (the launcher's, rl, ray_serve) are top floors over everything in services/, bench over them,
# deploy over bench.
BASE = ("services.base",)
ENGINE_FLOORS = (*BASE, "kernels", "shm_transfer", "services.contract", "services.model", "services.kit")
MAY_IMPORT = {
    "services.base": BASE,
    "kernels": (),
    "services.contract": BASE,
    "shm_transfer": (*BASE, "kernels"),
    "services.model": (*BASE, "kernels", "shm_transfer"),
    "services.kit": (*BASE, "services.contract"),
    "services.gateway": (*BASE, "services.contract", "services.kit"),
    "services.understanding": ENGINE_FLOORS,
    "services.generation": ENGINE_FLOORS,
    "services": (*ENGINE_FLOORS, "services"),
    "bench": ("services", "shm_transfer", "kernels", "bench"),
}
# Single imports across a floor, each with why (the set only shrinks: an entry no longer seen fails the test).
KNOWN_CROSSINGS = {
}


def _floor(name: str) -> str | None:
    """The MAY_IMPORT key a module belongs to (the longest that is its package or itself)."""
    keys = [k for k in MAY_IMPORT if name == k or name.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def _crossings(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for name, imported in graph.items():
        floor = _floor(name)
        if floor is None:
            continue
        allowed = (floor, *MAY_IMPORT[floor])
        out |= {(name, m) for m in imported if not name.startswith(m + ".")     # its own ancestor packages
                and not any(m == a or m.startswith(a + ".") for a in allowed)}
    return out


def test_each_package_imports_only_the_floors_below():
    modules = _modules()
    crossings = _crossings({name: _imports(name, path, modules) for name, path in modules.items()})
    new = sorted(crossings - set(KNOWN_CROSSINGS))
    assert not new, f"imports across the floors (MAY_IMPORT): {new}"
    gone = sorted(set(KNOWN_CROSSINGS) - crossings)
    assert not gone, f"these crossings are gone: remove them from KNOWN_CROSSINGS: {gone}"


def test_segment_is_the_bottom_of_shm_transfer():
    modules = _modules()
    assert _imports("shm_transfer.segment", modules["shm_transfer.segment"], modules) <= {
        "shm_transfer", "shm_transfer.locks", "shm_transfer.errors"}


def test_the_floors_see_a_crossing():
    graph = {"services.model.x": {"services.contract.image", "kernels.y"}, "kernels.y": set(),
             "services.gateway.a": {"services.model.x"}, "bench.b": {"deploy.c"}, "deploy.c": {"bench.b"}}
    assert _crossings(graph) == {("services.model.x", "services.contract.image"),
                                 ("services.gateway.a", "services.model.x"), ("bench.b", "deploy.c")}


def test_the_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
