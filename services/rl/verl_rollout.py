"""verl rollout backend: u1serve's HTTP API behind verl's `BaseRollout` (docs/rl.md "verl").

Targets verl 0.9.x (`verl.workers.rollout.base.BaseRollout`, read from the installed 0.9.1): the constructor
`(config: RolloutConfig, model_config: HFModelConfig, device_mesh, *args, **kwargs)`, `generate_sequences(DataProto)
-> DataProto`, `async update_weights(weights, wire_format="named_tensors", **kwargs)`, `async resume(tags)`,
`async release()`. Importing this module registers it as rollout `name="u1serve"`, `mode="async"` in verl's
`_ROLLOUT_REGISTRY` (as verl-omni registers its backends), so `actor_rollout_ref.rollout.name=u1serve` selects it.

Configuration: `rollout.custom.u1serve` = {"base_url" (or env U1SERVE_BASE_URL), "api_key" (or U1SERVE_API_KEY),
"admin_api_key" (or U1SERVE_ADMIN_API_KEY: the operator key the weight syncs need on a keyed stack),
"push": "path" | "upload", and any rollout field: "size", "num_inference_steps", "guidance_scale",
"timestep_shift", "t_eps", "cfg_norm", "sde": {...}, "same_initial_noise", "think": {...}}; `rollout.n` is the group
size, `rollout.seed` the base seed. `model_config` is not used: the stack serves its own checkpoint.

generate_sequences: the prompts are `non_tensor_batch["prompt"]` (text) or `["raw_prompt"]` (chat messages; the
last user text is used). verl repeats each prompt `n` times before rollout; consecutive equal prompts form one
group, which the stack prefills once. The output follows verl-omni's diffusion layout over the SDE steps:
`all_latents` [B, K+1, 3, H, W], `all_log_probs` [B, K], `all_timesteps` [B, K] (K = number of SDE steps, the
latents z_k at each SDE step k and the state after the last one), plus `images` [B, 3, H, W] in [0, 1]; the seeds,
think texts and weights version ride in `non_tensor_batch` / `meta_info`.

update_weights: every (name, tensor) is consumed (verl's generator may be collective, rl_spec §7 S5); names are
checkpoint keys (a subset is a partial update). `delta_flush` flushes are accumulated and pushed once on
`is_last`. The tensors are written as safetensors (rl-weights' weights_io) and loaded by the stack as one new
weights version ("step-<global_steps>" when verl passes global_steps). resume / release: the stack keeps its
weights and KV pages resident (it serves other clients too), so they only check that it is reachable.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Generator, Optional

import numpy as np
import torch
from verl import DataProto
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.base import BaseRollout

from services.base import knobs
from services.model.weights_io import write_tensors

from .client import RLClient

REGISTRY_KEY = ("u1serve", "async")
ROLLOUT_FIELDS = ("size", "num_inference_steps", "guidance_scale", "image_guidance_scale", "timestep_shift", "t_eps",
                  "cfg_norm", "sde", "same_initial_noise", "think", "output_format")
TAGS = ("weights", "kv_cache")


class U1ServeRollout(BaseRollout):
    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        custom = dict((getattr(self.config, "custom", None) or {}).get("u1serve", {}))
        base = custom.pop("base_url", None) or knobs.BASE_URL.get()
        if not base:
            raise ValueError("u1serve rollout: set rollout.custom.u1serve.base_url (or U1SERVE_BASE_URL)")
        api_key = custom.pop("api_key", None) or knobs.API_KEY.get()
        admin_key = custom.pop("admin_api_key", None) or knobs.ADMIN_API_KEY.get()     # for the weight syncs
        self.push = custom.pop("push", "path")
        unknown = set(custom) - set(ROLLOUT_FIELDS)
        if unknown:
            raise ValueError(f"u1serve rollout: unknown settings {sorted(unknown)} (known: {ROLLOUT_FIELDS})")
        self.sampling = custom
        self.client = RLClient(base, api_key, admin_key=admin_key)
        self.calls = 0
        self.weights_version: Optional[str] = None

    # ------------------------------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        texts = _prompt_texts(prompts)
        groups = _runs(texts)
        G = len(groups[0][1])
        if any(len(idx) != G for _, idx in groups):
            G = 1                                        # uneven repeats: every prompt its own group of one
            groups = [(t, [i]) for i, t in enumerate(texts)]
        seed = int(prompts.meta_info.get("seed", getattr(self.config, "seed", 0))) + self.calls * len(texts)
        self.calls += 1
        body = {**self.sampling, "prompts": [{"prompt": t} for t, _ in groups], "group_size": G,
                "seed": seed % (2 ** 31), "return_trajectory": True, "return_images": False}
        resp = self.client.rollout(body)
        traj = self.client.trajectory(resp["trajectory_id"])
        self.client.delete_trajectory(resp["trajectory_id"])
        steps = list(resp["sde_steps"])
        order = [i for _, idx in groups for i in idx]     # response rows -> input rows
        rows = torch.empty(len(order), dtype=torch.long)
        rows[torch.tensor(order)] = torch.arange(len(order))
        cols = steps + [steps[-1] + 1] if steps else [traj.latents.shape[1] - 1]
        samples = resp["samples"]
        tensors = {
            "all_latents": traj.latents[rows[:, None], torch.tensor(cols)],     # one gather: one copy
            "all_log_probs": traj.logprobs[rows[:, None], torch.tensor(steps, dtype=torch.long)],
            "all_timesteps": traj.timesteps[steps].expand(len(order), -1).contiguous(),
            "images": (traj.latents[rows, -1] * 0.5 + 0.5).clamp_(0, 1),
        }
        non_tensors = {
            "prompt": np.array(texts, dtype=object),
            "seed": np.array([samples[r]["seed"] for r in rows.tolist()], dtype=np.int64),
            "think_text": np.array([(samples[r].get("think") or {}).get("text") for r in rows.tolist()],
                                   dtype=object),
        }
        self.weights_version = resp["weights_version"]
        meta = {**prompts.meta_info, "weights_version": resp["weights_version"], "sde_steps": steps,
                "noise_scale": resp["noise_scale"], "timesteps": resp["timesteps"], "group_size": G}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    # ------------------------------------------------------------------------------------------ weights
    async def update_weights(self, weights: Generator, wire_format: str = "named_tensors", **kwargs):
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("u1serve rollout: LoRA adapters are not synced through verl; merge them "
                                      "(actor_rollout_ref.model.lora.merge=True) so full weights are sent")
        state: dict[str, torch.Tensor] = {}
        if wire_format == "named_tensors":
            for name, tensor in weights:
                state[name] = tensor.detach().to("cpu").contiguous()
        elif wire_format == "delta_flush":
            for named, _is_last in weights:
                for name, tensor in named:
                    state[name] = tensor.detach().to("cpu").contiguous()
        else:
            raise ValueError(f"u1serve rollout: unknown wire_format {wire_format!r}")
        if not state:
            return None
        steps = kwargs.get("global_steps")
        version = f"step-{steps}" if steps is not None else None
        out = await asyncio.to_thread(self._push, state, version)
        self.weights_version = out["weights_version"]
        return out

    def _push(self, state: dict, version: Optional[str]) -> dict:
        tmp = tempfile.mkdtemp(prefix="u1serve-verl-weights-")
        try:
            write_tensors(state, tmp)
            if self.push == "upload":
                return self.client.upload_weights(os.path.join(tmp, "model.safetensors"), version)
            return self.client.push_weights(tmp, version)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ memory
    async def resume(self, tags: list[str]):
        bad = set(tags) - set(TAGS)
        if bad:
            raise ValueError(f"u1serve rollout: unknown resume tags {sorted(bad)} (known: {TAGS})")
        self.weights_version = (await asyncio.to_thread(self.client.weights)).get("weights_version")

    async def release(self):
        await asyncio.to_thread(self.client.weights)


def _prompt_texts(data: DataProto) -> list[str]:
    nt = data.non_tensor_batch
    if "prompt" in nt:
        return [str(p) for p in nt["prompt"]]
    if "raw_prompt" in nt:
        out = []
        for messages in nt["raw_prompt"]:
            users = [m for m in messages if m.get("role") == "user"]
            content = users[-1]["content"] if users else ""
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            out.append(str(content))
        return out
    raise ValueError("u1serve rollout: the DataProto needs non_tensor_batch['prompt'] or ['raw_prompt']")


def _runs(texts: list[str]) -> list[tuple[str, list[int]]]:
    """Consecutive equal prompts as (prompt, row indices)."""
    out: list[tuple[str, list[int]]] = []
    for i, t in enumerate(texts):
        if out and out[-1][0] == t:
            out[-1][1].append(i)
        else:
            out.append((t, [i]))
    return out


verl_rollout_base._ROLLOUT_REGISTRY[REGISTRY_KEY] = f"{__name__}.U1ServeRollout"
