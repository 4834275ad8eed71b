"""The configuration modules are leaves: reading a config (its flags, defaults and choices) imports no torch, no
Triton and no web framework, so `u1serve --help` stays instant and the launcher can derive its flags from the engines' configs. The
constants a config offers live in the config (or a torch-free module such as services/model/choices.py) and the
modules that use them import them from there. Each module is imported in a fresh interpreter."""
import subprocess
import sys

import pytest

LEAVES = ["services.generation.config", "services.understanding.config", "services.launch.stack"]
PROBE = ("import sys, importlib; importlib.import_module({mod!r}); "
         "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'kernels', 'fastapi'))))")


@pytest.mark.parametrize("module", LEAVES)
def test_config_imports_no_torch(module):
    out = subprocess.run([sys.executable, "-c", PROBE.format(mod=module)], check=True, capture_output=True,
                         text=True, timeout=120).stdout.strip()
    assert out == "", f"{module} pulls in {out[:300]}"
