"""One real multi-node Ray cluster with the application for the whole module (starting it takes a minute or
two on a busy 2-core machine), and the reference outputs of `u1serve up` with the same flags."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the Ray tests need the [ray] extra (in [test])")

from openai import OpenAI  # noqa: E402

from tests.ray.harness import SEEDS, RayApp, UpStack, chat_text, image_digest  # noqa: E402




@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A U1SERVE_CACHE with the tiny checkpoint written once (every node reads the same path)."""
    import os
    from services.launch.stack import ensure_tiny_checkpoint
    path = str(tmp_path_factory.mktemp("u1cache"))
    old = os.environ.get("U1SERVE_CACHE")
    os.environ["U1SERVE_CACHE"] = path
    try:
        ensure_tiny_checkpoint("u1")
    finally:
        if old is None:
            del os.environ["U1SERVE_CACHE"]
        else:
            os.environ["U1SERVE_CACHE"] = old
    return path


@pytest.fixture(scope="module")
def up(cache, tmp_path_factory):
    """`u1serve up` with the same stack flags, for the whole module."""
    stack = UpStack(cache, str(tmp_path_factory.mktemp("up") / "up.log"))
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference(up):
    """`u1serve up`'s images for SEEDS and its greedy chat answer."""
    client = OpenAI(base_url=up.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    return {"images": {s: image_digest(client, s) for s in SEEDS}, "chat": chat_text(client)}


@pytest.fixture(scope="module")
def app(cache, reference, tmp_path_factory):
    ray_app = RayApp(str(tmp_path_factory.mktemp("ray")), cache)
    try:
        yield ray_app.start()
    finally:
        ray_app.stop()


@pytest.fixture
def client(app):
    return OpenAI(base_url=app.base + "/v1", api_key="unused", timeout=120, max_retries=4)
