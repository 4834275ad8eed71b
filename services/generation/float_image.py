"""The float result of an interleaved answer's image, handed back through the KV pool.

The answer continues from the image exactly as denoised (interleave_spec §2.6: no uint8 round trip), so the
final Euler state goes into pool pages this service allocates (`shm_transfer.tensors` packs it into a handle's
shape); understanding reads it back and releases it when the answer ends. Nobody left to use it (the stream ended
early) -> release it here; a crash -> the lease reclaims it.
"""
from __future__ import annotations

import torch

from services.contract.interleave import FLOAT_IMAGE_BRANCH

from services.kit.errors import APIError

IMAGE_LEASE_S = 300.0        # until understanding first reads it (every read extends it)


def export(source, x: torch.Tensor, near: dict) -> dict:
    """x [3, H, W] (the model's dtype) into new pages of the pool that holds `near` (the job's cond handle: the
    understanding replica that reads the image back is the one that made the prefix; with replicas that is not
    necessarily this service's own pool); returns the KVHandle dict. APIError when the pool is full or unavailable
    (it is on another host: interleaved answers need generation beside understanding): the job fails alone."""
    from shm_transfer import KVHandle, PoolFull
    from shm_transfer.errors import KVTransferError
    from shm_transfer.tensors import pack, tokens_for
    try:
        near_handle = KVHandle.from_dict(near)
        # device pages (both engines in one process) stay device; network handles' pools are written through shm
        t = source.transport("device" if near_handle.transport == "device" else "shm", near_handle)
        h = t.allocate(tokens_for(t.layout, x.numel()), IMAGE_LEASE_S, branch=FLOAT_IMAGE_BRANCH,
                       near=near_handle)
    except PoolFull as e:
        raise APIError(503, f"no room in the KV pool for the generated image: {e}", type="server_error",
                       code="kv_pool_full") from None
    except (KVTransferError, ValueError) as e:      # no pool attached, replaced, or of another layout
        raise APIError(503, f"the KV pool cannot take the generated image: {e}", type="server_error",
                       code="kv_pool_unavailable") from None
    try:
        t.write_kv(h, pack(x, t.layout))
    except (KVTransferError, ValueError) as e:
        t.release(h)
        raise APIError(503, f"the generated image could not be written to the KV pool: {e}", type="server_error",
                       code="kv_pool_unavailable") from None
    except BaseException:
        t.release(h)
        raise
    return h.to_dict()
