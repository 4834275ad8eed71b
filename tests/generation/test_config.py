"""The generation config checks itself: a config built in process is refused as the same parsed flags are."""
import argparse

import pytest

from services.generation.config import GenerationConfig, add_config_flags, config_from_args


@pytest.mark.parametrize("fields, why", [({"cfg_parallel": 0}, "--cfg-parallel"), ({"sp": 0}, "--sp"),
                                         ({"graph_segment_layers": 0}, "--graph-segment-layers"),
                                         ({"yield_share": 0.0}, "--yield-share"),
                                         ({"kv_pool_wait_s": -1.0}, "--kv-pool-wait-s"),
                                         ({"sp_mode": "ring"}, "--sp-mode must be one of")])
def test_bad_values_refused_in_process_and_parsed(fields, why):
    with pytest.raises(ValueError, match=why):
        GenerationConfig(model="m", **fields)
    p = argparse.ArgumentParser()
    add_config_flags(p)
    argv = ["--model", "m"] + [a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), str(v))]
    with pytest.raises(SystemExit):
        config_from_args(p.parse_args(argv))
