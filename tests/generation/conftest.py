"""Shared fixtures: one reference model, one pool and one generation server for this package (on
tests/conftest.py's `tiny_dir`; the pool and the server stop with the package)."""
from __future__ import annotations

import uuid

import pytest

from .genhelp import GenServer


@pytest.fixture(scope="session")
def ref_model(tiny_dir):
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    return load_model(tiny_dir, "both"), NeoTokenizer.from_dir(tiny_dir)


def make_pool(model, size_mb: int = 16, name: str | None = None, page_tokens: int = 16,
              dtype: str = "float32"):
    from shm_transfer import KVLayout, ShmKVPool
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, dtype, page_tokens)
    return ShmKVPool.create(name or f"u1gen-test-{uuid.uuid4().hex[:8]}", layout, size_mb << 20,
                            model.fingerprint, pin=False)


@pytest.fixture(scope="package")
def pool(ref_model):
    p = make_pool(ref_model[0])
    yield p
    p.close()


@pytest.fixture(scope="package")
def gen_server(tiny_dir, pool):
    s = GenServer(tiny_dir, pool.name).start()
    yield s
    s.stop()
