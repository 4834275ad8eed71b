"""Every `U1SERVE_*` environment knob, declared once: name, type, default and why. Code reads a knob through its
declaration here (`knobs.KV_SAME_HOST_SHM.get()`) and writes one under its declared name (`env[knobs.LORA.name]`);
`u1serve knobs` prints the list and docs/configuration.md holds the same list, made by `markdown()`.

The gateway's flags each fall back to an environment variable named after the flag (`--max-steps`:
U1SERVE_MAX_STEPS): one family here (`GATEWAY_FLAGS`), whose members the gateway's parser declares as it builds.
`kernels/` imports nothing of services/, so it reads its knobs (KERNELS, DENOISE_BACKEND, FP8_VARIANT, FP8_ROUND)
from os.environ itself; they are declared here all the same. Imports nothing but the standard library.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knob:
    name: str
    type: type                  # str, int, float or bool
    default: object
    why: str
    read_by: str                # where it takes effect (the docs' list)

    def raw(self, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The variable's text as set (None when unset)."""
        return (os.environ if env is None else env).get(self.name)

    def text(self, env: Optional[Mapping[str, str]] = None) -> str:
        """The text stripped, "" when unset: for a reader that parses a value of its own syntax."""
        return (self.raw(env) or "").strip()

    def get(self, env: Optional[Mapping[str, str]] = None, default: object = None):
        """The typed value, else `default` when given (a default computed where it is read), else the declared one.
        A value of the wrong syntax is a ValueError that names the variable."""
        value = self.text(env)
        if not value:
            return self.default if default is None else default
        try:
            if self.type is bool:
                if value.lower() in _TRUE + _FALSE:
                    return value.lower() in _TRUE
                raise ValueError("not 0 or 1")
            return self.type(value)
        except ValueError:
            raise ValueError(f"{self.name} must be {_KIND[self.type]}, got {value!r}") from None


_KIND = {str: "text", int: "an integer", float: "a number", bool: "0 or 1"}
KNOBS: dict[str, Knob] = {}


def _knob(name: str, type: type, default: object, why: str, read_by: str) -> Knob:
    assert name.startswith("U1SERVE_") and name not in KNOBS, name
    KNOBS[name] = k = Knob(name, type, default, why, read_by)
    return k


@dataclass
class FlagFamily:
    """Knobs named after command-line flags (`--max-steps` -> U1SERVE_MAX_STEPS), each a flag's default."""
    pattern: str
    why: str
    read_by: str
    members: dict[str, Knob] = field(default_factory=dict)

    def knob(self, flag: str, type: type = str, default: object = None) -> Knob:
        """The knob of `flag` (its default: the flag's); the first declaration of a flag holds."""
        name = "U1SERVE_" + flag.lstrip("-").upper().replace("-", "_")
        return self.members.setdefault(name, Knob(name, type, default, f"{flag} when it is not given", self.read_by))


# ---- secrets and identity of a stack --------------------------------------------------------------------------
INTERNAL_TOKEN = _knob("U1SERVE_INTERNAL_TOKEN", str, None, "the stack's internal token: every engine route but "
                       "/health requires it, the gateway sends it (u1serve up makes one)", "every service")
INTERNAL_TOKEN_FILE = _knob("U1SERVE_INTERNAL_TOKEN_FILE", str, None, "a file whose first line the container "
                            "entrypoint exports as U1SERVE_INTERNAL_TOKEN", "docker/entrypoint.sh")
API_KEY = _knob("U1SERVE_API_KEY", str, None, "the Bearer key the gateway requires on /v1/* (unset: open); the key "
                "clients (rl, bench) send", "gateway, u1serve up / ray, rl, bench")
API_KEY_FILE = _knob("U1SERVE_API_KEY_FILE", str, None, "the tenants' key file (one per line) the container "
                     "entrypoint checks and passes as the gateway's --api-key-file", "docker/entrypoint.sh")
ADMIN_API_KEY_FILE = _knob("U1SERVE_ADMIN_API_KEY_FILE", str, None, "the operators' key file the container "
                           "entrypoint checks and passes as the gateway's --admin-api-key-file", "docker/entrypoint.sh")
ADMIN_API_KEY = _knob("U1SERVE_ADMIN_API_KEY", str, None, "the gateway's operator key (--admin-api-key): weight "
                      "updates and adapter load / unload take it, tenant routes refuse it", "gateway, u1serve up")


def _dirs(name: str, what: str) -> Knob:
    """Directories (comma-separated) the engines read `what` from (kit.local_files; unset: none)."""
    return _knob(name, str, "", f"directories (comma-separated) {what}", "engines (kit.local_files)")


ALLOWED_LOCAL_DIRS = _dirs("U1SERVE_ALLOWED_LOCAL_DIRS", "the engines load runtime adapters and weight updates from "
                           "(u1serve up --allowed-local-dirs; unset: none, so only uploads and --lora-modules)")
LORA_ALLOWED_DIRS = _dirs("U1SERVE_LORA_ALLOWED_DIRS", "runtime LoRA adapters load from, besides "
                          "U1SERVE_ALLOWED_LOCAL_DIRS (u1serve up --lora-allowed-dirs)")
WEIGHTS_ALLOWED_DIRS = _dirs("U1SERVE_WEIGHTS_ALLOWED_DIRS", "weight updates load from, besides "
                             "U1SERVE_ALLOWED_LOCAL_DIRS (u1serve up --weights-allowed-dirs)")
WEIGHTS_UPLOAD_DIR = _knob("U1SERVE_WEIGHTS_UPLOAD_DIR", str, "", "where the gateway writes a weight upload for the "
                           "engines to read (u1serve up: RUN_DIR/uploads; unset: the system temp directory, which "
                           "the engines then do not read from)", "gateway, engines (kit.local_files)")
STACK_ID = _knob("U1SERVE_STACK_ID", str, "", "the stack that owns the shm segments a service creates (u1serve up "
                 "sets it): only that stack's launcher removes them",
                 "understanding, generation, shm_transfer.yield_signal")

# ---- gateway ----------------------------------------------------------------------------------------------------
GATEWAY_HOST = _knob("U1SERVE_GATEWAY_HOST", str, None, "the gateway's --host", "gateway")
GATEWAY_PORT = _knob("U1SERVE_GATEWAY_PORT", int, None, "the gateway's --port", "gateway")
UND_URLS = _knob("U1SERVE_UND_URLS", str, None, "understanding replicas, comma-separated, when no --und-url is given",
                 "gateway")
GEN_URLS = _knob("U1SERVE_GEN_URLS", str, None, "generation replicas, comma-separated, when no --gen-url is given",
                 "gateway")
CACHE_SALT_BY_API_KEY = _knob("U1SERVE_CACHE_SALT_BY_API_KEY", bool, None, "the gateway's --cache-salt-by-api-key "
                              "(unset: on whenever API keys are set)", "gateway")
GATEWAY_FLAGS = FlagFamily("U1SERVE_<FLAG>", "every other gateway flag's default: --max-steps is U1SERVE_MAX_STEPS "
                           "(`python -m services.gateway.server --help` names each)", "gateway")

# ---- launcher ---------------------------------------------------------------------------------------------------
CACHE = _knob("U1SERVE_CACHE", str, "~/.cache/u1serve", "where u1serve keeps tiny checkpoints and run directories",
              "u1serve (cli)")
GPU_MEMORY_FRACTION = _knob("U1SERVE_GPU_MEMORY_FRACTION", float, None, "colocated engines: this process's share of "
                            "GPU memory (u1serve up sets it per engine), enforced as torch's allocator cap; the KV "
                            "cache shrinks to fit", "understanding engine, generation worker and capacity")
LORA = _knob("U1SERVE_LORA", str, "", "LoRA adapters merged at load, PATH[:STRENGTH],... (what u1serve up --lora "
             "sets)", "model loader")
LORA_MODULES = _knob("U1SERVE_LORA_MODULES", str, "", "LoRA adapters served unmerged, NAME=PATH[:STRENGTH],... (what "
                     "u1serve up --lora-modules sets; docs/lora.md)", "engines' adapter registry, gateway")
MAX_LORAS = _knob("U1SERVE_MAX_LORAS", int, None, "resident LoRA adapter slots per engine (unset: 4 with adapters "
                  "given, else 0 = multi-LoRA off; what u1serve up --max-loras sets)", "engines' adapter registry")
MAX_LORA_RANK = _knob("U1SERVE_MAX_LORA_RANK", int, 16, "the largest LoRA rank the slots hold (u1serve up "
                      "--max-lora-rank)", "engines' adapter registry")
MPS_ON_CPU = _knob("U1SERVE_MPS_ON_CPU", bool, False, "tests only: run the CUDA MPS launch path with a stand-in "
                   "daemon on a GPU-less machine", "u1serve up")
PROGRESS = _knob("U1SERVE_PROGRESS", bool, True, "progress bars on stderr when it is a terminal (0: never)",
                 "u1serve up, convert, rl-train (services/launch/progress.py)")

# ---- model and engines ------------------------------------------------------------------------------------------
RANDOM_WEIGHTS = _knob("U1SERVE_RANDOM_WEIGHTS", bool, False, "load a config-only checkpoint with random weights "
                       "(benchmarks of full-size geometries)", "model loader")
FUSED_ADD_NORM = _knob("U1SERVE_FUSED_ADD_NORM", bool, True, "a residual add fused into the next RMSNorm (0: apart, "
                       "the same bits; to compare speed)", "model")
SKINNY_GEMM = _knob("U1SERVE_SKINNY_GEMM", bool, True, "linear layers with at most 16 rows (decode) take the "
                    "skinny GEMM kernel on CUDA (kernels/skinny_gemm.py; 0: torch's linear, to compare)", "model")
FUSED_PROJ = _knob("U1SERVE_FUSED_PROJ", str, "auto", "an und layer's q, k, v weights as one, and gate, up as one: "
                   "one GEMM each per decode step (model/fused_rows.py): auto = on CUDA, 0 = separate GEMMs (to compare), 1 = on any "
                   "device (tests; CPU bits then differ)", "model loader")
GATED_DOWN = _knob("U1SERVE_GATED_DOWN", bool, False, "a one-row decode step computes silu(gate) * up inside the "
                   "down GEMM (one launch fewer per layer, the same bits; needs the fused gate, up weight)", "model")
FP8_MIN_TOKENS = _knob("U1SERVE_FP8_MIN_TOKENS", int, None, "fp8 GEMMs below this many tokens run in the model dtype "
                       "(unset: on CUDA quant.GRAPHED_MIN_TOKENS where the steps replay CUDA graphs, else "
                       "quant.CUDA_MIN_TOKENS; 0 elsewhere)", "model (fp8)")
FP8_FAST_ACCUM = _knob("U1SERVE_FP8_FAST_ACCUM", str, "auto", "fp8 GEMM fast accumulation: 0, 1 or auto (from a "
                       "token count on CUDA)", "model (fp8)")
FP8_FUSED = _knob("U1SERVE_FP8_FUSED", bool, True, "the norms / silu*mul feeding an fp8 GEMM write fp8 themselves (0: "
                  "they write the model dtype and the GEMM layers quantise; for comparing)", "model (fp8)")
EXACT_ROWS = _knob("U1SERVE_EXACT_ROWS", bool, None, "linear layers run once per packed sequence, as alone (the "
                   "official code's bits; unset: on CPU only; model/row_blocks.py)", "both engines")
TEACACHE_COEFFICIENTS = _knob("U1SERVE_TEACACHE_COEFFICIENTS", str, None, "a TeaCache coefficients file calibrated "
                              "on this checkpoint (bench/calibrate_teacache.py; unset: the packaged one)",
                              "model (step cache)")
CUDA_GRAPHS = _knob("U1SERVE_CUDA_GRAPHS", bool, None, "overrides generation's --cuda-graphs (0: off, 1: on)",
                    "generation")
WEIGHTS_READ_TIMEOUT_S = _knob("U1SERVE_WEIGHTS_READ_TIMEOUT_S", float, 1500.0, "how long an engine rank may read "
                                "and validate a weight update's files (in a thread, off its step loop) before the "
                                "stage fails 504 weights_read_timeout (below the HTTP side's 1800 s)",
                                "engines' weight staging (model/weights_io.py)")
PNG_THREADS = _knob("U1SERVE_PNG_THREADS", int, 0, "threads that encode PNGs (0: up to 8, the CPUs this process may "
                    "use)", "generation")
TIMELINE = _knob("U1SERVE_TIMELINE", bool, False, "stage marks of every request on stderr (bench_breakdown sets "
                 "it)", "every service (kit.timeline)")
KV_SAME_HOST_SHM = _knob("U1SERVE_KV_SAME_HOST_SHM", bool, True, "a NIXL consumer on the producer's host reads "
                         "prefixes through shared memory (0: always the network)", "shm_transfer (nixl)")

# ---- kernels (read from os.environ by kernels/, which imports nothing of services/) -----------------------------
KERNELS = _knob("U1SERVE_KERNELS", str, "auto", "ref, triton or auto: the kernels' implementation", "kernels")
DENOISE_BACKEND = _knob("U1SERVE_DENOISE_BACKEND", str, "auto", "auto, flash_attn, sdpa, triton or ref: generation's "
                        "attention", "kernels, generation")
FP8_VARIANT = _knob("U1SERVE_FP8_VARIANT", str, "auto", "the fp8 quantisation kernels' launch variant", "kernels")
FP8_ROUND = _knob("U1SERVE_FP8_ROUND", str, "hw", "fp8 rounding: hw (the GPU's cast) or explicit", "kernels")

# ---- clients, containers, tests ---------------------------------------------------------------------------------
BASE_URL = _knob("U1SERVE_BASE_URL", str, None, "the gateway the verl rollout adapter talks to", "rl (verl)")
MODEL_DIR = _knob("U1SERVE_MODEL_DIR", str, None, "the checkpoint mount the container checks at start",
                  "docker/entrypoint.sh, k8s")
HEALTH_PORT = _knob("U1SERVE_HEALTH_PORT", int, 8000, "the port the container's health check probes", "Dockerfile")
IMAGE = _knob("U1SERVE_IMAGE", str, "u1serve:latest", "the image the compose files run", "docker compose")
DOCKER_CACHE = _knob("U1SERVE_DOCKER_CACHE", str, None, "where docker/build.sh keeps its base images",
                     "docker/build.sh")
FAULT_STEP_OOM = _knob("U1SERVE_FAULT_STEP_OOM", str, "", "tests only (a fault): a generation job whose request id "
                        "contains this text raises torch.OutOfMemoryError in its 2nd denoise step (unset: never)",
                        "generation engine (faults.py)")


def _job_fault(name: str, what: str) -> Knob:
    """A test-only fault of a generation job whose request id contains the knob's text (services/generation/faults.py)."""
    return _knob(name, str, "", f"tests only (a fault): a generation job whose request id contains this text {what}",
                 "generation engine (faults.py)")


FAULT_STEP_CRASH = _job_fault("U1SERVE_FAULT_STEP_CRASH", "makes its 2nd denoise step raise an error the engine "
                              "cannot handle (the engine dies)")
FAULT_STEP_HANG = _job_fault("U1SERVE_FAULT_STEP_HANG", "makes its 2nd denoise step hang (an hour)")
FAULT_STEP_NAN = _job_fault("U1SERVE_FAULT_STEP_NAN", "has its latents turned NaN in its 2nd denoise step")
FAULT_WRONG_GEMM = _knob("U1SERVE_FAULT_WRONG_GEMM", str, "", "tests only (a fault): the generation branch's Linear of "
                         "this name returns finite but wrong values (3x + 1), as cuBLAS did under an MPS SM cap "
                         "(unset: never)", "generation engine (faults.py)")
FAULT_UND_STEP_CRASH = _knob("U1SERVE_FAULT_UND_STEP_CRASH", str, "", "tests only (a fault): an understanding step "
                             "with a request whose id contains this text raises a CUDA-style fatal device error "
                             "(the engine dies)", "understanding engine (engine.py)")
FAULT_WEIGHTS_READ_S = _knob("U1SERVE_FAULT_WEIGHTS_READ_S", float, 0.0, "tests only (a fault): an engine rank's "
                              "read of a weight update waits this many seconds first, as on a slow mount",
                              "engines' weight staging (model/weights_io.py)")
TEST_SEED = _knob("U1SERVE_TEST_SEED", int, 20261130, "the seed every test's own seed derives from", "tests")
TEST_DEFAULT_THREADS = _knob("U1SERVE_TEST_DEFAULT_THREADS", int, 0, "torch's own CPU thread count, recorded by a "
                             "test run's first process before it pins every process to one thread (0: not "
                             "recorded yet)", "tests (tests/threads.py)")


def rows(flag_knobs: Iterable[Knob] = ()) -> list[tuple[str, str, str, str, str]]:
    """(name, type, default, why, read by) of every knob, then the gateway family and its members (`flag_knobs`:
    the gateway's parser declares them, services.gateway.config.flag_knobs)."""
    def row(k: Knob) -> tuple[str, str, str, str, str]:
        return k.name, k.type.__name__, "" if k.default is None else str(k.default), k.why, k.read_by
    f = GATEWAY_FLAGS
    return [row(k) for k in KNOBS.values()] + [(f.pattern, "", "", f.why, f.read_by)] + [row(k) for k in flag_knobs]


def markdown(flag_knobs: Iterable[Knob] = ()) -> str:
    """The table docs/configuration.md holds (`u1serve knobs --markdown`)."""
    lines = ["| variable | type | default | what it does | read by |", "|---|---|---|---|---|"]
    lines += [f"| `{n}` | {t} | {f'`{d}`' if d else ''} | {w} | {r} |" for n, t, d, w, r in rows(flag_knobs)]
    return "\n".join(lines) + "\n"
