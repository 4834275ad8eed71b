"""Prints the test extra's requirements on the test tools (pyproject.toml's bounds, one declaration) for
.ci/newest-test-tools: the tools a test imports or pytest loads, not the runtime extras the extra also pulls in."""
import os
import re

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    from pip._vendor import tomli as tomllib

TOOLS = {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "schemathesis", "openai", "pyyaml", "kubernetes-validate",
         "selenium"}

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml"), "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
found = [r for r in extra if re.match(r"[A-Za-z0-9._-]+", r)[0].lower() in TOOLS]
missing = TOOLS - {re.match(r"[A-Za-z0-9._-]+", r)[0].lower() for r in found}
assert not missing, f"not in the test extra: {sorted(missing)}"
print("\n".join(found))
