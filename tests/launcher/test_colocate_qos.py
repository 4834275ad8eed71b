"""services/launch/colocate_qos.py, the decision alone (no GPU needed): what `--gpu-sharing auto` and the default yield
gate choose; the whole launch path is tests/launcher/test_mps.py and
tests/generation/test_qos_up.py."""
from __future__ import annotations

import pytest

from services.launch.colocate_qos import DEFAULT_YIELD_SHARE, Qos, Sharing, choose_sharing, default_yield_share

@pytest.mark.parametrize("mode,why", [("colocate", "MPS is opt-in"), ("separate", "separate mode")])
def test_auto_time_slices_and_says_why(mode, why):
    """MPS is not chosen automatically (its images came out NaN at the default SM cap on an H200): auto time-slices."""
    got = choose_sharing("auto", mode=mode)
    assert got.mode == "time-slice" and got.asked == "auto" and why in got.why, got


@pytest.mark.parametrize("asked", ["mps", "time-slice"])
def test_an_explicit_mode_is_kept(asked):
    got = choose_sharing(asked, mode="colocate")
    assert (got.mode, got.why) == (asked, "asked for")
    with pytest.raises(ValueError):
        choose_sharing("green", mode="colocate")


def test_the_default_gate_is_on_in_colocate_with_one_replica_each():
    assert default_yield_share(None, mode="colocate", replicas=(1, 1)) == (DEFAULT_YIELD_SHARE, "default in colocate")
    assert default_yield_share(0.0, mode="colocate", replicas=(1, 1))[0] is None          # --qos-yield-share 0
    assert default_yield_share(0.5, mode="colocate", replicas=(1, 1))[0] == 0.5
    for kw in ({"mode": "separate", "replicas": (1, 1)}, {"mode": "colocate", "replicas": (1, 2)}):
        assert default_yield_share(None, **kw)[0] is None
    assert default_yield_share(None, mode="colocate", replicas=(1, 1), enabled=False)[0] is None    # Ray


class _Daemon:
    gen_sm_percent, gen_priority = 85, "low"


def test_the_report_says_what_is_in_force():
    qos = Qos(Sharing("mps", "mps", "asked for"), 0.05, "default in colocate")
    assert qos.summary(_Daemon()) == ("GPU sharing mps, generation at 85 % of the SMs, priority low; yield gate share "
                                      "0.05 (default in colocate)")
    assert qos.state()["gpu_sharing"] == "mps"
    auto = Qos(choose_sharing("auto", mode="colocate"), 0.05, "default in colocate")
    assert auto.summary().startswith("GPU sharing time-slice (auto: MPS is opt-in") and auto.state()["gpu_sharing_asked"] == "auto"
    assert Qos(Sharing("time-slice", "time-slice", "asked for"), None, "--qos-yield-share 0").summary() == \
        "GPU sharing time-slice; no yield gate (--qos-yield-share 0)"
