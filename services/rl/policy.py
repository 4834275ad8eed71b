"""The trainer's differentiable copy of the model (docs/rl.md "Trainers").

It is built from the project's model code (loader, prompts, the reference pipeline's prefill and gen-branch
velocity, sampler's CFG rules, flow_sde's transition) and recomputes, with gradients, exactly what the serving
stack computed during a rollout:
- the log-prob of every trained SDE transition z_k -> z_{k+1} of a stored trajectory: re-prefill each prompt
  (and the exact sampled think tokens) through the understanding branch, recompute the guided velocity on the
  generation branch at z_k, then flow_sde's Gaussian log-prob of the stored z_{k+1};
- the token log-probs of sampled think text (the processed distribution: temperature, top-p).
Before the first update these equal the server's rollout log-probs (tests/rl/test_policy_matches_rollout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.contract.image import SamplerParams
from services.contract.rl import RLSampling
from services.model import flow_sde
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.prompts import THINK_TAIL, t2i_inputs, think_excluded_ids
from services.model.tokenizer import NeoTokenizer
from services.model.weights_io import key_branch, write_checkpoint_weights

TRAINABLE = ("gen", "und", "both")


@dataclass
class Prefix:
    """One CFG branch's prefix for the gen branch: KV [L, 2, P, Hkv, D] (differentiable when built so) and the t of
    the image tokens; `think_logprobs` [T] when think tokens were re-prefilled (cond branch of a think sample)."""
    kv: torch.Tensor
    t_offset: int
    think_logprobs: torch.Tensor | None = None


def sampler_params(sampling: RLSampling) -> S.Sampling:
    """The denoiser parameters of a rollout (the same fields the serving stack reads, converted as it does)."""
    return S.Sampling.of(SamplerParams(
        num_inference_steps=sampling.num_inference_steps, guidance_scale=sampling.guidance_scale,
        image_guidance_scale=sampling.image_guidance_scale, timestep_shift=sampling.timestep_shift,
        t_eps=sampling.t_eps, cfg_norm=sampling.cfg_norm, mode="t2i"))


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float,
                       excluded: tuple[int, ...] = ()) -> torch.Tensor:
    """log-softmax of the distribution tokens were drawn from: the `excluded` ids never drawn
    (prompts.think_excluded_ids), logits / temperature, then the top-p nucleus (chosen on the detached
    probabilities, renormalised). logits [T, V] fp32 -> [T, V]."""
    logits = logits.float()
    if excluded:
        logits = logits.index_fill(-1, torch.tensor(excluded, device=logits.device), float("-inf"))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    with torch.no_grad():
        sp, si = torch.sort(logp.exp(), dim=-1, descending=True)
        keep_sorted = (torch.cumsum(sp, -1) - sp) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, si, keep_sorted)
    masked = torch.where(keep, logits.float() / temperature, float("-inf"))
    return torch.log_softmax(masked, dim=-1)


class Policy:
    """The model under training. `train`: which branch's parameters get gradients ("gen" for the image-only
    trainers, "both" for MixGRPO's joint text + image optimisation)."""

    def __init__(self, model_dir: str, train: str = "gen", device: str = "cpu", dtype=torch.float32):
        if train not in TRAINABLE:
            raise ValueError(f"train must be one of {TRAINABLE}, got {train!r}")
        self.model_dir = model_dir
        self.train = train
        self.model = load_model(model_dir, "both", dtype=dtype, device=device)
        self.tok = NeoTokenizer.from_dir(model_dir)
        for name, p in self.model.named_parameters():
            p.requires_grad_(train == "both" or key_branch(name) == train)   # parameter names = checkpoint keys

    # ---------------------------------------------------------------------------------------------- parameters
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def und_trainable(self) -> bool:
        return self.train in ("und", "both")

    # ---------------------------------------------------------------------------------------------- prefixes
    def prefixes(self, prompt: str, sampling: RLSampling) -> dict[str, Prefix]:
        """Every CFG branch's prefix of a T2I prompt, as the understanding engine builds it (one per group)."""
        return self.think_prefixes(prompt, sampling, None)[0]

    def think_prefixes(self, prompt: str, sampling: RLSampling, think_ids: list[list[int]] | None,
                       temperature: float = 1.0, top_p: float = 1.0) -> list[dict[str, Prefix]]:
        """One prefix dict per sampled think block (`think_ids[i]`: sample i's exact tokens): the cond branch is the
        think prompt + those tokens + THINK_TAIL and carries their token log-probs. The prompt is prefilled once
        and shared (the appended blocks never write into it); the other branches are shared as they are."""
        params = sampler_params(sampling)
        think = think_ids is not None
        inputs = t2i_inputs(self.tok, prompt, params.branches, think=think)
        grad = torch.enable_grad() if self.und_trainable else torch.no_grad()
        with grad:
            shared, cond = {}, None
            for branch, inp in inputs.items():
                cache, positions, hidden = R.prefill(self.model, inp)
                t_last = int(positions[0].max())
                if think and branch == "cond":
                    cond = (cache, hidden, t_last)
                else:
                    shared[branch] = Prefix(cache.stacked(), t_last + 1)
            if not think:
                return [shared]
            out = []
            for ids in think_ids:
                cache = R._Cache(self.model.num_layers)
                cache.k, cache.v = list(cond[0].k), list(cond[0].v)
                think_lp, t_last = self._think(cache, cond[1], cond[2], list(ids), temperature, top_p)
                out.append({**shared, "cond": Prefix(cache.stacked(), t_last + 1, think_lp)})
            return out

    def _think(self, cache, hidden, t_last: int, ids: list[int], temperature: float, top_p: float):
        """Append the sampled think tokens (their log-probs come from the hidden state before each) + THINK_TAIL."""
        rows = hidden[-1:]
        if ids:
            h_ids, t_last = R._append_text(self.model, cache, ids, t_last)
            rows = torch.cat([rows, h_ids[:-1]])
            logp = processed_logprobs(self.model.lm_logits(rows), temperature, top_p, think_excluded_ids(self.tok))
            think_lp = logp.gather(1, torch.tensor(ids, device=logp.device)[:, None])[:, 0]
        else:
            think_lp = hidden.new_zeros(0, dtype=torch.float32)
        _, t_last = R._append_text(self.model, cache, self.tok.encode(THINK_TAIL), t_last)
        return think_lp, t_last

    # ---------------------------------------------------------------------------------------------- image steps
    def velocity(self, prefixes: list[dict[str, Prefix]], x: torch.Tensor, t: torch.Tensor, step: int,
                 noise_scale: float, sampling: RLSampling) -> torch.Tensor:
        """Guided velocity (patchified [B, N, 3072]) at state x [B, 3, H, W]; prefixes[i] are sample i's (samples
        that share one prefix dict object are run as one batch, as the engine runs a group)."""
        params = sampler_params(sampling)
        th, tw = x.shape[2] // S.BLOCK, x.shape[3] // S.BLOCK
        x = x.to(self.model.dtype)
        z = S.patchify(x)
        x_in = self.model.gen_embed(x, t, noise_scale)
        branches = params.branches if S.uses_cfg(params, float(t)) else ["cond"]
        out: list[torch.Tensor | None] = [None] * z.shape[0]
        for idx, pre in _groups(prefixes):
            sel = torch.tensor(idx, device=z.device)
            v = {b: R.gen_velocity(self.model, pre[b].kv, pre[b].t_offset, x_in[sel], z[sel], t, th, tw,
                                   params.t_eps) for b in branches}
            for j, v_j in zip(idx, S.combine(v, params, step, float(t)).float()):
                out[j] = v_j
        return torch.stack(out)

    def step_logprobs(self, prefixes: list[dict[str, Prefix]], latents: torch.Tensor, timesteps: torch.Tensor,
                      steps: list[int], noise_scale: float, sampling: RLSampling) -> torch.Tensor:
        """log p(z_{k+1} | z_k) for every k in `steps` -> [B, len(steps)] fp32, differentiable in the weights.
        latents [B, N+1, 3, H, W] is the stored trajectory (data, no gradient); timesteps the rollout's grid."""
        sde = sampling.sde
        cols = []
        t1 = timesteps[1] if len(timesteps) > 1 else timesteps[0]
        for k in steps:
            t, t_next = timesteps[k], timesteps[k + 1]
            z = latents[:, k]
            v = self.velocity(prefixes, z, t, k, noise_scale, sampling)
            mean, std = flow_sde.sde_mean_std(sde.kind, S.patchify(z.float()), v, t, t_next, t1, sde.noise_level,
                                              noise_scale, sampling.t_eps)
            cols.append(flow_sde.transition_logprob(sde.kind, S.patchify(latents[:, k + 1].float()), mean, std))
        return torch.stack(cols, dim=1)

    # ---------------------------------------------------------------------------------------------- export
    def write_weights(self, out_dir: str, everything: bool = False) -> str:
        """The trained branch's weights (every weight with `everything`: a stack brought back to this copy) under
        the checkpoint's own key names (rl-weights' weights_io)."""
        branch = None if everything or self.train == "both" else self.train
        return write_checkpoint_weights(self.model, out_dir, branch)


def _groups(prefixes: list[dict]) -> list[tuple[list[int], dict]]:
    """Sample indices grouped by the prefix dict they share (identity), in first-seen order."""
    seen: dict[int, tuple[list[int], dict]] = {}
    for i, pre in enumerate(prefixes):
        seen.setdefault(id(pre), ([], pre))[0].append(i)
    return list(seen.values())
