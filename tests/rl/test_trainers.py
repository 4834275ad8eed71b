"""`u1serve rl-train` against a real stack (tiny checkpoint, CPU): for each algorithm the reward clearly rises
within 8 iterations (MixGRPO: 12, for its think term), and every iteration reports its JSON line (iteration,
reward_mean, kl, weights_version, ...); on a terminal a progress line counts the iterations and shows the last reward.

"Clearly": the mean reward of the last 3 iterations exceeds the first 3's by more than 10 standard errors of that
difference (the standard error from the samples' own spread: reward_std / sqrt(S) per iteration). Everything is
seeded (rollout seeds, DanceGRPO's step subsets, torch), so a run is reproducible."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.system.stackproc import in_terminal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# seeded runs on the 2-core box (2026-12-07), the rise in standard errors after 8 / 12 iterations: flow-grpo 307 / 532,
# dance-grpo 132 / 402; mix-grpo's image term 203 / 380 but its think term 6.1 / 11.9 (needs 5): it keeps 12
ITERATIONS = {"flow-grpo": 8, "dance-grpo": 8, "mix-grpo": 12}
SAMPLES = 2 * 4                     # the tiny defaults: 2 prompts x group 4 (services/rl/flags.py TINY_DEFAULTS)


def run_rl_train(base: str, *flags: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "services.launch.cli", "rl-train", "--base", base, *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def assert_clear_rise(means: list[float], stds: list[float], errors: float = 10) -> None:
    rise = sum(means[-3:]) / 3 - sum(means[:3]) / 3
    se_one = [s / math.sqrt(SAMPLES) for s in stds[:3] + stds[-3:]]         # standard error of one iteration
    se = math.sqrt(sum(s * s for s in se_one)) / 3                          # of the difference of the means
    assert rise > errors * se, f"rise {rise:.3g} vs standard error {se:.3g}: {means}"


@pytest.mark.parametrize("algo", ["flow-grpo", "dance-grpo", "mix-grpo"])
def test_reward_rises(rl_stack, algo):
    out = run_rl_train(rl_stack.base, "--algo", algo, "--iterations", str(ITERATIONS[algo]), "--seed", "1")
    start, records = out[0], out[1:]
    assert start["event"] == "start" and len(records) == ITERATIONS[algo]
    versions = [start["weights_version"]] + [r["weights_version"] for r in records]
    assert len(set(versions)) == len(versions)                     # a fresh version per update
    for prev, r in zip(versions, records):
        assert r["rollout_weights_version"] == prev                # each rollout ran on the last pushed weights
        assert {"iteration", "reward_mean", "kl", "weights_version", "loss", "clipfrac", "seconds"} <= r.keys()
        assert r["ratio_err_first"] < 1e-4                         # the copy and the stack agree before each update
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert (r["kl"] is not None and r["kl"] >= 0) or r.get("kl_error")
    assert records[0]["kl"] in (0.0, None) or records[0]["kl"] < 1e-6   # the stack starts at the reference
    if algo != "mix-grpo":
        assert_clear_rise([r["reward_mean"] for r in records], [r["reward_std"] for r in records])
        return
    # MixGRPO: one advantage from the image and the think rewards, each normalised in its group; BOTH terms rise:
    # the image term (small spread) by 10 standard errors, the think term (share of lowercase letters in the
    # sampled think text, in [0, 1], large spread) by 0.2 and 5 standard errors
    assert_clear_rise([r["rewards"]["brightness"] for r in records], [r["rewards_std"]["brightness"] for r in records])
    text = [r["rewards"]["think-chars"] for r in records]
    assert sum(text[-3:]) / 3 - sum(text[:3]) / 3 > 0.2, text
    assert_clear_rise(text, [r["rewards_std"]["think-chars"] for r in records], errors=5)
    assert len({tuple(r["sde_steps"]) for r in records}) > 1        # the SDE window moved
    assert all(r["text_loss"] != 0 and r["text_ratio_err_first"] < 1e-4 for r in records)


def test_a_terminal_shows_the_iterations_and_their_reward(rl_stack):
    code, shown, out = in_terminal([sys.executable, "-m", "services.launch.cli", "rl-train", "--base", rl_stack.base,
                                    "--algo", "flow-grpo", "--iterations", "2", "--seed", "1"],
                                   timeout=600, OMP_NUM_THREADS="1")
    assert code == 0, shown[-6000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")][1:]
    assert len(records) == 2, out
    # the bar counts iterations (0/2, 1/2, 2/2) and shows the reward of the last one done
    assert "[u1serve] rl-train flow-grpo" in shown and "0/2" in shown, shown[-3000:]
    for done, rec in enumerate(records, 1):
        assert re.search(rf"{done}/2 .*reward={rec['reward_mean']:.4f}", shown), shown[-3000:]
    piped = [line for line in out.splitlines() if not line.startswith("{")]
    assert not piped, piped                  # stdout keeps its JSON lines only
