"""docker/pip_for_build.py: a host pip configuration (a config file plus PIP_* variables, as `pip config list` reports
them) becomes the build's pip.conf and CA bundle (BuildKit secrets) and linked local wheels; local file:// indexes
and anything else stay out."""
import configparser
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_pip_config_to_build_secrets(tmp_path):
    wheels, index, out, dest = (tmp_path / n for n in ("wheels", "index", "out", "dest"))
    for d in (wheels, index, out, dest):
        d.mkdir()
    (wheels / "torch-9.9.9+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    (wheels / "notes.txt").write_text("not a wheel")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "pip.conf").write_text(
        f"[global]\nindex-url = https://mirror.invalid/simple\n"
        f"extra-index-url = file://{index} https://extra.invalid/simple\n"
        f"find-links = {wheels}\ncert = {tmp_path / 'ca.pem'}\ntrusted-host = mirror.invalid\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), PIP_DEFAULT_TIMEOUT="77")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "docker", "pip_for_build.py"), str(out), str(dest)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "mirror.invalid" not in r.stdout      # names what it passed, never the values (URLs may hold credentials)
    conf = configparser.ConfigParser()
    conf.read(out / "pip.conf")
    g = conf["global"]
    assert g["index-url"] == "https://mirror.invalid/simple"
    assert g["extra-index-url"] == "https://extra.invalid/simple"      # the local file:// index is not carried
    assert g["trusted-host"] == "mirror.invalid" and g["timeout"] == "77"
    assert g["cert"] == "/run/secrets/pip-cert" and (out / "pip-cert").read_text().startswith("-----BEGIN")
    assert "find-links" not in g                                          # the Dockerfile mounts them at /wheels
    assert sorted(os.listdir(dest)) == ["torch-9.9.9+cpu-cp311-cp311-linux_x86_64.whl"]
    assert os.stat(dest / "torch-9.9.9+cpu-cp311-cp311-linux_x86_64.whl").st_ino == \
        os.stat(wheels / "torch-9.9.9+cpu-cp311-cp311-linux_x86_64.whl").st_ino   # a hard link, not a copy
