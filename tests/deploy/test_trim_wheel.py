"""deploy/trim_wheel.py on a real native package: Pillow as its manylinux wheel installs it (PIL/ + pillow.libs/,
the libraries renamed with hashes). Trimmed to PIL's core extension (stripped, a module dropped), the result must
still import and encode in a fresh interpreter, keep the files' modes, and leave out what nothing kept needs."""
import glob
import os
import subprocess
import sys
import tarfile
import zipfile

import PIL

from deploy import trim_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SITE = os.path.dirname(os.path.dirname(PIL.__file__))


def _wheel(path: str) -> None:
    """The installed Pillow back as a wheel (a zip of its files, as pip found them)."""
    with zipfile.ZipFile(path, "w") as z:
        for top in ("PIL", "pillow.libs"):
            for f in glob.glob(os.path.join(SITE, top, "**", "*"), recursive=True):
                if os.path.isfile(f) and "__pycache__" not in f:
                    z.write(f, os.path.relpath(f, SITE))


def test_trimmed_pillow_imports_and_encodes(tmp_path):
    libs = sorted(os.listdir(os.path.join(SITE, "pillow.libs")))
    assert libs, "Pillow without vendored libraries: not the manylinux wheel this test is about"
    wheel, out = str(tmp_path / "pillow.whl"), str(tmp_path / "pillow.site.tar.xz")
    _wheel(wheel)
    proc = subprocess.run([sys.executable, "-m", "deploy.trim_wheel", wheel, "--root", "PIL/_imaging.*.so",
                           "--drop", "PIL/ImageTk.py", "--strip", "--out", out], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        site = tmp_path / "site"
        tar.extractall(site)

    core = next(n for n in names if n.startswith("PIL/_imaging.") and n.endswith(".so"))
    closure, todo = set(), [core]
    while todo:     # what the core extension needs among the vendored libraries, transitively
        for lib in trim_wheel.needed(str(site / todo.pop())):
            if lib in libs and lib not in closure:
                closure.add(lib)
                todo.append(f"pillow.libs/{lib}")
    assert {f"pillow.libs/{lib}" for lib in closure} <= names
    assert not [n for n in names if n.startswith("PIL/_webp.")], "an extension no root needs was kept"
    assert any(f"pillow.libs/{lib}" not in names for lib in libs), "nothing was trimmed"
    assert "PIL/Image.py" in names and "PIL/ImageTk.py" not in names
    installed = os.stat(os.path.join(SITE, core)).st_mode & 0o777
    assert (site / core).stat().st_mode & 0o777 == installed, "the mode bits were not kept (executables)"
    assert (site / core).stat().st_size <= os.path.getsize(os.path.join(SITE, core))

    check = ("import io, PIL; from PIL import Image; assert PIL.__file__.startswith(%r), PIL.__file__; "
             "im = Image.new('RGB', (8, 8), (200, 10, 10)); b = io.BytesIO(); im.save(b, 'PNG'); im.save(b, 'JPEG'); "
             "print('ok')" % str(site))
    run = subprocess.run([sys.executable, "-S", "-c", check], env={"PYTHONPATH": str(site), "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
