"""Which module first computes a wrong value, found without adding host syncs (deploy/mps_probe.py, run "check").

The probe's first diagnosis (forward hooks that read each output on the host) synchronises after every module,
and under MPS that made the NaN go away; it also only looked for NaN, while a GEMM that returns wrong but finite
numbers at step 0 shows as NaN only steps later, once the state has grown past bf16's range. So here the hooks
only queue device work: every Linear / Conv2d keeps a copy of its last input and output, every other module a
device flag of whether its output was finite (all of it captured into the step's CUDA graphs, where the step
replays them, so graphed steps are checked as they are served). After a step (where the probe synchronises anyway)
`first_offender()` recomputes each Linear / Conv2d in fp32 from its stored input, in the order the hooks fired
(inner modules before the modules that contain them), and names the first whose output is non-finite or off by
more than `tol` of its largest value while its input was finite: a kernel that returned wrong numbers from right
inputs. For that module it runs the op again now, as the model runs it (does it reproduce on an idle GPU?), then
RERUNS times back to back (always wrong: the algorithm picked for that shape; sometimes: a race inside it), and a
Linear also as mm then + bias (addmm with a bias takes cuBLASLt's bias epilogue; mm another cuBLAS path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model.gemm_check import TOL, fp32_linear, rel_err   # noqa: F401  (the engine's start-up check)

RERUNS = 20         # the offending module's op again, back to back: always wrong (the shape's algorithm) or sometimes


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _fp32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's op in fp32 on the same device (the reference)."""
    if isinstance(module, nn.Conv2d):
        b = None if module.bias is None else module.bias.float()
        return F.conv2d(x.float(), module.weight.float(), b, module.stride, module.padding, module.dilation,
                        module.groups)
    return fp32_linear(module, x)


def _as_mm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Linear as mm, then + bias (no addmm: no cuBLASLt bias epilogue)."""
    y = torch.mm(x.reshape(-1, x.shape[-1]), module.weight.t())
    if module.bias is not None:
        y = y + module.bias
    return y.view(*x.shape[:-1], y.shape[-1])


class ModuleCheck:
    """Forward hooks on every named module of `model` (module doc); `first_offender()` after a step, `close()`
    removes the hooks. Under the engine's CUDA graphs the hooks run while a segment is captured: the copies and
    flags they make are captured with it, so each replay refreshes them (the hooks themselves do not run again),
    and a check after a replayed step sees that replay's values."""

    def __init__(self, model: nn.Module, tol: float = TOL):
        self.tol = tol
        self.order: list[str] = []                    # module names in the order their hooks first fired
        self._seen: set[str] = set()
        self.saved: dict[str, tuple] = {}             # Linear / Conv2d: (module, input copy, output copy)
        self.flags: dict[str, torch.Tensor] = {}      # other modules: device bool, output finite
        self.modules = {n: m for n, m in model.named_modules() if n}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if name not in self._seen:
                self._seen.add(name)
                self.order.append(name)
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            if isinstance(module, (nn.Linear, nn.Conv2d)) and x is not None:
                self.saved[name] = (module, x.detach().clone(), output.detach().clone())
            else:
                self.flags[name] = torch.isfinite(output).all()
        return hook

    @torch.inference_mode()          # as the engine's step runs (the model's Linear picks its kernel by grad mode)
    def first_offender(self) -> dict | None:
        """The first module (hook order) whose output is wrong from a finite input, described; None: all agree."""
        wrong = []
        for name in self.order:
            if name in self.saved:
                module, x, out = self.saved[name]
                if not finite(x):
                    continue
                err = rel_err(out, _fp32(module, x))
                if not finite(out) or err > self.tol:
                    wrong.append((name, module, x, out, err))
            elif name in self.flags and not bool(self.flags[name]) and not wrong:
                return {"module": name, "kind": "not finite",
                        "detail": f"{name} ({type(self.modules[name]).__name__}): output not finite; every Linear / "
                                  "Conv2d before it agreed with fp32"}
        if not wrong:
            return None
        name, module, x, out, err = wrong[0]
        return {"module": name, "kind": "wrong", "wrong_modules": len(wrong), "checked": len(self.saved),
                "detail": self._describe(name, module, x, out, err) + f"; {len(wrong)} of {len(self.saved)} "
                          "Linear / Conv2d outputs off"}

    def _describe(self, name: str, module: nn.Module, x: torch.Tensor, out: torch.Tensor, err: float) -> str:
        ref = _fp32(module, x)
        bad = int((~torch.isfinite(out)).sum())
        again = module.forward(x)            # as the model runs it, without the hooks
        reruns = [module.forward(x) for _ in range(RERUNS)]      # back to back, no sync between: a minimal repro
        wrong = sum(rel_err(y, ref) > self.tol or not finite(y) for y in reruns)
        text = (f"{name} ({type(module).__name__} {tuple(module.weight.shape)}, input {tuple(x.shape)} "
                f"{str(x.dtype).replace('torch.', '')}, bias {'yes' if module.bias is not None else 'no'}): "
                f"off by {err:.3g} of its largest value vs fp32 ({bad} non-finite); run again now: "
                f"{rel_err(again, ref):.3g}; {wrong} of {RERUNS} reruns back to back wrong")
        if isinstance(module, nn.Linear):
            text += f"; as mm + bias: {rel_err(_as_mm(module, x), ref):.3g}"
        return text

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
