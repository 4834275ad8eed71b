"""Prefix-KV handoff from the understanding engine to the generation engine (see docs/kv_contract.md).

Names are imported on first use, so `shm_transfer.segment` (used by the launcher) does not pull in torch.
"""
import importlib

_EXPORTS = {
    "CopyDone": "copy", "export_kv": "copy", "import_kv": "copy", "read_kv": "copy", "write_kv": "copy",
    "HandleError": "errors", "KVTransferError": "errors", "PoolError": "errors", "PoolFull": "errors",
    "KVHandle": "handle", "LAYOUT_VERSION": "layout", "KVLayout": "layout", "ShmKVPool": "pool",
    "unlink_exact": "segment", "LocalShmTransport": "transport", "Transport": "transport",
    "DeviceTransport": "transport",
    "NixlTransport": "nixl_transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
