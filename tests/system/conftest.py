"""The system tests' clients of the shared stack (`stack`: tests/conftest.py) and the in-process reference."""
import pytest

from tests.system.stackproc import RunningStack


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    return tiny_checkpoint("u1")


def serve(stack: RunningStack):
    """A fixture's body: the stack once ready, stopped cleanly after."""
    stack.wait_ready()
    yield stack
    stack.stop_clean()


def sdk_client(stack: RunningStack):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=stack.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def openai_client(stack):
    return sdk_client(stack)


@pytest.fixture(scope="session")
def reference(tiny_model):
    """The single-process reference pipeline on the same checkpoint (tests may import model code)."""
    import torch
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    model = load_model(tiny_model, "both", dtype=torch.float32, device="cpu")
    return model, NeoTokenizer.from_dir(tiny_model)
