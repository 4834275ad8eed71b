"""The process-local registry of device pools' pages: pool name -> (generation, the pages tensor).

A pool created with `pages_device` keeps its page table in its (small) shared-memory segment, as every pool does,
and its pages in a tensor on that device, which only this process can address. The creator registers the tensor
here; a consumer in the same process (fused colocate: both engines are threads of one process) that attaches the
pool by name finds it here and copies device to device. A process that finds no entry (another process) can use the
page table (allocate, release, claim, leases) but never the pages: copies are refused (HandleError
`device_pages_elsewhere`), never served from memory that is not the pool's.
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_pages: dict[str, tuple[str, torch.Tensor]] = {}


def register(name: str, generation: str, pages: torch.Tensor) -> None:
    """The creator's pages of pool `name` at `generation` (a restarted producer replaces the entry)."""
    with _lock:
        _pages[name] = (generation, pages)


def lookup(name: str, generation: str) -> torch.Tensor | None:
    """The pages of that pool generation when its creator lives in this process, else None."""
    with _lock:
        entry = _pages.get(name)
    return entry[1] if entry is not None and entry[0] == generation else None


def unregister(name: str, generation: str) -> None:
    """The creator closed: forget its pages (only that generation's: a successor may have registered already)."""
    with _lock:
        if name in _pages and _pages[name][0] == generation:
            del _pages[name]
