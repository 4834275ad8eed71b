"""Flow-GRPO, DanceGRPO and MixGRPO over the serving stack's HTTP API (docs/rl.md "Trainers"; rl_spec §2-§4).

One iteration: rollout (the stack samples G images per prompt with the SDE, returns per-step log-probs and
stores the trajectory) -> rewards -> group advantages -> the copy recomputes the trained steps' log-probs (and
the think tokens') with gradients -> PPO-clip loss (+ beta * KL to the reference, whose log-probs the stack
scores with weights "reference") -> optimiser step(s) -> the new weights are written under the checkpoint's key
names and pushed into the stack (a new weights version) -> one record (a JSON line for `u1serve rl-train`).

The algorithms differ only in their hooks: the SDE they ask for, which steps they train, their advantages.
- Flow-GRPO: the `flow` SDE on every step but the last (or a fixed window), all of them trained; per-prompt mean
  with the global std; clip 1e-4 (image log-probs are per-element means, so ratios are geometric means).
- DanceGRPO: the `dance` SDE (constant eta) on every step but the last (the terminal transition is dropped),
  each sample trains an independent random subset (timestep_fraction) of them; per-group mean / unbiased std;
  optional one initial noise per group.
- MixGRPO: the `flow` SDE only inside a window that moves forward every `window_every` iterations (ODE
  elsewhere, back to the start past the end); the window is trained; think text is sampled (temperature) and
  optimised jointly: token-level PPO (clip 0.2) on the sampled tokens with their rollout log-probs, weighted by
  `text_weight`, plus the image part, with ONE group advantage aggregated from the per-reward group-normalised
  advantages of the mixed text + image rewards (rl_spec §4.1).
"""
from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from services.contract.rl import RLSampling

from . import advantages as ADV
from .client import RLAPIError, RLClient
from .losses import kl_k3, ppo_clip
from .policy import Policy
from .rewards import RewardSet, Samples

ALGOS = ("flow-grpo", "dance-grpo", "mix-grpo")


@dataclass
class TrainConfig:
    algo: str = "flow-grpo"
    prompts: list[str] = field(default_factory=lambda: ["a red fox in the snow", "a lighthouse at dusk"])
    rewards: list[str] = field(default_factory=lambda: ["brightness"])
    group_size: int = 8
    size: str = "512x512"
    num_inference_steps: int = 10
    guidance_scale: float = 4.0
    timestep_shift: float = 3.0
    t_eps: float = 0.02
    noise_level: Optional[float] = None       # default per algorithm (0.7 flow / mix, 0.3 dance)
    lr: float = 1e-5
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4                  # image transitions
    text_clip_range: float = 0.2              # think tokens (MixGRPO)
    adv_clip: float = ADV.ADV_CLIP
    kl_beta: float = 0.0                      # weight of the k3 KL to the reference in the loss
    updates_per_iteration: int = 1            # optimiser steps per rollout (minibatches of samples)
    seed: int = 0
    # Flow-GRPO
    global_std: bool = True
    window: Optional[tuple[int, int]] = None  # (start, size): SDE + training only there (Flow-GRPO-Fast)
    # DanceGRPO
    timestep_fraction: float = 0.6
    same_initial_noise: bool = False
    # MixGRPO
    window_size: int = 2
    window_shift: int = 1
    window_every: int = 3                     # iterations per window position
    think_max_tokens: int = 16
    think_temperature: float = 1.0
    text_weight: float = 1.0
    text_lr: Optional[float] = None           # the LM head's learning rate (MixGRPO's think tokens); None: lr
    train_branch: Optional[str] = None        # "gen" | "und" | "both"; default: gen, both for mix-grpo

    def __post_init__(self):
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {self.algo!r}")
        if self.group_size < 2:
            raise ValueError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        if self.noise_level is None:
            self.noise_level = 0.3 if self.algo == "dance-grpo" else 0.7
        if self.train_branch is None:
            self.train_branch = "both" if self.algo == "mix-grpo" else "gen"


@dataclass
class Batch:
    """One rollout as the loss needs it (S = P * G samples, prompt-major)."""
    response: dict
    sampling: RLSampling
    latents: torch.Tensor            # [S, N+1, 3, H, W]
    timesteps: torch.Tensor          # [N+1]
    old_logprobs: torch.Tensor       # [S, N] (NaN on ODE steps)
    ref_logprobs: Optional[torch.Tensor]   # [S, N] under the frozen reference (None: the stack could not score)
    ref_error: Optional[str]
    think_ids: list[Optional[list[int]]]
    think_logprobs: list[Optional[list[float]]]
    steps: list[int]                 # the trained step indices (columns)
    mask: torch.Tensor               # [S, len(steps)] bool: which (sample, step) entries are trained


class Trainer:
    """The shared loop; the algorithm hooks are `sde`, `train_mask`, `advantages`, `think`."""
    kind = "flow"

    def __init__(self, cfg: TrainConfig, policy: Policy, client: RLClient, rewards: RewardSet,
                 push: str = "path", log=None):
        self.cfg, self.policy, self.client, self.rewards = cfg, policy, client, rewards
        self.push_mode = push
        self.log = log
        self.rng = random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.opt = torch.optim.AdamW(self.param_groups(), lr=cfg.lr, betas=(0.9, 0.999),
                                     weight_decay=cfg.weight_decay, eps=1e-8)
        self.iteration = 0

    def param_groups(self) -> list[dict]:
        """The trained parameters; the LM head (only the think tokens read it) at `text_lr` when set. Each token's
        logit has its own row there, seen only when that token is sampled, so at the image's learning rate the
        think policy barely moves in a few iterations (docs/rl.md "Trainers")."""
        named = [(n, p) for n, p in self.policy.model.named_parameters() if p.requires_grad]
        head = [p for n, p in named if "lm_head" in n]
        if self.cfg.text_lr is None or not head:
            return [{"params": [p for _, p in named]}]
        return [{"params": [p for n, p in named if "lm_head" not in n]}, {"params": head, "lr": self.cfg.text_lr}]

    # ------------------------------------------------------------------------------------------ hooks
    def sde(self) -> dict:
        c = self.cfg
        out = {"kind": self.kind, "noise_level": c.noise_level}
        if c.window is not None:
            out["window"] = {"start": c.window[0], "size": c.window[1]}
        return out

    def think(self) -> Optional[dict]:
        return None

    def train_mask(self, S: int, steps: list[int]) -> torch.Tensor:
        return torch.ones(S, len(steps), dtype=torch.bool)

    def advantages(self, scores: dict[str, torch.Tensor], P: int) -> torch.Tensor:
        total = self.rewards.total(scores).view(P, -1)
        return ADV.flow_grpo(total, self.cfg.global_std, self.cfg.adv_clip)

    # ------------------------------------------------------------------------------------------ one iteration
    def rollout_body(self) -> dict:
        c = self.cfg
        P, G = len(c.prompts), c.group_size
        body = {"prompts": [{"prompt": p} for p in c.prompts], "group_size": G, "size": c.size,
                "num_inference_steps": c.num_inference_steps, "guidance_scale": c.guidance_scale,
                "timestep_shift": c.timestep_shift, "t_eps": c.t_eps, "sde": self.sde(),
                # seeds never repeat across iterations (a fresh draw per sample), yet the run is reproducible
                "seed": (c.seed * 1_000_003 + self.iteration * P * G) % (2 ** 31),
                "same_initial_noise": c.same_initial_noise, "return_trajectory": True, "return_images": False}
        think = self.think()
        if think is not None:
            body["think"] = think
        return body

    def collect(self) -> tuple[Batch, dict]:
        timings = {}
        t0 = time.perf_counter()
        body = self.rollout_body()
        resp = self.client.rollout(body)
        timings["rollout"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        traj = self.client.trajectory(resp["trajectory_id"])
        timings["trajectory"] = time.perf_counter() - t1
        sampling = sampling_of(body)
        samples = resp["samples"]
        think_ids = [s["think"]["token_ids"] if s.get("think") else None for s in samples]
        think_lps = [s["think"]["logprobs"] if s.get("think") else None for s in samples]
        t2 = time.perf_counter()
        score = {k: v for k, v in body.items() if k in RLSampling.model_fields}
        score.update(trajectory_id=resp["trajectory_id"], weights="reference")
        if any(ids is not None for ids in think_ids):
            score["think_token_ids"] = [ids or [] for ids in think_ids]
        try:
            ref = _nan_tensor(self.client.score(score)["logprobs"])
            ref_error = None
        except RLAPIError as exc:
            # the KL is only reported unless it is in the loss: an unscorable batch (a stack that cannot re-prefill
            # some sampled think text) is said in the record instead of ending the run
            if self.cfg.kl_beta > 0 or exc.status >= 500:
                raise
            ref, ref_error = None, str(exc)
        timings["score_reference"] = time.perf_counter() - t2
        self.client.delete_trajectory(resp["trajectory_id"])
        steps = list(resp["sde_steps"])
        S = len(samples)
        batch = Batch(resp, sampling, traj.latents, traj.timesteps, traj.logprobs, ref, ref_error,
                      think_ids, think_lps, steps, self.train_mask(S, steps))
        return batch, timings

    def images(self, batch: Batch) -> torch.Tensor:
        """The final images in [0, 1] from the trajectory's last state (what the PNG rounds)."""
        return (batch.latents[:, -1].float() * 0.5 + 0.5).clamp(0, 1)

    def step(self) -> dict:
        """One iteration; returns its record."""
        c = self.cfg
        t0 = time.perf_counter()
        batch, timings = self.collect()
        P, G = len(c.prompts), c.group_size
        S = P * G
        texts = [s["think"]["text"] if s.get("think") else None for s in batch.response["samples"]]
        samples = Samples(self.images(batch), [c.prompts[i // G] for i in range(S)], texts, batch.think_ids)
        scores = self.rewards.scores(samples)
        adv = self.advantages(scores, P).reshape(S)
        t1 = time.perf_counter()
        stats = self.update(batch, adv)
        timings["train"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        pushed = self.push_weights()
        timings["push"] = time.perf_counter() - t2
        kl = None
        if batch.ref_logprobs is not None:      # KL(rollout policy || reference) on the trained entries
            kl = float(kl_k3(batch.old_logprobs[:, batch.steps], batch.ref_logprobs[:, batch.steps], batch.mask))
        total = self.rewards.total(scores)
        record = {"iteration": self.iteration, "algo": c.algo, "reward_mean": float(total.mean()),
                  "reward_std": float(total.std()), "rewards": {k: float(v.mean()) for k, v in scores.items()},
                  "rewards_std": {k: float(v.std()) for k, v in scores.items()},
                  "kl": kl, **({"kl_error": batch.ref_error} if batch.ref_error else {}), **stats, "weights_version": pushed["weights_version"],
                  "rollout_weights_version": batch.response["weights_version"], "sde_steps": batch.steps,
                  "seconds": time.perf_counter() - t0, "timings": {k: round(v, 3) for k, v in timings.items()}}
        self.iteration += 1
        return record

    # ------------------------------------------------------------------------------------------ the update
    def update(self, batch: Batch, adv: torch.Tensor) -> dict:
        c = self.cfg
        S = adv.shape[0]
        order = list(range(S))
        self.rng.shuffle(order)
        chunks = [sorted(order[i::c.updates_per_iteration]) for i in range(c.updates_per_iteration)]
        text = self.cfg.algo == "mix-grpo"
        acc = {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "ratio_err_first": 0.0, "grad_norm": 0.0,
               **({"text_loss": 0.0, "text_clipfrac": 0.0, "text_ratio_err_first": 0.0} if text else {})}
        prefixes_all = None
        for n, idx in enumerate(chunks):
            if not idx:
                continue
            if prefixes_all is None or self.policy.und_trainable:
                prefixes_all = self.prefixes(batch)    # und frozen: computed once per rollout
            stats = self.minibatch(batch, adv, idx, prefixes_all)
            gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.max_grad_norm)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            acc["grad_norm"] += float(gn) / len(chunks)
            for k in ("loss", "clipfrac", "approx_kl") + (("text_loss", "text_clipfrac") if text else ()):
                acc[k] += stats.get(k, 0.0) / len(chunks)
            if n == 0:
                acc["ratio_err_first"] = stats["ratio_err"]
                if text:
                    acc["text_ratio_err_first"] = stats.get("text_ratio_err", 0.0)
        return acc

    def prefixes(self, batch: Batch) -> list[dict]:
        """Sample i's CFG prefixes: one shared dict per prompt, or its own with its think tokens."""
        c = self.cfg
        G = c.group_size
        think = self.think() or {}
        out = []
        for p, prompt in enumerate(c.prompts):
            ids = batch.think_ids[p * G:(p + 1) * G]
            if all(i is None for i in ids):
                out += [self.policy.prefixes(prompt, batch.sampling)] * G
            else:
                out += self.policy.think_prefixes(prompt, batch.sampling, [i or [] for i in ids],
                                                  think.get("temperature", 1.0), think.get("top_p", 1.0))
        return out

    def minibatch(self, batch: Batch, adv: torch.Tensor, idx: list[int], prefixes_all: list[dict]) -> dict:
        """Loss and backward over samples `idx`: per trained step (the graph of one step freed before the next),
        plus the think tokens' PPO for MixGRPO. Normalised so the whole is the mean over trained entries."""
        c = self.cfg
        sel = torch.tensor(idx)
        prefixes = [prefixes_all[i] for i in idx]
        mask = batch.mask[sel]
        n_entries = int(mask.sum())
        keep_graph = self.policy.und_trainable           # prefixes carry gradients: shared by every step
        a = adv[sel]
        loss_sum, clipped, kl2, err = 0.0, 0.0, 0.0, 0.0
        for col, k in enumerate(batch.steps):
            m = mask[:, col]
            if not m.any():
                continue
            rows = [j for j in range(len(idx)) if m[j]]
            r = torch.tensor(rows)
            lp = self.policy.step_logprobs([prefixes[j] for j in rows], batch.latents[sel[r]], batch.timesteps,
                                           [k], float(batch.response["noise_scale"]), batch.sampling)
            ppo = ppo_clip(lp, batch.old_logprobs[sel[r]][:, [k]], a[r], c.clip_range)
            loss = ppo.loss * len(rows)
            if c.kl_beta > 0:
                loss = loss + c.kl_beta * kl_k3(lp, batch.ref_logprobs[sel[r]][:, [k]]) * len(rows)
            (loss / n_entries).backward(retain_graph=keep_graph)
            loss_sum += float(loss.detach())
            clipped += ppo.clipfrac * len(rows)
            kl2 += ppo.approx_kl * len(rows)
            err = max(err, ppo.ratio_max_err)
        out = {"loss": loss_sum / max(n_entries, 1), "clipfrac": clipped / max(n_entries, 1),
               "approx_kl": kl2 / max(n_entries, 1), "ratio_err": err}
        if self.cfg.algo == "mix-grpo" and any(batch.think_ids[i] for i in idx):
            out.update(self.text_loss(batch, a, idx, prefixes))
        return out

    def text_loss(self, batch: Batch, adv: torch.Tensor, idx: list[int], prefixes: list[dict]) -> dict:
        """Token-level PPO on the sampled think tokens (mean over a sample's tokens, then over samples)."""
        c = self.cfg
        rows = [j for j, i in enumerate(idx) if batch.think_ids[i]]
        T = max(len(batch.think_ids[idx[j]]) for j in rows)
        lp = torch.zeros(len(rows), T)
        old = torch.zeros(len(rows), T)
        mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for r, j in enumerate(rows):
            n = len(batch.think_ids[idx[j]])
            lp = lp.index_put((torch.tensor([r]), torch.arange(n)), prefixes[j]["cond"].think_logprobs)
            old[r, :n] = torch.tensor(batch.think_logprobs[idx[j]][:n])
            mask[r, :n] = True
        weights = mask.float() / mask.sum(1, keepdim=True).clamp_min(1)    # mean over each sample's tokens
        ratio = torch.exp(lp - old)
        a = adv[torch.tensor(rows)][:, None]
        per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - c.text_clip_range, 1 + c.text_clip_range))
        loss = (per * weights).sum() / len(rows)
        (c.text_weight * loss).backward()
        with torch.no_grad():
            off = (ratio - 1).abs() * mask
            n = mask.sum().clamp_min(1)
        return {"text_loss": float(loss), "text_clipfrac": float(((off > c.text_clip_range).sum()) / n),
                "text_ratio_err": float(off.max())}

    # ------------------------------------------------------------------------------------------ weights
    def push_weights(self, everything: bool = False) -> dict:
        """Write the trained branch (or every weight) under the checkpoint's key names and load it into the stack
        as a new weights version."""
        tmp = tempfile.mkdtemp(prefix="u1serve-rl-weights-")
        try:
            self.policy.write_weights(tmp, everything)
            if self.push_mode == "upload":
                files = [f for f in os.listdir(tmp) if f.endswith(".safetensors")]
                if len(files) != 1:
                    raise RuntimeError(f"upload sends one safetensors file, the export wrote {len(files)}")
                return self.client.upload_weights(os.path.join(tmp, files[0]))
            return self.client.push_weights(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class FlowGRPO(Trainer):
    kind = "flow"


class DanceGRPO(Trainer):
    kind = "dance"

    def train_mask(self, S: int, steps: list[int]) -> torch.Tensor:
        """Per sample an independent random subset of floor(len * timestep_fraction) steps (at least one)."""
        k = max(1, int(math.floor(len(steps) * self.cfg.timestep_fraction)))
        mask = torch.zeros(S, len(steps), dtype=torch.bool)
        for i in range(S):
            mask[i, self.rng.sample(range(len(steps)), min(k, len(steps)))] = True
        return mask

    def advantages(self, scores: dict[str, torch.Tensor], P: int) -> torch.Tensor:
        return ADV.dance_grpo(self.rewards.total(scores).view(P, -1), self.cfg.adv_clip)


class MixGRPO(Trainer):
    kind = "flow"

    def window_start(self) -> int:
        """Progressive: the window advances by `window_shift` every `window_every` iterations and rolls back to
        the start once it would pass the last noisable step."""
        c = self.cfg
        positions = max(c.num_inference_steps - 1 - c.window_size, 0)    # last valid start
        start = (self.iteration // c.window_every) * c.window_shift
        return start % (positions + 1)

    def sde(self) -> dict:
        return {"kind": self.kind, "noise_level": self.cfg.noise_level,
                "window": {"start": self.window_start(), "size": self.cfg.window_size}}

    def think(self) -> Optional[dict]:
        c = self.cfg
        return {"enabled": True, "temperature": c.think_temperature, "top_p": 1.0, "max_tokens": c.think_max_tokens}

    def advantages(self, scores: dict[str, torch.Tensor], P: int) -> torch.Tensor:
        return ADV.mix_grpo({k: v.view(P, -1) for k, v in scores.items()}, self.rewards.weights, self.cfg.adv_clip)


TRAINERS = {"flow-grpo": FlowGRPO, "dance-grpo": DanceGRPO, "mix-grpo": MixGRPO}


def make_trainer(cfg: TrainConfig, model_dir: str, client: RLClient, push: str = "path") -> Trainer:
    policy = Policy(model_dir, cfg.train_branch)
    return TRAINERS[cfg.algo](cfg, policy, client, RewardSet.parse(cfg.rewards), push)


def _nan_tensor(rows: list[list[Optional[float]]]) -> torch.Tensor:
    return torch.tensor([[float("nan") if x is None else x for x in row] for row in rows], dtype=torch.float32)


def sampling_of(body: dict) -> RLSampling:
    return RLSampling(**{k: v for k, v in body.items() if k in RLSampling.model_fields})


__all__ = ["ALGOS", "TrainConfig", "Trainer", "FlowGRPO", "DanceGRPO", "MixGRPO", "TRAINERS", "make_trainer",
           "sampling_of"]
