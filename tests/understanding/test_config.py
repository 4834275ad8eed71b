"""The understanding config is declared once: every flag is a field of ServerConfig (EngineConfig's for the engine),
its default the field's, --help prints it, a config built in process is checked as a parsed one, and the config is
frozen (the engine keeps what fits GPU memory apart from what was asked)."""
import dataclasses

import pytest

from services.understanding.config import EngineConfig, ServerConfig
from services.understanding.server import build_parser, parse_args


def test_flag_defaults_are_the_config_defaults(monkeypatch):
    monkeypatch.delenv("U1SERVE_STACK_ID", raising=False)
    cfg = parse_args(["--model", "/ckpt", "--internal-token", "t"])
    assert cfg == ServerConfig(model="/ckpt", internal_token="t")
    assert cfg.engine() == EngineConfig(model="/ckpt")
    assert "internal_token" not in {f.name for f in dataclasses.fields(cfg.engine())}


def test_help_shows_the_defaults():
    text = build_parser().format_help()
    for flag, field in [("--kv-cache-tokens", "kv_cache_tokens"), ("--max-model-len", "max_model_len"),
                        ("--chunked-prefill-size", "chunked_prefill_size"), ("--kv-lease-s", "kv_lease_s")]:
        after = " ".join(text.split(flag, 2)[2].split())     # the flag's own help paragraph
        assert f"(default: {getattr(ServerConfig, field)})" in after.split(" --", 1)[0]


def test_no_prefix_cache_switch():
    assert parse_args(["--model", "m", "--internal-token", "t", "--no-prefix-cache"]).engine().prefix_cache is False


@pytest.mark.parametrize("fields, why", [({"tp": 0}, "--tp must be >= 1"),
                                         ({"max_prefix_pool_share": 0.0}, "--max-prefix-pool-share"),
                                         ({"max_prefix_pool_share": 1.5}, "--max-prefix-pool-share"),
                                         ({"kv_transport": "nixl"}, "needs --kv-pool-name")])
def test_in_process_config_is_checked(fields, why):
    with pytest.raises(ValueError, match=why):
        ServerConfig(model="/ckpt", **fields)
    with pytest.raises(SystemExit):
        parse_args(["--model", "/ckpt", "--internal-token", "t",
                    *[a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), str(v))]])


def test_context_limit_clamped_to_the_kv_cache():
    assert EngineConfig(model="m", kv_cache_tokens=4096).max_model_len == 4096
    assert parse_args(["--model", "m", "--internal-token", "t", "--kv-cache-tokens", "2048"]).max_model_len == 2048


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig(model="/ckpt").kv_cache_tokens = 1
