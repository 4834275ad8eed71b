#!/usr/bin/env python3
"""Trim a native wheel to what we import, for machines without a package index that take a size-limited copy of
the repository (the GPU machine: 64 MiB in all). The NIXL CUDA wheel is 59 MB, mostly plugins we never load
(object stores, GPUDirect Storage, ...) and their libraries.

    python -m deploy.trim_wheel nixl_cu13-1.5.1-cp312-*.whl --also nixl-1.5.1-py3-none-any.whl \\
        --root 'nixl_cu13/*.so' --root '*/libplugin_UCX.so' --root 'nixl_cu13.libs/ucx/libuct_*.so*' \\
        --root 'nixl_cu13.libs/ucx/libucm_*.so*' --out .whl/nixl_cu13-1.5.1-slim-cp312.site.tar.xz

Keeps every pure-Python file and .dist-info, the --root shared objects, and every library they need (DT_NEEDED,
transitively, found among the wheel's own files; read from the ELF dynamic section here, no binutils needed);
writes a .tar.xz (xz -9e) to unpack into a site directory (deploy/carried_wheels.sh does that when the cpXY tag
matches the Python). --drop leaves out files we never import (whole subpackages: Ray's RLlib, Data, LLM); --strip
runs binutils' `strip --strip-unneeded` on the kept ELF files (Ray's wheel ships its binaries with their symbol
tables: 44 MB of _raylet.so, 32 MB stripped). The Ray command is in docs/benchmarks/ray.md.
"""
from __future__ import annotations

import argparse
import fnmatch
import lzma
import os
import shutil
import struct
import subprocess
import tarfile
import tempfile
import zipfile


def needed(path: str) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object (what wheels for x86_64 / aarch64 hold)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 6:                                    # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:                                 # DT_NULL
                break
            if tag == 1:                                 # DT_NEEDED: an offset into the dynamic string table
                start = strtab + value
                names.append(data[start:data.index(b"\0", start)].decode())
    return names


def extract(wheel: str, root: str) -> None:
    """Unzip, keeping each file's mode bits (zipfile drops them: Ray's raylet and GCS server must stay executable)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, root)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)


def keep_set(root: str, patterns: list[str], drop: tuple[str, ...] = ()) -> set[str]:
    files = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
    files = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in drop)]
    by_name: dict[str, str] = {}
    for f in files:
        by_name.setdefault(os.path.basename(f), f)
    keep = {f for f in files if f.endswith(".py") or ".dist-info/" in f or f.endswith("py.typed")}
    todo = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if not todo:
        raise SystemExit(f"no file matches {patterns}")
    while todo:
        f = todo.pop()
        if f in keep:
            continue
        keep.add(f)
        todo += [by_name[n] for n in needed(os.path.join(root, f)) if n in by_name]
    return keep


def strip(path: str) -> None:
    """The symbol tables out of a kept ELF file (what the dynamic loader reads stays)."""
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            return
    subprocess.run(["strip", "--strip-unneeded", path], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel")
    p.add_argument("--also", action="append", default=[], help="more (pure-Python) wheels to include whole")
    p.add_argument("--root", action="append", required=True, help="glob of shared objects to keep (repeatable)")
    p.add_argument("--drop", action="append", default=[], help="glob of files to leave out (repeatable)")
    p.add_argument("--strip", action="store_true", help="strip the kept ELF files (needs binutils' strip)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.strip and not shutil.which("strip"):
        raise SystemExit("--strip needs binutils' `strip` on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        for w in [args.wheel, *args.also]:
            extract(w, tmp)
        keep = keep_set(tmp, args.root, tuple(args.drop))
        if args.strip:
            for f in keep:
                strip(os.path.join(tmp, f))
        with tarfile.open(args.out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
            for f in sorted(keep):
                tar.add(os.path.join(tmp, f), arcname=f)
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in keep)
    print(f"{args.out}: {len(keep)} files, {size / 1e6:.1f} MB unpacked, {os.path.getsize(args.out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
