"""The generation config checks itself: a config built in process is refused as the same parsed flags are."""
import argparse

import pytest

from services.generation.config import GenerationConfig, add_config_flags, config_from_args


@pytest.mark.parametrize("fields, why", [({"cfg_parallel": 0}, "--cfg-parallel"), ({"sp": 0}, "--sp"),
                                         ({"graph_segment_layers": 0}, "--graph-segment-layers"),
                                         ({"yield_share": 0.0}, "--yield-share"),
                                         ({"kv_pool_wait_s": -1.0}, "--kv-pool-wait-s"),
                                         ({"sp_mode": "ring"}, "--sp-mode must be one of"),
                                         # weight streaming, where it cannot work: why is in the message
                                         ({"weight_streaming_layers": -1}, "must be >= 0"),
                                         ({"weight_streaming_layers": 2, "cuda_graphs": "on"},
                                          "needs --cuda-graphs off .* device address"),
                                         ({"weight_streaming_layers": 2, "cfg_parallel": 2},
                                          "one engine rank .* pinned host copy"),
                                         ({"weight_streaming_layers": 2, "sp": 2}, "one engine rank"),
                                         ({"graph_keys": "shape", "sp": 2}, "--graph-keys shape .*--sp 1"),
                                         ({"graph_keys": "shape", "cuda_graphs": "off"}, "CUDA graphs, which are off"),
                                         ({"graph_keys": "shape", "weight_streaming_layers": 2},
                                          "CUDA graphs, which are off")])
def test_bad_values_refused_in_process_and_parsed(fields, why):
    with pytest.raises(ValueError, match=why):
        GenerationConfig(model="m", **fields)
    p = argparse.ArgumentParser()
    add_config_flags(p)
    argv = ["--model", "m"] + [a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), str(v))]
    with pytest.raises(SystemExit):
        config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("fields", [{"cache_threshold": -1.0}, {"cache_warmup_steps": -1}, {"cfg_truncation": 2.0}])
def test_step_caching_defaults_checked_as_a_requests_cache(fields):
    from services.generation.perf_options import CacheDefaults, add_perf_flags, cache_defaults
    with pytest.raises(ValueError):
        CacheDefaults(**fields)
    p = argparse.ArgumentParser()
    add_perf_flags(p)
    with pytest.raises(SystemExit):
        cache_defaults(p.parse_args([a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), str(v))]))
    assert cache_defaults(p.parse_args([])) == CacheDefaults().options()


def test_weight_streaming_turns_auto_graphs_off(monkeypatch):
    monkeypatch.delenv("U1SERVE_CUDA_GRAPHS", raising=False)
    p = argparse.ArgumentParser()
    add_config_flags(p)
    cfg = config_from_args(p.parse_args(["--model", "m", "--weight-streaming-layers", "2"]))
    assert cfg.weight_streaming_layers == 2 and cfg.cuda_graphs == "off"
    monkeypatch.setenv("U1SERVE_CUDA_GRAPHS", "1")      # the override asks for graphs: refused, not ignored
    with pytest.raises(SystemExit, match="--cuda-graphs off"):
        config_from_args(p.parse_args(["--model", "m", "--weight-streaming-layers", "2"]))


@pytest.mark.parametrize("argv, keys", [([], "shape"), (["--graph-keys", "job"], "job"), (["--sp", "2"], "job"),
                                        (["--cfg-parallel", "2"], "job"),
                                        (["--cfg-parallel", "2", "--graph-keys", "shape"], "shape"),
                                        (["--cuda-graphs", "off"], "job"), (["--weight-streaming-layers", "2"], "job"),
                                        (["--graph-keys", "shape"], "shape")])
def test_graph_keys_auto_is_shape_where_it_applies_and_job_elsewhere(monkeypatch, argv, keys):
    """The default keys graphs by shape where that was measured (one engine rank: docs/benchmarks/generation.md);
    elsewhere it is job without a word; asked for by name, shape runs where it can and is refused where not (above)."""
    monkeypatch.delenv("U1SERVE_CUDA_GRAPHS", raising=False)
    p = argparse.ArgumentParser()
    add_config_flags(p)
    cfg = config_from_args(p.parse_args(["--model", "m"] + argv))
    asked = argv[argv.index("--graph-keys") + 1] if "--graph-keys" in argv else "auto"
    assert cfg.graph_keys == asked and cfg.step_graph_keys == keys
    monkeypatch.setenv("U1SERVE_CUDA_GRAPHS", "0")
    assert config_from_args(p.parse_args(["--model", "m"])).step_graph_keys == "job"
