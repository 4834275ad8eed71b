"""Colocate QoS of `u1serve up`: how the two engines share a GPU unless the flags say otherwise.

A chat decode step reads the whole understanding branch (~16 GB at 8B: HBM-bound, ~7 ms alone); a denoise step
is compute-bound (tens of ms at 1024²). Time-sliced by the driver, a decode step waits for the image engine's
slices (64-token chats took 3.8 s under image load on one H200, 0.58 s alone). Under CUDA MPS their kernels run
side by side: the decode's memory traffic overlaps the image's math, and with generation capped at a share of
the SMs and dispatched at below-normal priority (services/launch/mps.py) decode blocks find SMs. So the default is:

- `--gpu-sharing auto` (the default) time-slices: MPS (`--gpu-sharing mps`) gave the chat numbers above, but every
  text-to-image under it with generation at 85 % of the SMs came out NaN. Found (one H100, 2026-12-06,
  deploy/mps_probe.py "check"): cuBLAS and cuBLASLt return wrong values for plain bf16 GEMMs of the generation
  branch in an MPS client capped at 60-85 % of the SMs (the same op rerun alone is wrong every time: no ordering
  flaw of ours); at 50 % they were right. So MPS stays opt-in, its default cap is 50 % (services/launch/mps.py), and
  the generation engine checks its GEMMs against fp32 at start under any cap (`--gemm-check`, on by default under
  MPS: services/model/gemm_check.py), refusing to start, with the shape named, where they are wrong. A NaN image is
  answered 500 `nonfinite_output` (services/generation/emitter.py) in any mode, never a black PNG.
- the yield gate (services/generation/qos.py) on in colocate with one replica each, at `DEFAULT_YIELD_SHARE` of
  generation's time: a decode step that arrives while an image step runs gets the GPU at the next layer
  boundary, and images lose at most that share however busy chat is (chats arrive continuously under load, so
  "stop whenever decode runs" would starve images: the token bucket bounds it). `--qos-yield-share 0` turns it
  off, F sets another share.

Every part is overridable (`--gpu-sharing time-slice|mps`, `--gen-sm-percent`, `--gen-priority`,
`--qos-yield-share`). The choice is printed at start, in the `ready:` line and in stack.json (`qos`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

# the image-goodput allowance of issue 25 (>= 95 % of time-sliced images/min): the gate may take at most this
DEFAULT_YIELD_SHARE = 0.05
SHARING_MODES = ("auto", "time-slice", "mps")
AUTO_WHY = ("MPS is opt-in (--gpu-sharing mps): under an MPS cap of 60-85 % of the SMs cuBLAS computed the generation "
            "branch's GEMMs wrong on an H100, and the images came out NaN (docs/deployment.md, Colocate QoS)")


@dataclass(frozen=True)
class Sharing:
    """How the engines share their GPUs: `mode` mps | time-slice, `asked` the flag's value, `why` one line."""
    mode: str
    asked: str
    why: str


def choose_sharing(asked: str, *, mode: str) -> Sharing:
    """The GPU sharing of a stack. `asked`: --gpu-sharing. An explicit mode is returned as asked (services/launch/stack.py
    refuses what cannot run); `auto` time-slices (module doc: why not MPS, for now)."""
    if asked not in SHARING_MODES:
        raise ValueError(f"--gpu-sharing must be one of {SHARING_MODES}, got {asked!r}")
    if asked != "auto":
        return Sharing(asked, asked, "asked for")
    if mode != "colocate":
        return Sharing("time-slice", asked, "separate mode: each engine owns its GPUs")
    return Sharing("time-slice", asked, AUTO_WHY)


def default_yield_share(asked: Optional[float], *, mode: str, replicas: tuple[int, int],
                        enabled: bool = True) -> tuple[Optional[float], str]:
    """(the yield gate's share, None: no gate; why). `asked`: --qos-yield-share (None: the default; 0: off).
    `enabled` False (Ray, which places the engines itself): no default gate. Explicit values are checked by
    services/launch/stack.py."""
    if asked is not None:
        return (asked or None), ("--qos-yield-share 0" if not asked else "asked for")
    if not enabled:
        return None, "no default gate where the engines are placed elsewhere (Ray)"
    if mode != "colocate":
        return None, "separate mode: nothing to yield to"
    if replicas != (1, 1):
        return None, "the gate pairs one understanding with one generation replica"
    return DEFAULT_YIELD_SHARE, "default in colocate"


@dataclass(frozen=True)
class Qos:
    """The resolved colocate QoS of one stack (stack.json `qos`)."""
    sharing: Sharing
    yield_share: Optional[float]
    yield_why: str

    def state(self) -> dict:
        """For stack.json."""
        return {"gpu_sharing": self.sharing.mode, "gpu_sharing_asked": self.sharing.asked,
                "gpu_sharing_why": self.sharing.why, "yield_share": self.yield_share or 0.0, "yield_why": self.yield_why}

    def summary(self, daemon=None, on_gpu: bool = True) -> str:
        """One line for the console (`ready:` and the start); `daemon`: the stack's MPS daemon, if any. Off GPUs
        (on_gpu False) only the yield gate: GPU sharing and MPS mean nothing there."""
        if not on_gpu:
            gate = f"yield gate share {self.yield_share:g}" if self.yield_share else "no yield gate"
            return f"engines share the CPU; {gate} ({self.yield_why})"
        if self.sharing.mode == "mps":
            text = (f"GPU sharing mps, generation at {daemon.gen_sm_percent} % of the SMs, priority "
                    f"{daemon.gen_priority}" if daemon is not None else "GPU sharing mps")
        else:
            text = "GPU sharing time-slice"
        if self.sharing.asked == "auto":
            text += f" (auto: {self.sharing.why})"
        gate = f"yield gate share {self.yield_share:g}" if self.yield_share else "no yield gate"
        return f"{text}; {gate} ({self.yield_why})"

    def asdict(self) -> dict:
        return asdict(self)
