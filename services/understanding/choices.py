"""`n` choices of one chat prompt: independent samples that share the prompt's KV through the prefix cache.

Choice 0 runs first; the others start once it produced its first output (its prompt is in the prefix cache by
then, so their prefill is a cache hit instead of n copies of the same prompt). A seeded request gives choice i
the seed `seed + i`. Engine ids are `rid`, `rid.1`, `rid.2`, ... so one `/internal/abort` of `rid` stops all.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional

from services.contract.limits import SEED_MAX
from services.model import prompts as PR

from . import textgen
from .sampling import SamplingParams


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (SEED_MAX + 1))


class Choices:
    def __init__(self, state, rid: str, inp: PR.PromptInput, params: SamplingParams, think: Optional[bool], n: int,
                 cache_salt: Optional[str] = None, lora: Optional[str] = None):
        self.n = n
        self.gens = [textgen.generate(state, rid if i == 0 else f"{rid}.{i}", inp, choice_params(params, i), think,
                                      cache_salt, lora) for i in range(n)]

    async def events(self) -> AsyncIterator[tuple[int, dict]]:
        """(choice index, textgen event) as they come, choice 0's first event first; an APIError of any choice
        ends the whole request (close() aborts the others)."""
        first = await anext(self.gens[0])
        yield 0, first
        live = ([] if "finish_reason" in first else [0]) + list(range(1, self.n))
        futs = {i: asyncio.ensure_future(anext(self.gens[i], None)) for i in live}
        try:
            while futs:
                done, _ = await asyncio.wait(set(futs.values()), return_when=asyncio.FIRST_COMPLETED)
                for i in [i for i, f in futs.items() if f in done]:
                    ev = futs.pop(i).result()
                    if ev is None:
                        continue
                    yield i, ev
                    if "finish_reason" not in ev:
                        futs[i] = asyncio.ensure_future(anext(self.gens[i], None))
        finally:
            for f in futs.values():
                f.cancel()
            # let each cancelled choice run its own cleanup (abort) before anybody closes its generator
            await asyncio.gather(*futs.values(), return_exceptions=True)

    async def close(self) -> None:
        """Abort every choice that has not finished (idempotent)."""
        for gen in self.gens:
            await gen.aclose()


def merged_usage(finals: dict[int, dict]) -> dict:
    """One usage for all choices: the prompt once, the completions summed."""
    first = finals[min(finals)]["usage"]
    completion = sum(f["usage"]["completion_tokens"] for f in finals.values())
    return {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion,
            "prompt_tokens_details": first.get("prompt_tokens_details", {})}
