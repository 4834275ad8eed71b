"""How `u1serve up` (and `u1serve ray`, `u1serve rl-train`, the benches) build a stack: the tiny checkpoints, the
GPU placement, one ServiceSpec per service, ports, secrets, the KV pool, MPS, and the stack's flags. Light at
module level (no torch): `u1serve --help` stays instant. The `--und-*` / `--gen-*` flags (and the engines' shared
--device, --dtype, --quantization, ...) are the engines' config fields (kit.flags.add_flag_of): their defaults and
choices are declared once, in the engines' configs.
To add a service to the stack, add a builder to SERVICE_BUILDERS (its spec's `wave` says when it starts).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import sys
from typing import Callable

from services.base import knobs
from services.launch import hub
from services.gateway.config import GatewayConfig
from services.generation.config import KV_POOL_WAIT_S, GenerationConfig
from services.kit.flags import add_flag_of, choices_of
from services.launch.lora_flags import add_lora_flags, lora_env, lora_sources
from services.understanding.config import EngineConfig
from services.base.netutil import free_port

TINY_ALIASES = ("tiny", "tiny-u1", "tiny-u1.5", "tiny-a3b")
TINY_DEFAULT_SIZE = "64x64"      # a tiny checkpoint's default image size (and warm-up): not the 8B's 2048x2048


# ------------------------------------------------------------------------------------- helpers
def cache_dir() -> str:
    return os.path.expanduser(knobs.CACHE.get())


def tiny_variant(alias: str) -> str:
    return "u1" if alias == "tiny" else alias[len("tiny-"):]


def ensure_tiny_checkpoint(variant: str = "u1", seed: int = 0, out=sys.stdout) -> str:
    """The cached tiny checkpoint directory, written on first use."""
    path = os.path.join(cache_dir(), f"tiny-{variant}")
    if not os.path.exists(os.path.join(path, "config.json")):
        out.write(f"[u1serve] writing tiny {variant} checkpoint to {path}\n")
        from services.model import tiny  # lazy: pulls in torch
        tmp = path + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tiny.write_tiny_checkpoint(tmp, variant=variant, seed=seed)
        try:
            os.rename(tmp, path)            # atomic; refused when another process's copy landed first
        except OSError:
            if os.path.exists(os.path.join(path, "config.json")):
                shutil.rmtree(tmp, ignore_errors=True)      # theirs: the same seed, the same checkpoint
            else:                                           # a broken leftover: replace it
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
    return path


def has_cuda() -> bool:
    """Cheap check (no torch import): an NVIDIA driver node exists."""
    return os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None


def gpu_list(text: str | None) -> list[str]:
    return [g.strip() for g in (text or "").split(",") if g.strip()]


# ------------------------------------------------------------------------------------- stack
class Placement:
    """Resolved placement of one stack: device, GPUs and memory fractions per engine."""

    def __init__(self, args: argparse.Namespace):
        self.gpus_asked = bool(gpu_list(args.und_gpus) or gpu_list(args.gen_gpus))
        # auto: CUDA when GPUs are asked for (a start then checks they are there, check_devices) or a driver exists
        self.device = args.device if args.device != "auto" else (
            "cuda" if self.gpus_asked or has_cuda() else "cpu")
        self.note = ("device auto: no NVIDIA driver here and no GPU asked for (--und-gpus / --gen-gpus): running "
                     "on the CPU" if args.device == "auto" and self.device == "cpu" else "")
        self.dtype = args.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        self.und_gpus: list[str] = []
        self.gen_gpus: list[str] = []
        self.und_fraction = self.gen_fraction = None
        self.gen_world = args.gen_cfg_parallel * args.gen_sp     # generation ranks, one GPU each
        if args.gen_cfg_parallel < 1 or args.gen_sp < 1:
            raise SystemExit("--gen-cfg-parallel and --gen-sp must be >= 1")
        if self.device != "cuda":
            return
        und = gpu_list(args.und_gpus) or [str(i) for i in range(args.und_tp)]
        if args.mode == "colocate":
            gen = gpu_list(args.gen_gpus) or und
            self.und_fraction, self.gen_fraction = args.und_memory_fraction, args.gen_memory_fraction
        else:
            gen = gpu_list(args.gen_gpus) or [str(len(und) + i) for i in range(self.gen_world)]
            if set(und) & set(gen):
                raise SystemExit(f"--mode separate needs disjoint GPUs: und {und}, gen {gen}")
        if len(und) < args.und_tp:
            raise SystemExit(f"--und-tp {args.und_tp} needs {args.und_tp} GPUs, got {und}")
        if len(gen) < self.gen_world:
            need = f"--gen-cfg-parallel {args.gen_cfg_parallel}" + \
                (f" x --gen-sp {args.gen_sp}" if args.gen_sp > 1 else "")
            raise SystemExit(f"{need} needs {self.gen_world} GPUs, got {gen}")
        self.und_gpus, self.gen_gpus = und, gen

    @property
    def gpus(self) -> list[str]:
        return list(dict.fromkeys(self.und_gpus + self.gen_gpus))

    def env(self, gpus: list[str], fraction: float | None) -> dict[str, str]:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        if fraction is not None:
            env[knobs.GPU_MEMORY_FRACTION.name] = f"{fraction:.3f}"
        return env


def check_devices(args: argparse.Namespace, placement: Placement) -> Placement:
    """Before a real start: a CUDA plan needs its GPUs to be there. Missing GPUs that were asked for (--und-gpus,
    --gen-gpus, --device cuda) are an error that says so; `--device auto` with none asked falls back to the CPU
    (and says so). A dry run plans any profile anywhere and skips this."""
    if placement.device != "cuda" or knobs.MPS_ON_CPU.get():   # (the MPS tests' CPU stand-in)
        return placement
    from .gpus import cuda_devices
    _, why = cuda_devices(placement.gpus)
    if not why:
        return placement
    if args.device == "auto" and not placement.gpus_asked:
        fallback = Placement(argparse.Namespace(**{**vars(args), "device": "cpu"}))
        fallback.note = f"device auto: CUDA is not usable here ({why}): running on the CPU"
        return fallback
    asked = " ".join(f"{flag} {value}" for flag, value in (("--und-gpus", args.und_gpus), ("--gen-gpus", args.gen_gpus),
                                                          ("--device", args.device)) if value and value != "auto")
    raise SystemExit(f"u1serve up: the GPUs asked for ({asked}: GPU {','.join(placement.gpus)}) are not usable "
                     f"here: {why}. Nothing was started. Pass --device cpu to run on the CPU instead.")


def build_und(args, ctx) -> "ServiceSpec":
    from .launcher import ServiceSpec
    pl: Placement = ctx["placement"]
    argv = [sys.executable, "-m", "services.understanding.server", "--model", ctx["model"],
            "--host", "127.0.0.1", "--port", str(args.und_port), "--device", pl.device,
            "--dtype", pl.dtype, "--tp", str(args.und_tp), "--kv-pool-name", ctx["pool"],
            "--kv-pool-gb", str(ctx["pool_gb"]), "--served-model-name", ctx["model_name"]]
    if ctx.get("yield_page"):
        argv += ["--yield-signal", ctx["yield_page"]]
    argv += shlex.split(args.und_args or "")
    env = {**ctx["env"], **pl.env(pl.und_gpus, pl.und_fraction)}
    if args.lora:   # the loader merges the adapters that name und weights (services/model/loader.py)
        env[knobs.LORA.name] = ",".join(lora_specs(args))
    return ServiceSpec("und", argv, f"http://127.0.0.1:{args.und_port}/health", env)


def build_gen(args, ctx) -> "ServiceSpec":
    from .launcher import ServiceSpec
    pl: Placement = ctx["placement"]
    argv = [sys.executable, "-m", "services.generation.server", "--model", ctx["model"],
            "--host", "127.0.0.1", "--port", str(args.gen_port), "--device", pl.device,
            "--dtype", pl.dtype, "--cfg-parallel", str(args.gen_cfg_parallel), "--sp", str(args.gen_sp),
            "--sp-mode", args.gen_sp_mode, "--kv-pool-name", ctx["pool"], "--default-size", ctx["default_size"]]
    if ctx.get("yield_page"):
        argv += ["--yield-to", ctx["yield_page"], "--yield-share", f"{ctx['yield_share']:g}"]
    if args.quantization != GenerationConfig.quantization:      # (the server's own defaults: no flag)
        argv += ["--quantization", args.quantization]
    if args.cuda_graphs != GenerationConfig.cuda_graphs:
        argv += ["--cuda-graphs", args.cuda_graphs]
    for spec in lora_specs(args):
        argv += ["--lora", spec]
    argv += ["--rl-reference", getattr(args, "rl_reference", GenerationConfig.rl_reference)]
    # started beside understanding (launcher waves), on any device: open its KV pool when it appears, before ready
    argv += ["--kv-pool-wait-s", f"{KV_POOL_WAIT_S:g}"]
    argv += shlex.split(args.gen_args or "")
    return ServiceSpec("gen", argv, f"http://127.0.0.1:{args.gen_port}/health",
                       {**ctx["env"], **pl.env(pl.gen_gpus, pl.gen_fraction)})


def lora_specs(args) -> list[str]:
    """--lora values with absolute paths (the services may run elsewhere); a missing file is an error."""
    from services.model.lora_spec import parse_lora_spec
    out = []
    for text in args.lora:
        path, strength = parse_lora_spec(text)
        if not os.path.isfile(path):
            raise SystemExit(f"--lora {text!r}: no such file")
        out.append(f"{os.path.abspath(path)}:{strength}")
    return out


def preset_values(name: str | None):
    if not name:
        return None
    from services.model.presets import PRESETS
    return PRESETS[name]


def build_gateway(args, ctx) -> "ServiceSpec":
    from .launcher import ServiceSpec
    # no --host: the gateway picks (loopback without an API key, every interface with one) and says so
    argv = [sys.executable, "-m", "services.gateway.server", *(["--host", args.host] if args.host else []),
            "--port", str(args.port), "--und-url", f"http://127.0.0.1:{args.und_port}",
            "--gen-url", f"http://127.0.0.1:{args.gen_port}", "--model-name", ctx["model_name"],
            "--default-size", ctx["default_size"]]
    source = ctx.get("source")
    if source is not None and source.revision:    # /v1/models says which hub revision it serves
        argv += ["--model-hub-id", source.repo_id, "--model-revision", source.revision]
    if ctx.get("max_pixels"):    # before --gateway-args: an operator may tighten it further
        argv += ["--max-pixels", str(ctx["max_pixels"])]
    # the gateway's drain on SIGTERM ends inside the launcher's --grace (its cleanup after the drain takes ~1 s)
    argv += ["--graceful-shutdown-s", f"{max(0.5, min(5.0, args.grace - 3.0)):g}"]
    argv += shlex.split(args.gateway_args or "")
    preset = preset_values(args.preset)
    steps = args.default_steps or (preset.num_inference_steps if preset else None)
    if steps:
        argv += ["--default-steps", str(steps)]
    if preset:
        argv += ["--default-guidance", str(preset.guidance_scale),
                 "--default-timestep-shift", str(preset.timestep_shift)]
    env = dict(ctx["env"])
    if ctx.get("api_key"):
        env[knobs.API_KEY.name] = ctx["api_key"]
    if getattr(args, "api_key_file", None):
        argv += ["--api-key-file", args.api_key_file]      # a path, not a secret
    argv += tenancy_gateway_flags(args)
    # the second wave: once the engines it routes to are healthy (they start together: launcher.Stack.start)
    return ServiceSpec("gateway", argv, f"http://127.0.0.1:{args.port}/health", env, wave=1)


def tenancy_gateway_flags(args) -> list[str]:
    """The gateway flags of roles and opt-in features (issue 37): the operator key file (a path, not a secret),
    --enable-rl, --enable-runtime-lora."""
    argv = ["--admin-api-key-file", args.admin_api_key_file] if getattr(args, "admin_api_key_file", None) else []
    return argv + [flag for flag, on in (("--enable-rl", getattr(args, "enable_rl", False)),
                                         ("--enable-runtime-lora", getattr(args, "enable_runtime_lora", False)))
                   if on]


def allowed_dirs_env(args) -> dict[str, str]:
    """The engines' environment for --allowed-local-dirs / --lora-allowed-dirs / --weights-allowed-dirs
    (absolute paths; a missing directory is an error here)."""
    env = {}
    for knob, attr in ((knobs.ALLOWED_LOCAL_DIRS, "allowed_local_dirs"), (knobs.LORA_ALLOWED_DIRS, "lora_allowed_dirs"),
                       (knobs.WEIGHTS_ALLOWED_DIRS, "weights_allowed_dirs")):
        dirs = [d for item in getattr(args, attr, None) or [] for d in item.split(",") if d.strip()]
        for d in dirs:
            if not os.path.isdir(d):
                raise SystemExit(f"--{attr.replace('_', '-')} {d!r}: not a directory")
        if dirs:
            env[knob.name] = ",".join(os.path.realpath(d) for d in dirs)
    return env


def upload_dir_env(run_dir: str, dry_run: bool) -> dict[str, str]:
    """Where the gateway writes weight uploads and the engines may read them (private to the stack's user)."""
    path = os.path.join(run_dir, "uploads")
    if not dry_run:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return {knobs.WEIGHTS_UPLOAD_DIR.name: os.path.realpath(path)}


SERVICE_BUILDERS: list[Callable] = [build_und, build_gen, build_gateway]
SECRET_ENV = (knobs.INTERNAL_TOKEN.name, knobs.API_KEY.name, knobs.ADMIN_API_KEY.name)   # never printed or on argv
_SECRET_FLAGS = ("--internal-token", "--api-key", "--admin-api-key")


def resolve_ports(args: argparse.Namespace, probe: bool = True) -> None:
    """The engines' ports follow --port (+100, +200) unless given; a derived port that is taken is replaced by
    a free one, a given port that is taken is an error naming its flag. Sets args.und_port / args.gen_port."""
    from .launcher import port_free
    if probe and not port_free(args.host or "0.0.0.0", args.port):
        raise SystemExit(f"port {args.port} (--port, the gateway) is already in use: pass another --port, or stop "
                         f"what listens there (a running stack lists its pids in {cache_dir()}/run-PORT/stack.json)")
    taken = {args.port}
    for flag, attr, offset in (("--und-port", "und_port", 100), ("--gen-port", "gen_port", 200)):
        given = getattr(args, attr)
        port = given or args.port + offset
        if probe and (port in taken or not port_free("127.0.0.1", port)):
            if given:
                raise SystemExit(f"port {port} ({flag}) is already in use: pass another {flag}, or leave it out "
                                 "to get a free one")
            port = free_port()
        taken.add(port)
        setattr(args, attr, port)


def resolve_secrets(args: argparse.Namespace) -> tuple[str, str | None]:
    """(internal token, API key): from --x-file, --x or the environment; a random token when none is given.
    They reach the services through the environment only: argv is readable by every local user in /proc.
    An --api-key-file (one key per line) goes to the gateway as a path, checked here."""
    from services.kit.config import read_secret, read_secrets
    for extra in (args.und_args, args.gen_args, args.gateway_args, getattr(args, "fused_args", "")):
        if any(flag in (extra or "") for flag in _SECRET_FLAGS):
            raise SystemExit("pass secrets with --internal-token-file / --api-key-file (or the environment), "
                             "not inside --und-args/--gen-args/--gateway-args: command lines are visible in /proc")
    token = read_secret(args.internal_token, args.internal_token_file, knobs.INTERNAL_TOKEN)
    if getattr(args, "admin_api_key_file", None):
        read_secrets(None, args.admin_api_key_file, knobs.ADMIN_API_KEY)     # readable, with at least one key
        args.admin_api_key_file = os.path.abspath(args.admin_api_key_file)
    if args.api_key_file:
        read_secrets(None, args.api_key_file, knobs.API_KEY)     # readable, with at least one key
        args.api_key_file = os.path.abspath(args.api_key_file)
        return token or secrets.token_hex(16), None
    return token or secrets.token_hex(16), read_secret(args.api_key, None, knobs.API_KEY)


def check_gen_sp(args, model: str) -> None:
    """--gen-sp must divide the checkpoint's head counts under --gen-sp-mode ulysses (said here, before
    anything starts)."""
    if args.gen_sp <= 1:
        return
    from services.model.config import ConfigError, load_config
    try:
        llm = load_config(model).llm
    except ConfigError as e:
        raise SystemExit(f"--model: {e}") from None
    from services.generation.sequence_parallel import check_heads   # imports torch: only with --gen-sp
    try:
        check_heads(llm.num_attention_heads, llm.num_key_value_heads, args.gen_sp, args.gen_sp_mode)
    except ValueError as e:
        raise SystemExit(f"--gen-sp {args.gen_sp}: {e}") from None


def resolve_qos(args, placement: Placement, qos_defaults: bool = True):
    """The stack's colocate QoS (services/launch/colocate_qos.py): the GPU sharing in force and the yield gate's share.
    Explicit values that cannot run are usage errors; `qos_defaults` False (Ray places the engines itself): auto
    means time slicing and no gate, as before."""
    from .colocate_qos import Qos, choose_sharing, default_yield_share
    replicas = (args.und_replicas, args.gen_replicas)
    asked = args.gpu_sharing if qos_defaults or args.gpu_sharing != "auto" else "time-slice"
    sharing = choose_sharing(asked, mode=args.mode)
    share = args.qos_yield_share
    if share:      # an explicit gate: where it can work
        if args.mode != "colocate":
            usage_error("--qos-yield-share is for --mode colocate (engines sharing GPUs); in separate mode each "
                        "engine owns its GPUs")
        if not 0 < share <= 1:
            usage_error(f"--qos-yield-share must be in [0, 1] (0: no gate), got {share}")
        if replicas != (1, 1):
            usage_error("--qos-yield-share works with one understanding and one generation replica")
    elif share is not None and share < 0:
        usage_error(f"--qos-yield-share must be in [0, 1] (0: no gate), got {share}")
    share, why = default_yield_share(share, mode=args.mode, replicas=replicas, enabled=qos_defaults)
    return Qos(sharing, share, why)


def colocate_engines(args, placed_elsewhere: bool = False) -> dict:
    """How the colocated engines run (stack.json `colocate_engines`): `processes` (each its own server process) or
    `fused` (one process, each engine loop a thread: services/fused/); what cannot run fused is a usage error.
    `placed_elsewhere`: Ray places each engine replica itself (no fused mode there)."""
    from services.fused.launch import DEFAULT_ENGINES, DEFAULT_WHY, refusal
    asked = getattr(args, "colocate_engines", None)
    if asked == "fused" and placed_elsewhere:
        usage_error("--colocate-engines fused is for u1serve up: Ray places each engine replica itself")
    if asked == "fused" and refusal(args):
        usage_error(refusal(args))
    if args.mode != "colocate":
        return {"engines": "processes", "why": "separate mode"}
    out = {"engines": asked or DEFAULT_ENGINES, "why": "asked for" if asked else DEFAULT_WHY}
    if out["engines"] == "fused" and args.gen_sm_percent is not None:
        out["gen_sm_percent"] = args.gen_sm_percent     # generation's green context (services/model/streams.py)
    return out


def qos_page(qos, pool: str) -> str | None:
    """The shm page both engines share while the yield gate is on (understanding raises it while it decodes,
    generation yields to it), named after the KV pool; None without a gate."""
    if not qos.yield_share:
        return None
    from shm_transfer.yield_signal import signal_name
    return signal_name(pool)


def default_pool_name(port: int) -> str:
    """The KV pool of the stack on this host (or container) and port: the same name for the next stack there, so a
    stack killed with SIGKILL leaves its segment to the next one, which reclaims it (shm_transfer/segment.py)."""
    import re
    import socket
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "host"
    return f"u1serve-kv-{host}-{port}"


def usage_error(text: str) -> None:
    """A flag combination `u1serve up` refuses: the reason on stderr, exit status 2 (as argparse's errors)."""
    sys.stderr.write(f"u1serve up: error: {text}\n")
    raise SystemExit(2)


def sm_percent(text: str) -> int:
    """--gen-sm-percent: an integer 1..100."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 100 (a share of the GPU's SMs), got {text!r}")
    return value


def mps_daemon(args: argparse.Namespace, placement: Placement, run_dir: str, sharing):
    """The deployment's MPS control daemon (services/launch/mps.py) when the sharing in force is mps, else None (time
    slicing). --gpu-sharing mps is refused (exit 2) where nothing is shared or nothing is CUDA."""
    from .mps import DEFAULT_GEN_PRIORITY, DEFAULT_GEN_SM_PERCENT, PRIORITY_ENV, SM_PERCENT_ENV, MpsDaemon
    if sharing.mode != "mps":
        auto = f" (--gpu-sharing auto chose time-slice: {sharing.why})" if sharing.asked == "auto" else ""
        if args.gen_sm_percent is not None and getattr(args, "colocate_engines", None) != "fused":
            usage_error(f"--gen-sm-percent caps generation's SM share under MPS (or, with --colocate-engines fused, "
                        f"in a green context): it needs --gpu-sharing mps{auto}")
        if args.gen_priority is not None:
            usage_error(f"--gen-priority sets generation's MPS client priority: it needs --gpu-sharing mps{auto}")
        return None
    if args.mode != "colocate":
        usage_error("--gpu-sharing mps is for --mode colocate (the engines share GPUs); in separate mode each engine "
                    "owns its GPUs and there is nothing to share")
    if placement.device != "cuda" and not knobs.MPS_ON_CPU.get():
        usage_error("--gpu-sharing mps needs CUDA GPUs (--device cuda, or auto on a machine with an NVIDIA "
                    f"driver); this stack runs on {placement.device}")
    for name, flag in ((SM_PERCENT_ENV, "--gen-sm-percent"), (PRIORITY_ENV, "--gen-priority")):
        if name in os.environ:
            usage_error(f"{name} is set in this environment and would apply to understanding too: unset it "
                        f"({flag} sets it for generation only)")
    gpus = list(dict.fromkeys(placement.und_gpus + placement.gen_gpus))
    return MpsDaemon(run_dir, gpus, args.gen_sm_percent or DEFAULT_GEN_SM_PERCENT,
                     args.gen_priority or DEFAULT_GEN_PRIORITY)


def under_mps(specs: list, mps) -> list:
    """Every GPU service (all but the gateway) as a client of the deployment's MPS daemon; generation capped."""
    import dataclasses
    return [s if s.name == "gateway" else
            dataclasses.replace(s, env=mps.client_env(s.env, capped=s.name.startswith("gen"))) for s in specs]


def build_stack(args: argparse.Namespace, out=sys.stdout, echo_logs: bool = True, dry_run: bool = False,
                qos_defaults: bool = True):
    """The Stack of these flags (not started). `qos_defaults` False: no automatic colocate QoS (Ray, which places
    the engines itself; services/launch/colocate_qos.py)."""
    from services.contract.limits import IMAGE_BLOCK
    from services.generation.image_limits import checkpoint_max_tokens
    from services.base.timeouts import stack_problems

    from .launcher import Stack
    placement = Placement(args)
    run_dir = args.run_dir or os.path.join(cache_dir(), f"run-{args.port}")
    for problem in stack_problems(args.und_args, args.gen_args, args.gateway_args):
        usage_error(f"timeouts out of order: {problem} (services/base/timeouts.py)")
    if not dry_run:
        placement = check_devices(args, placement)
    if placement.note:
        (sys.stderr if dry_run else out).write(f"[u1serve] {placement.note} ({placement.dtype})\n")
    qos = resolve_qos(args, placement, qos_defaults)      # on the devices that will run (after the fallback)
    engines = colocate_engines(args, placed_elsewhere=not qos_defaults)
    mps = mps_daemon(args, placement, run_dir, qos.sharing)
    model = args.model
    tiny = model in TINY_ALIASES
    if tiny:
        model = ensure_tiny_checkpoint(tiny_variant(model), out=out)
        source = hub.Resolved(model)
    else:
        source = hub.resolve(model)        # a local directory as it is; <org>/<name>[@<revision>] from the hub
        model = source.path
        if not os.path.isdir(model):
            raise SystemExit(f"--model {args.model!r} is not a checkpoint directory (or 'tiny', or a hub id)")
    check_gen_sp(args, model)
    resolve_ports(args, probe=not dry_run)
    token, api_key = resolve_secrets(args)
    pool = args.kv_pool_name or default_pool_name(args.port)
    from services.fused.launch import DEVICE_POOL_GB
    pool_gb = args.kv_pool_gb or (0.25 if placement.device == "cpu" else
                                  DEVICE_POOL_GB if engines["engines"] == "fused" else 16.0)
    stack_id = secrets.token_hex(8)       # recorded in the shm segments this stack creates: only it removes them
    ctx = {
        "model": os.path.abspath(model), "placement": placement, "pool": pool, "pool_gb": pool_gb,
        "env": {knobs.INTERNAL_TOKEN.name: token, knobs.STACK_ID.name: stack_id, **lora_env(args),
                **allowed_dirs_env(args), **upload_dir_env(run_dir, dry_run)}, "api_key": api_key,
        "model_name": args.model_name or "sensenova-u1",   # the name the README's examples use
        "default_size": args.default_size or (TINY_DEFAULT_SIZE if tiny else "2048x2048"),
        "yield_page": qos_page(qos, pool), "yield_share": qos.yield_share,
        # the trained size limit (services/generation/image_limits.py): the gateway refuses larger sizes
        "max_pixels": checkpoint_max_tokens(model) * IMAGE_BLOCK ** 2,
        "source": source,
    }
    from .stack_replicas import replicate
    specs, pools = replicate([b(args, ctx) for b in SERVICE_BUILDERS], args, ctx, probe=not dry_run)
    if mps is not None:
        specs = under_mps(specs, mps)
    if engines["engines"] == "fused":
        from services.fused.launch import fuse
        # both engines keep their own servers (ports) inside the one process: stack.json names them
        engines = {**engines, "health_urls": {s.name: s.health_url for s in specs if s.name in ("und", "gen")}}
        specs = fuse(specs, placement, shlex.split(args.fused_args or ""), args.gen_sm_percent)
    shm = pools + ([ctx["yield_page"]] if ctx["yield_page"] else [])   # ours unlinked at stop, whoever died how
    stack = Stack(specs, out=out, log_dir=None if dry_run else os.path.join(run_dir, "logs"), shm_names=shm,
                  stack_id=stack_id, private_dirs=["u1und-"],
                  grace_s=args.grace, startup_timeout_s=args.startup_timeout, restart=not args.no_restart,
                  state_file=None if dry_run else args.state_file or os.path.join(run_dir, "stack.json"),
                  echo_logs=echo_logs, daemons=[mps] if mps else [])
    stack.qos, stack.qos_daemon = qos, mps
    stack.info["qos"] = qos.state
    stack.info["colocate_engines"] = engines
    if args.mode == "colocate":
        (sys.stderr if dry_run else out).write(f"[u1serve] colocate engines: {engines['engines']} "
                                               f"({engines['why']})\n")
    stack.info["model"] = {"given": args.model, **source.record()}
    if getattr(args, "lora_modules", None):
        stack.info["lora_modules"] = lora_sources(args)
    on_gpu = placement.device == "cuda" or knobs.MPS_ON_CPU.get()
    stack.qos_line = qos.summary(mps, on_gpu=on_gpu) if args.mode == "colocate" else ""
    if stack.qos_line:
        (sys.stderr if dry_run else out).write(f"[u1serve] colocate QoS: {stack.qos_line}\n")
    stack.device = f"{placement.device} {placement.dtype}" + (f", GPUs {','.join(placement.gpus)}"
                                                              if placement.gpus else "")
    return stack


def add_stack_flags(p: argparse.ArgumentParser, model_default: str | None) -> None:
    p.add_argument("--model", default=model_default, required=model_default is None,
                   help="checkpoint directory, a hub id <org>/<name>[@<revision>] (fetched into the huggingface_hub "
                        "cache; HF_HUB_OFFLINE, HF_TOKEN honoured), or 'tiny' (a small random checkpoint, CPU friendly)")
    p.add_argument("--mode", choices=["colocate", "separate"], default="colocate",
                   help="colocate: both engines on the same GPUs; separate: disjoint GPU groups")
    add_flag_of(p, GenerationConfig, "device", default="auto", choices=["auto", *choices_of(GenerationConfig, "device")],
                help="where both engines run (auto: cuda when GPUs are asked for or an NVIDIA driver is there, else "
                     "cpu)")
    add_flag_of(p, GenerationConfig, "dtype", default=None,
                help="both engines' weights and KV (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--und-gpus", default=None, help="GPU ids for understanding, e.g. 0,1")
    p.add_argument("--gen-gpus", default=None, help="GPU ids for generation, e.g. 2,3")
    add_flag_of(p, EngineConfig, "tp", prefix="und-", about="understanding")
    for field in ("cfg_parallel", "sp", "sp_mode"):
        add_flag_of(p, GenerationConfig, field, prefix="gen-", about="generation")
    p.add_argument("--qos-yield-share", type=float, default=None, metavar="F",
                   help="colocate QoS: generation yields the shared GPUs to understanding's decode steps between its "
                        "layers, at most F of its time (0 <= F <= 1; 0: no gate). Default: 0.05 in colocate with one "
                        "replica each, none otherwise (services/launch/colocate_qos.py)")
    p.add_argument("--gpu-sharing", choices=["auto", "time-slice", "mps"], default="auto",
                   help="colocate on CUDA: how the engines share a GPU. mps: their kernels run side by side under a "
                        "CUDA MPS control daemon that u1serve up starts for this stack (nvidia-cuda-mps-control), "
                        "generation capped by --gen-sm-percent at --gen-priority; time-slice: the driver alternates "
                        "them; auto (default): time-slice (under an MPS cap of 60-85 %% of the SMs cuBLAS computed "
                        "generation's GEMMs wrong, then NaN images: docs/deployment.md)")
    p.add_argument("--gen-sm-percent", type=sm_percent, default=None, metavar="P",
                   help="under MPS: the share of each GPU's SMs generation may use "
                        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1-100, default 50: the cap measured to compute right); with --colocate-engines fused: the "
                        "share of the SMs generation's CUDA green context holds (default: the whole GPU); "
                        "understanding is not capped")
    p.add_argument("--gen-priority", choices=["normal", "low"], default=None,
                   help="under MPS: generation's scheduling priority against understanding's "
                        "(CUDA_MPS_CLIENT_PRIORITY; low: a decode kernel's blocks go before queued image-step "
                        "blocks; default low, normal: no priority)")
    p.add_argument("--colocate-engines", choices=["processes", "fused"], default=None,
                   help="colocate: processes (default for now) runs each engine in its own server process; fused runs "
                        "both in one process (one CUDA context), each engine loop a thread on its own CUDA stream "
                        "(understanding high priority, generation low) (services/fused/; one replica and one GPU "
                        "each)")
    p.add_argument("--und-memory-fraction", type=float, default=0.35,
                   help="colocate: GPU memory share of understanding")
    p.add_argument("--gen-memory-fraction", type=float, default=0.55,
                   help="colocate: GPU memory share of generation")
    p.add_argument("--host", default=None,
                   help="gateway bind address (default: every interface with an API key, 127.0.0.1 without one)")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--und-port", type=int, default=None,
                   help="understanding port (default: --port + 100, or a free one if that is taken)")
    p.add_argument("--gen-port", type=int, default=None,
                   help="generation port (default: --port + 200, or a free one if that is taken)")
    p.add_argument("--und-replicas", type=int, default=1,
                   help="understanding replicas on this host (own port, GPUs, KV pool each); the gateway routes "
                        "over them")
    p.add_argument("--gen-replicas", type=int, default=1, help="generation replicas on this host (own port, GPUs)")
    p.add_argument("--kv-pool-name", default=None, help="shared-memory KV pool name")
    p.add_argument("--kv-pool-gb", type=float, default=None,
                   help="KV pool size (default 0.25 on cpu, 16 on cuda; 2 on cuda with --colocate-engines fused, "
                        "whose pool pages are device memory)")
    p.add_argument("--internal-token-file", default=None,
                   help="file whose first line is the engines' internal token (default: U1SERVE_INTERNAL_TOKEN, "
                        "else a random token per stack)")
    p.add_argument("--internal-token", default=None,
                   help="the token itself (visible in /proc to local users: prefer the file or the environment)")
    p.add_argument("--api-key-file", default=None,
                   help="file with the Bearer keys accepted on the public API, one per line "
                        "(default: U1SERVE_API_KEY, else open)")
    p.add_argument("--api-key", default=None,
                   help="the key itself (visible in /proc to local users: prefer the file or the environment)")
    # roles, opt-in features and where the engines read files from (issue 37; docs/deployment.md)
    p.add_argument("--admin-api-key-file", default=None,
                   help="file with the operator keys (one per line): weight updates and adapter load / unload need "
                        "one, tenant routes refuse them (default: U1SERVE_ADMIN_API_KEY, else no operator)")
    for field in ("enable_rl", "enable_runtime_lora"):
        add_flag_of(p, GatewayConfig, field, about="gateway")
    p.add_argument("--allowed-local-dirs", action="append", default=[], metavar="DIR[,DIR]",
                   help="directories the engines load runtime adapters and weight updates from (default: none)")
    p.add_argument("--lora-allowed-dirs", action="append", default=[], metavar="DIR[,DIR]",
                   help="directories runtime adapters load from (besides --allowed-local-dirs)")
    p.add_argument("--weights-allowed-dirs", action="append", default=[], metavar="DIR[,DIR]",
                   help="directories weight updates load from (besides --allowed-local-dirs)")
    p.add_argument("--model-name", default=None,
                   help="name served in /v1/models and echoed in responses (default sensenova-u1, as in the examples)")
    p.add_argument("--default-size", default=None, help="default image size WxH")
    p.add_argument("--default-steps", type=int, default=None, help="default denoising steps")
    add_flag_of(p, GenerationConfig, "quantization", about="generation",
                help="fp8: the generation branch's Linear layers in fp8 (Ada/Hopper GPUs); int8: W8A8 int8 (GPUs "
                     "without fp8); none serves a converted checkpoint in its own format")
    add_flag_of(p, GenerationConfig, "cuda_graphs", about="generation")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="merge a LoRA at load into the branch(es) it names (repeatable)")
    add_lora_flags(p)       # multi-LoRA served unmerged (services/launch/lora_flags.py)
    p.add_argument("--preset", choices=["8step"], default=None,
                   help="sampling defaults of a released recipe; 8step: 8 steps, guidance 1.0, "
                        "shift 3.0 (the official 8-step LoRA / 8step-preview checkpoint)")
    add_flag_of(p, GenerationConfig, "rl_reference", about="generation (docs/rl.md)")
    p.add_argument("--und-args", default="", help="extra flags for the understanding server")
    p.add_argument("--gen-args", default="", help="extra flags for the generation server")
    p.add_argument("--gateway-args", default="", help="extra flags for the gateway")
    p.add_argument("--fused-args", default="", help="extra flags for the fused process (--colocate-engines fused: "
                   "python -m services.fused.server --help)")
    p.add_argument("--run-dir", default=None, help="logs and stack.json (default ~/.cache/u1serve/run-PORT)")
    p.add_argument("--state-file", default=None, help="where to write pids/ports as JSON")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a service may take to get healthy (loading 8B weights takes a while)")
    p.add_argument("--no-restart", action="store_true",
                   help="shut everything down when a service dies instead of restarting it")


# ------------------------------------------------------------------------------------- commands
