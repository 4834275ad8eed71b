#!/usr/bin/env bash
# The file moves of issue 40's ground floor, as one idempotent step (run it from the repository root, on any
# branch that has these modules at the root of services/; a second run changes nothing):
#   services/{knobs,timeouts,netutil}.py                        -> services/base/     (the ground floor)
#   services/{cli,stack,launcher,stack_replicas,hub,gpus,mps,
#             colocate_qos,lora_flags,progress}.py              -> services/launch/   (`u1serve` and its helpers)
# then every reference rewritten: dotted module names, `from services import X`, file paths, the console script.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

BASE="knobs timeouts netutil"
LAUNCH="cli stack launcher stack_replicas hub gpus mps colocate_qos lora_flags progress"

mkdir -p services/base services/launch
[ -f services/base/__init__.py ] || {
  printf '%s\n' '"""The ground floor: helpers with no project imports of their own, which every other package may import."""' \
    > services/base/__init__.py
  git add services/base/__init__.py
}
[ -f services/launch/__init__.py ] || {
  printf '%s\n' '"""`u1serve` and the launcher: the command line, the stack plan (engines, gateway, GPUs, MPS, QoS) and the' \
    'supervisor that starts and stops its processes."""' > services/launch/__init__.py
  git add services/launch/__init__.py
}
for m in $BASE; do
  if [ -f "services/$m.py" ] && [ ! -f "services/base/$m.py" ]; then git mv "services/$m.py" "services/base/$m.py"; fi
done
for m in $LAUNCH; do
  if [ -f "services/$m.py" ] && [ ! -f "services/launch/$m.py" ]; then git mv "services/$m.py" "services/launch/$m.py"; fi
done

BASE="$BASE" LAUNCH="$LAUNCH" python3 - <<'EOF'
import os
import re
import subprocess

base = os.environ["BASE"].split()
launch = os.environ["LAUNCH"].split()
home = {**{m: "base" for m in base}, **{m: "launch" for m in launch}}
names = "|".join(sorted(home, key=len, reverse=True))

TEXT = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".env", ".ini", ".html", ".js")
files = [f for f in subprocess.check_output(["git", "ls-files"], text=True).splitlines()
         if os.path.isfile(f) and not os.path.islink(f)
         and (f.endswith(TEXT) or os.path.basename(f).startswith("Dockerfile") or f.startswith(".ci/"))]

dotted = re.compile(rf"(?<![\w.])services\.({names})\b")
path = re.compile(rf"(?<![\w.])services/({names})\.py\b")
joined = re.compile(rf"""os\.path\.join\((["'])services\1, (["'])({names})\.py\2\)""")
from_services = re.compile(r"^(?P<ind>[ \t]*)from services import (?P<items>[^()\n#]+?)(?P<cmt>[ \t]*#.*)?$", re.M)


def split_from(m: re.Match) -> str:
    """`from services import a, b as c` -> one line per new package (names that did not move stay)."""
    items = [x.strip() for x in m.group("items").split(",") if x.strip()]
    groups: dict[str, list[str]] = {}
    for item in items:
        mod = item.split(" as ")[0].strip()
        pkg = f"services.{home[mod]}" if mod in home else "services"
        groups.setdefault(pkg, []).append(item)
    cmt = m.group("cmt") or ""
    lines = [f"{m.group('ind')}from {pkg} import {', '.join(its)}" for pkg, its in sorted(groups.items())]
    lines[-1] += cmt
    return "\n".join(lines)


changed = []
for f in files:
    try:
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError:
        continue
    new = dotted.sub(lambda m: f"services.{home[m.group(1)]}.{m.group(1)}", text)
    new = path.sub(lambda m: f"services/{home[m.group(1)]}/{m.group(1)}.py", new)
    new = joined.sub(lambda m: f'os.path.join("services", "{home[m.group(3)]}", "{m.group(3)}.py")', new)
    if f.endswith(".py"):
        new = from_services.sub(split_from, new)
    if new != text:
        with open(f, "w", encoding="utf-8") as fh:
            fh.write(new)
        changed.append(f)
# the floors test names the ground floor by its old root modules too (so it holds before the moves): one name now
floors = "tests/structure/test_import_circles.py"
if os.path.exists(floors):
    with open(floors, encoding="utf-8") as fh:
        text = fh.read()
    old = ", ".join(f'"services.base.{m}"' for m in base)
    new = text.replace(f'("services.base", {old})', '("services.base",)')
    new = re.sub(rf'    "services\.base\.({"|".join(base)})": BASE,\n', "", new)
    if new != text:
        with open(floors, "w", encoding="utf-8") as fh:
            fh.write(new)
        changed.append(floors)
print(f"MOVES: {len(changed)} files rewritten")
EOF
git add -A services docs tests bench deploy docker shm_transfer kernels pyproject.toml README.md .ci 2>/dev/null || true
