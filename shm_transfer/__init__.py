"""Prefix-KV handoff from the understanding engine to the generation engine (see docs/kv_contract.md)."""
from .copy import CopyDone, export_kv, import_kv, read_kv, write_kv
from .errors import HandleError, KVTransferError, PoolError, PoolFull
from .handle import KVHandle
from .layout import LAYOUT_VERSION, KVLayout
from .pool import ShmKVPool
from .transport import LocalShmTransport, Transport

__all__ = [
    "CopyDone", "HandleError", "KVHandle", "KVLayout", "KVTransferError", "LAYOUT_VERSION",
    "LocalShmTransport", "PoolError", "PoolFull", "ShmKVPool", "Transport",
    "export_kv", "import_kv", "read_kv", "write_kv",
]
