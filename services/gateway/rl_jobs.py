"""An RL request (rollout or score, docs/rl.md) as image jobs: checked against this server's limits as an image
request is (jobs.check_options) plus RL's own compute and trajectory bounds, then planned as one prefix + one
generation RL job per prompt (G samples over one prefix), or per sample when a prompt's samples have their own
think text."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from services.contract.image import PrefixRequest, SamplerParams
from services.contract.rl import RLSampling, RolloutJobRequest, ScoreJobRequest
from services.kit.errors import APIError

from .config import GatewayConfig
from .inputs import ImageChecker
from .jobs import ImageJob, check_options, check_step_pixels, generate_body

ROLLOUT_PATH, SCORE_PATH = "/internal/rl/rollout", "/internal/rl/score"


@dataclass(frozen=True)
class RLJob(ImageJob):
    """One prefix + one generation RL job (rollout or score) of `n` samples; an ImageJob to the orchestrator."""
    path: str = ROLLOUT_PATH
    images: int = 0
    first_sample: int = 0

    def generate_path(self) -> str:
        return self.path

    def expected_images(self) -> int:
        return self.images

    def generate_body(self, handles: dict) -> dict[str, Any]:
        return generate_body(self.generate, handles, RolloutJobRequest if self.path == ROLLOUT_PATH
                             else ScoreJobRequest)


def check(cfg: GatewayConfig, req: RLSampling, stores_trajectory: bool = False) -> list[SamplerParams]:
    """The request against the server's limits, before any job starts: the compute (samples x steps x pixels)
    and, for a rollout that keeps one, its trajectory's bytes; then each prompt as an image request (size,
    steps, prompt length). Returns each prompt's sampler parameters."""
    w, h = req.width_height
    samples, steps = len(req.prompts) * req.group_size, req.num_inference_steps
    if samples * steps * w * h > cfg.rl_max_pixel_steps:
        raise APIError(413, f"this request asks for {samples} samples x {steps} steps x {w * h} pixels; this "
                       f"server takes at most {cfg.rl_max_pixel_steps} (--rl-max-pixel-steps)",
                       param="num_inference_steps", code="rl_compute_too_large")
    traj = 4 * samples * ((steps + 1) * 3 * w * h + steps)
    if stores_trajectory and traj > cfg.rl_max_trajectory_bytes:
        raise APIError(413, f"this rollout's trajectory would take {traj} bytes; this server keeps at most "
                       f"{cfg.rl_max_trajectory_bytes} (--rl-max-trajectory-mb): fewer samples, steps or pixels, "
                       "or return_trajectory=false", param="return_trajectory", code="trajectory_too_large")
    opts = req.image_options()
    samplers = [check_options(cfg, opts, "edit" if p.images else "t2i", p.prompt, prompt_param=f"prompts[{i}].prompt")
                for i, p in enumerate(req.prompts)]
    for i, sampler in enumerate(samplers):   # a prompt's group is one job of G samples unless each thinks its own
        check_step_pixels(cfg, sampler, 1 if req.thinks(i) else req.group_size, w, h, param="group_size")
    return samplers


async def input_images(images: ImageChecker, req: RLSampling) -> list[list[str]]:
    """Each prompt's input images, checked and re-encoded as the images API does."""
    out = []
    for i, p in enumerate(req.prompts):
        if not p.images:
            out.append([])
            continue
        checked = await images.check([(f"prompts[{i}].images[{k}]", im) for k, im in enumerate(p.images)])
        out.append([c.b64 for c in checked])
    return out


def own_salt(salt: Optional[str], rid: str) -> str:
    """A prefix-cache domain of this request alone (`salt`: the caller's; plan() gives each prompt its own inside
    it): every prefix is computed the same way, cold, never partly from the radix cache, whose reused and
    recomputed tokens differ from a full prefill in the last bits. One domain per request was not enough: the
    prompts' unconditional prefixes are the same tokens, so prompt 2's read prompt 1's pages or not depending on
    whether those were in the radix tree yet when it started (timing: a loaded machine gave prompt 2's samples
    other bits, ~1e-7, in 1 of 6 replays); a replayed rollout now gets the same prefix KV and the same
    trajectory bit for bit."""
    seen = f"{salt or ''}\0{rid}".encode()
    return "rl-" + hashlib.sha256(seen).hexdigest()[:32]


# (prompt, first sample, samples) -> (the job's RL fields, images it returns)
Extra = Callable[[int, int, int], tuple[dict, int]]
# (prompt, sample) -> the prefix's think fields (empty: one shared prefix without think)
Think = Callable[[int, int], dict]


def plan(req: RLSampling, samplers: list[SamplerParams], rid: str, images: list[list[str]], salt: str, path: str,
         extra: Extra, think: Think) -> list[RLJob]:
    """The jobs of a request: per prompt one job of G samples, or G jobs of one sample when the prompt's samples
    have their own think text (each sample its own prefix; the radix cache shares the prompt's pages)."""
    w, h = req.width_height
    G, jobs = req.group_size, []
    for p, sampler in enumerate(samplers):
        own_think = any(think(p, p * G + i) for i in range(G))
        groups = [(p * G + i, 1) for i in range(G)] if own_think else [(p * G, G)]
        for first, n in groups:
            jrid = f"{rid}-rl{first}"
            own, expected_images = extra(p, first, n)
            fields = {**sampler.model_dump(), "width": w, "height": h, "request_id": jrid, "n": n, **own}
            prefix = PrefixRequest(request_id=jrid, mode=sampler.mode, prompt=req.prompts[p].prompt,
                                   images=images[p], guidance_scale=sampler.guidance_scale,
                                   image_guidance_scale=sampler.image_guidance_scale, stream=True,
                                   cache_salt=f"{salt}-{p}",      # a cache domain per prompt (see own_salt)
                                   **{"think": False, **(think(p, first) if own_think else {})})
            jobs.append(RLJob(prefix, fields, "b64_json", False, path=path, images=expected_images,
                              first_sample=first))
    return jobs
