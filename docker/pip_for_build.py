#!/usr/bin/env python3
"""The host's pip configuration, made usable inside `docker build` (docker/build.sh calls this).

Writes OUT/pip.conf (network indexes, trusted hosts, timeout; the CA bundle as OUT/pip-cert) to pass as BuildKit
secrets, and links the wheels of the host's local `find-links` directories into WHEELS (mounted at /wheels for
the install RUN). Local `file://` *indexes* are not carried: they mirror network indexes and can be gigabytes.
Nothing here is committed or baked into a layer: the secrets and the bind mount exist only during the RUN.
"""
from __future__ import annotations

import argparse
import configparser
import os
import shutil
import subprocess
import sys
from urllib.parse import urlparse

KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "timeout", "default-timeout")


def host_settings() -> dict[str, list[str]]:
    """`pip config list` (files and PIP_* variables), later sources winning per key, values split on spaces."""
    text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          check=True).stdout
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        name, _, value = line.partition("=")
        key = name.rsplit(".", 1)[-1]
        if key in KEYS and name.split(".", 1)[0] in ("global", "install", ":env:"):
            out[key] = value.strip().strip("'\"").split()
    if "default-timeout" in out:
        out["timeout"] = out.pop("default-timeout")
    return out


def local_dir(location: str) -> str | None:
    url = urlparse(location)
    if url.scheme in ("", "file"):
        return url.path if os.path.isdir(url.path) else None
    return None


def link_wheels(dirs: list[str], dest: str) -> list[str]:
    """Hard links (a copy across filesystems) of each directory's wheels into dest; their names."""
    names = []
    for d in dirs:
        for name in sorted(os.listdir(d)):
            src, dst = os.path.join(d, name), os.path.join(dest, name)
            if not name.endswith(".whl") or not os.path.isfile(src) or os.path.exists(dst):
                continue
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            names.append(name)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory for pip.conf and pip-cert (a private temporary directory)")
    ap.add_argument("wheels", help="directory the wheels are linked into (docker/wheels)")
    args = ap.parse_args()
    settings = host_settings()
    conf = configparser.ConfigParser()
    conf["global"] = {}
    network = lambda urls: [u for u in urls if urlparse(u).scheme in ("http", "https")]  # noqa: E731
    if network(settings.get("index-url", [])):
        conf["global"]["index-url"] = network(settings["index-url"])[0]
    if network(settings.get("extra-index-url", [])):
        conf["global"]["extra-index-url"] = " ".join(network(settings["extra-index-url"]))
    for key in ("trusted-host", "timeout"):
        if settings.get(key):
            conf["global"][key] = " ".join(settings[key])
    cert = (settings.get("cert") or [""])[0]
    if cert and os.path.isfile(cert):
        shutil.copyfile(cert, os.path.join(args.out, "pip-cert"))
        conf["global"]["cert"] = "/run/secrets/pip-cert"
    with open(os.path.join(args.out, "pip.conf"), "w") as f:
        conf.write(f)
    dirs = [d for d in map(local_dir, settings.get("find-links", [])) if d]
    names = link_wheels(dirs, args.wheels)
    print(f"pip for the build: indexes {sorted(conf['global'].keys())}; {len(names)} local wheels from "
          f"{', '.join(dirs) or 'no find-links directory'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
