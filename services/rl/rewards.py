"""Rewards: one interface and simple built-in rewards (docs/rl.md "Trainers").

A reward maps a batch of samples to one float per sample (higher is better). It sees the final images as float
tensors in [0, 1] (the trajectory's last state, exactly what the PNG is made of before rounding), the prompts, and
the sampled think texts (None without think). A trainer combines several named rewards with weights
(`RewardSet`): Flow-GRPO and DanceGRPO sum them, MixGRPO normalises each inside its group first
(advantages.mix_grpo).

Built-ins (CPU-cheap, for the tests and `u1serve rl-train` on the tiny checkpoint; a real run plugs in a reward
model through the same interface):
- `brightness`: mean pixel value;
- `colour:R,G,B`: closeness to a target colour (0..1 channels): 1 - mean |pixel - colour|;
- `think-length:N`: min(len(think tokens), N) / N;
- `think-keyword:WORD`: the share of the think text covered by occurrences of WORD;
- `think-chars:CHARS`: the share of think characters that are among CHARS (default: lowercase letters); dense
  even for random text, so a few iterations move it (the CPU test's text term).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch


@dataclass
class Samples:
    """What a reward sees: S samples in rollout order (prompt-major, G per prompt)."""
    images: torch.Tensor                    # [S, 3, H, W] float in [0, 1]
    prompts: list[str]                      # [S] (the sample's prompt)
    think_texts: list[Optional[str]]        # [S]
    think_token_ids: list[Optional[list[int]]]


class Reward(Protocol):
    name: str

    def __call__(self, samples: Samples) -> torch.Tensor:   # [S] float32
        ...


@dataclass
class Brightness:
    name: str = "brightness"

    def __call__(self, samples: Samples) -> torch.Tensor:
        return samples.images.float().mean(dim=(1, 2, 3))


@dataclass
class TargetColour:
    rgb: tuple[float, float, float] = (1.0, 0.0, 0.0)
    name: str = "colour"

    def __call__(self, samples: Samples) -> torch.Tensor:
        target = torch.tensor(self.rgb, dtype=torch.float32).view(1, 3, 1, 1)
        return 1.0 - (samples.images.float() - target).abs().mean(dim=(1, 2, 3))


@dataclass
class ThinkLength:
    target_tokens: int = 32
    name: str = "think-length"

    def __call__(self, samples: Samples) -> torch.Tensor:
        return torch.tensor([min(len(ids or []), self.target_tokens) / self.target_tokens
                             for ids in samples.think_token_ids], dtype=torch.float32)


@dataclass
class ThinkKeyword:
    keyword: str = "a"
    name: str = "think-keyword"

    def __call__(self, samples: Samples) -> torch.Tensor:
        def share(text: Optional[str]) -> float:
            if not text:
                return 0.0
            return text.count(self.keyword) * len(self.keyword) / len(text)
        return torch.tensor([share(t) for t in samples.think_texts], dtype=torch.float32)


@dataclass
class ThinkChars:
    chars: str = "abcdefghijklmnopqrstuvwxyz"
    name: str = "think-chars"

    def __call__(self, samples: Samples) -> torch.Tensor:
        allowed = set(self.chars)
        return torch.tensor([sum(ch in allowed for ch in t) / len(t) if t else 0.0 for t in samples.think_texts],
                            dtype=torch.float32)


BUILTIN: dict[str, Callable[[str], Reward]] = {
    "brightness": lambda arg: Brightness(),
    "colour": lambda arg: TargetColour(tuple(float(c) for c in arg.split(","))) if arg else TargetColour(),
    "think-length": lambda arg: ThinkLength(int(arg)) if arg else ThinkLength(),
    "think-keyword": lambda arg: ThinkKeyword(arg) if arg else ThinkKeyword(),
    "think-chars": lambda arg: ThinkChars(arg) if arg else ThinkChars(),
}


def parse_reward(spec: str) -> tuple[Reward, float]:
    """'NAME[:ARG][@WEIGHT]' -> (reward, weight); e.g. 'brightness', 'colour:1,0,0@2', 'think-keyword:a@0.5'."""
    body, _, weight = spec.partition("@")
    name, _, arg = body.partition(":")
    if name not in BUILTIN:
        raise ValueError(f"unknown reward {name!r} (built-in: {', '.join(sorted(BUILTIN))})")
    try:
        reward = BUILTIN[name](arg)
        w = float(weight) if weight else 1.0
    except ValueError as exc:
        raise ValueError(f"bad reward spec {spec!r}: {exc}") from None
    if name == "colour" and len(reward.rgb) != 3:
        raise ValueError(f"colour needs three channels R,G,B, got {arg!r}")
    return reward, w


class RewardSet:
    """Named rewards with weights. `scores` -> {name: [S]}; `total` -> the weighted sum [S]."""

    def __init__(self, rewards: list[tuple[Reward, float]]):
        if not rewards:
            raise ValueError("at least one reward is needed")
        self.rewards = rewards

    @classmethod
    def parse(cls, specs: list[str]) -> "RewardSet":
        return cls([parse_reward(s) for s in specs])

    @property
    def weights(self) -> dict[str, float]:
        return {r.name: w for r, w in self.rewards}

    def scores(self, samples: Samples) -> dict[str, torch.Tensor]:
        return {r.name: r(samples).float() for r, _ in self.rewards}

    def total(self, scores: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(w * scores[r.name] for r, w in self.rewards)
