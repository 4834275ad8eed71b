"""The engine config is declared once: the flags' defaults are EngineConfig's, --help prints them, and the
config is frozen (the engine keeps what fits GPU memory apart from what was asked)."""
import dataclasses

import pytest

from services.understanding.config import EngineConfig
from services.understanding.server import build_parser, parse_args


def test_flag_defaults_are_the_config_defaults():
    args = parse_args(["--model", "/ckpt", "--internal-token", "t"])
    assert EngineConfig.from_args(args) == EngineConfig(model_dir="/ckpt")


def test_help_shows_the_defaults():
    text = build_parser().format_help()
    for flag, field in [("--kv-cache-tokens", "kv_cache_tokens"), ("--max-model-len", "max_model_len"),
                        ("--chunked-prefill-size", "chunked_prefill_size")]:
        after = " ".join(text.split(flag, 2)[2].split())     # the flag's own help paragraph
        assert f"(default: {getattr(EngineConfig, field)})" in after.split(" --", 1)[0]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig(model_dir="/ckpt").kv_cache_tokens = 1
