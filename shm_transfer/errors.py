"""Errors of the KV handoff. Services map them to HTTP statuses (see docs/kv_contract.md)."""


class KVTransferError(Exception):
    """Base class of every error raised by shm_transfer."""


class PoolFull(KVTransferError):
    """Not enough free pages right now (never blocks). Services answer 429 `kv_pool_full` with Retry-After."""

    def __init__(self, message: str, *, pages_needed: int, pages_free: int, pages_total: int):
        super().__init__(message)
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.pages_total = pages_total


class HandleError(KVTransferError):
    """A handle that cannot be used with this pool: malformed, wrong pool/generation/fingerprint/layout,
    or its pages were freed or reclaimed. `code` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "invalid_handle"):
        super().__init__(message)
        self.code = code


class PoolError(KVTransferError):
    """The segment itself is unusable: missing, not ready, corrupt, too small, /dev/shm too small."""
