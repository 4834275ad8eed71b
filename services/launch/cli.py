"""The `u1serve` command: `up`, `demo`, `tiny-checkpoint`, `tiny-lora`, `rl-train`, `ray`, `convert`, `plan`, `knobs`.

Imports stay light at module level so `u1serve --help` is instant; subcommands import what they
need. To add a subcommand, write `cmd_x(args)` and `add_x(subparsers)` and list it in COMMANDS.
How a stack is built (placement, services, ports, secrets): services/launch/stack.py.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from services.base import knobs
from services.kit.flags import add_flag_of
from services.base.netutil import free_port
from services.launch.stack import (SECRET_ENV, TINY_ALIASES, add_stack_flags, build_stack, cache_dir,
                            ensure_tiny_checkpoint, tiny_variant)
from services.understanding.config import EngineConfig

def add_up(sub) -> None:
    p = sub.add_parser("up", help="start understanding, generation and the gateway")
    add_stack_flags(p, model_default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="print each service's command line and GPU placement, start nothing")
    p.set_defaults(func=cmd_up)


def print_plan(stack, out=None) -> None:
    """The placement of `u1serve up` without starting it (checks a multi-GPU profile anywhere): the daemons it
    starts first, then each service; on `out`, else on the sys.stdout of the moment."""
    out = out or sys.stdout
    for d in stack.daemons:
        out.write(f"{d.name}: {' '.join(f'{k}={v}' for k, v in sorted(d.env().items()))} {shlex.join(d.argv)}\n")
    for spec in (s.spec for s in stack.services):
        env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()) if k not in SECRET_ENV)
        out.write(f"{spec.name}: {env} {shlex.join(spec.argv)}\n")


def cmd_up(args) -> int:
    from .launcher import run_until_signal
    stack = build_stack(args, dry_run=args.dry_run)
    if args.dry_run:
        print_plan(stack)
        return 0
    host = "127.0.0.1" if args.host in (None, "0.0.0.0") else args.host
    sharing = f"; {stack.qos_line}" if stack.qos_line else ""   # colocate_qos.py
    fused = " (fused engines)" if stack.info["colocate_engines"]["engines"] == "fused" else ""   # services/fused
    return run_until_signal(stack, on_ready=lambda: stack.say(
        f"ready: http://{host}:{args.port}/v1 (mode {args.mode}{fused}, {stack.device}{sharing}; engines on "
        f"127.0.0.1:{args.und_port} and :{args.gen_port})"))


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="tiny checkpoint + whole stack on CPU + one chat and one image")
    p.add_argument("--out", default=None,
                   help="where to save the image (default: u1serve-demo.png in the cache dir, ~/.cache/u1serve)")
    p.add_argument("--prompt", default="a red fox in the snow, watercolor")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--verbose", action="store_true", help="also print the services' logs")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    import base64
    try:
        from openai import OpenAI
    except ImportError:
        raise SystemExit("u1serve demo uses the openai SDK: pip install openai")
    out_path = os.path.abspath(args.out or os.path.join(cache_dir(), "u1serve-demo.png"))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    ns = argparse.ArgumentParser()
    add_stack_flags(ns, model_default="tiny")
    stack_args = ns.parse_args(["--device", "cpu", "--host", "127.0.0.1",
                                "--port", str(free_port()), "--und-port", str(free_port()),
                                "--gen-port", str(free_port()), "--grace", "5"])
    stack_args.run_dir = os.path.join(cache_dir(), "run-demo")
    t0 = time.monotonic()
    stack = build_stack(stack_args, echo_logs=args.verbose)
    print(f"[demo] service logs: {os.path.join(stack_args.run_dir, 'logs')}")
    from .launcher import StartupError
    try:
        stack.start()
    except StartupError as exc:
        print(f"[demo] the stack did not start: {exc}")
        stack.stop()
        return 1
    try:
        t_up = time.monotonic() - t0
        client = OpenAI(base_url=f"http://127.0.0.1:{stack_args.port}/v1", api_key="unused",
                        timeout=300)
        model = client.models.list().data[0].id
        t1 = time.monotonic()
        chat = client.chat.completions.create(
            model=model, max_tokens=24,
            messages=[{"role": "user", "content": "Describe a red fox in one sentence."}])
        t_chat = time.monotonic() - t1
        t2 = time.monotonic()
        img = client.images.generate(model=model, prompt=args.prompt, size="64x64",
                                     response_format="b64_json",
                                     extra_body={"num_inference_steps": args.steps, "seed": 42})
        t_img = time.monotonic() - t2
        with open(out_path, "wb") as f:
            f.write(base64.b64decode(img.data[0].b64_json))
        print("\n[demo] chat reply (random tiny weights, so the text is noise):")
        print("       " + repr(chat.choices[0].message.content))
        print(f"[demo] image saved to {out_path} (64x64, {args.steps} steps)")
        print(f"[demo] timings: stack up {t_up:.1f}s, chat {t_chat:.2f}s, image {t_img:.2f}s")
        return 0
    finally:
        stack.stop()


def add_tiny(sub) -> None:
    p = sub.add_parser("tiny-checkpoint", help="write a small random checkpoint (tests, demo)")
    p.add_argument("dir")
    p.add_argument("--variant", choices=["u1", "u1.5", "a3b", "u1-8b", "u1.5-8b", "a3b-full"], default="u1",
                   help="tiny family, or a full-size one (u1-8b, u1.5-8b, a3b-full: config + tokenizer only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", action="store_true",
                   help="write only the full-size config.json of the variant (no weights)")
    p.set_defaults(func=cmd_tiny)


def cmd_tiny(args) -> int:
    from services.model import tiny  # lazy: pulls in torch
    if args.config_only or args.variant in tiny.FULL_VARIANTS:
        full = {"u1": "u1-8b", "u1.5": "u1.5-8b", "a3b": "a3b-full"}.get(args.variant, args.variant)
        tiny.write_full_config(args.dir, variant=full)
    else:
        tiny.write_tiny_checkpoint(args.dir, variant=args.variant, seed=args.seed)
    print(args.dir)
    return 0


def add_tiny_lora(sub) -> None:
    p = sub.add_parser("tiny-lora", help="write a small random LoRA adapter for the tiny checkpoint (tests, demos "
                                         "of --lora-modules / POST /v1/load_lora_adapter)")
    p.add_argument("dir", help="output: the PEFT directory (or, with --layout official, the .safetensors file)")
    p.add_argument("--model", default="tiny", help="checkpoint directory or a tiny alias (default: tiny)")
    p.add_argument("--layout", choices=["peft", "official"], default="peft")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--branches", choices=["both", "und", "gen"], default="both",
                   help="the branches whose layers it adapts")
    p.set_defaults(func=cmd_tiny_lora)


def cmd_tiny_lora(args) -> int:
    from services.model.tiny_lora import write_tiny_lora   # lazy: pulls in torch
    model = ensure_tiny_checkpoint(tiny_variant(args.model)) if args.model in TINY_ALIASES else args.model
    branches = ("und", "gen") if args.branches == "both" else (args.branches,)
    print(write_tiny_lora(args.dir, model, rank=args.rank, alpha=args.alpha, seed=args.seed, branches=branches,
                          layout=args.layout))
    return 0


def add_rl_train(sub) -> None:
    p = sub.add_parser("rl-train", help="train the model with Flow-GRPO / DanceGRPO / MixGRPO against a stack "
                                        "(docs/rl.md): one JSON line per iteration")
    from services.rl.flags import add_train_flags   # argparse only: --help stays instant
    add_train_flags(p)
    p.set_defaults(func=cmd_rl_train)


def cmd_rl_train(args) -> int:
    from services.rl.run import main as rl_main
    return rl_main(args)


def add_ray(sub) -> None:
    from services.ray_serve.command import add_arguments     # no Ray import until a command runs
    p = sub.add_parser("ray", help="the same application on a Ray cluster (Ray Serve): up, down, config")
    add_arguments(p)
    p.set_defaults(func=cmd_ray)


def cmd_ray(args) -> int:
    from services.ray_serve.command import run
    return run(args)


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="write a quantised copy of a safetensors checkpoint (fp8, int8, GGUF) that "
                                       "the server loads without requantising (docs/model.md, weight formats)")
    p.add_argument("src", help="float safetensors checkpoint directory (official schema)")
    p.add_argument("dst", help="output directory (new or empty)")
    p.add_argument("--to", required=True, metavar="fp8|int8|gguf[:TYPE]|gguf:TYPE:LAYERS,...",
                   help="fp8 / int8: W8A8 safetensors with per-channel scales for both branches; "
                        "gguf[:q8_0|q4_k] (default q8_0): GGUF, dequantised at load; gguf:q8_0:0-17,q4_k:18-: a "
                        "per-layer mix (unnamed layers, or TYPE bf16, keep the source precision)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from services.launch.progress import bar
    from services.model.convert import ConvertError, convert_checkpoint  # lazy: pulls in torch

    def shards(paths, desc):
        return bar(paths, desc=f"[u1serve] {desc}", unit="shard")
    try:
        print(convert_checkpoint(args.src, args.dst, args.to, progress=shards))
    except ConvertError as e:
        print(f"u1serve convert: {e}", file=sys.stderr)
        return 2
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="what each engine holds in GPU memory per weight format, whether it fits a "
                                    "budget, and the flags that make it fit (services/model/memory_plan.py)")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json is enough) or a tiny alias")
    p.add_argument("--quantization", choices=["none", "fp8", "fp8-only", "int8"], default="none",
                   help="generation's format (as `u1serve up --quantization`; fp8-only: U1SERVE_FP8_MIN_TOKENS=0, "
                        "no bf16 copy); a GGUF checkpoint is bf16 on the GPU")
    p.add_argument("--und-quantization", choices=["none", "fp8", "fp8-only", "int8"], default="none",
                   help="understanding's format (`--und-args \"--quantization ...\"`)")
    p.add_argument("--gpu-memory", default="80GiB", help="the budget: one card (separate) or the cap both engines "
                                                        "share (colocate), e.g. 24GiB")
    p.add_argument("--gpu-total", default=None, help="the card's real size when the budget is a cap on a larger "
                                                     "card (for the memory fractions; default: --gpu-memory)")
    p.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    p.add_argument("--colocate-engines", choices=["processes", "fused"], default="processes",
                   help="colocate: each engine its own process, or fused (one process, both engines, the KV pool's "
                        "pages on the device: services/fused/)")
    p.add_argument("--max-image-size", type=int, default=None,
                   help="largest image side allowed (default: the checkpoint's trained maximum)")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    p.add_argument("--weight-streaming-layers", type=int, default=None, metavar="K",
                   help="generation's --weight-streaming-layers (decoder layers in pinned host memory, K on the GPU). "
                        "Unset: off, and the fit search tries K=2 where the largest size fits no other way; 0: never")
    add_flag_of(p, EngineConfig, "kv_cache_tokens", about="understanding's --kv-cache-tokens")
    p.add_argument("--kv-pool-gb", type=float, default=None,
                   help="the KV pool (default as `u1serve up` on cuda: 16, host memory; fused: 2, device memory)")
    p.add_argument("--enable-rl", action="store_true",
                   help="as `u1serve up --enable-rl`: count RL rollouts' states waiting on the device")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.set_defaults(func=cmd_plan)


def plan_image_limits():
    """The API's image limits the memory plan sizes generation by (the model layer takes them, never imports them)."""
    from services.contract.limits import IMAGE_BLOCK, SIZE_TABLE
    from services.model.memory_plan import ImageLimits
    return ImageLimits(IMAGE_BLOCK, SIZE_TABLE)


def cmd_plan(args) -> int:
    import json

    from services.contract.limits import IMAGE_BLOCK
    from services.fused.launch import DEVICE_POOL_GB
    from services.generation.config import RL_WAITING_BYTES
    from services.generation.image_limits import checkpoint_max_tokens
    from services.model import memory_plan as M
    from services.model.config import ConfigError, load_config
    if args.colocate_engines == "fused" and args.mode != "colocate":
        print("u1serve plan: --colocate-engines fused is for --mode colocate", file=sys.stderr)
        return 2
    model = ensure_tiny_checkpoint(tiny_variant(args.model)) if args.model in TINY_ALIASES else args.model
    if (args.weight_streaming_layers or 0) < 0:
        print("u1serve plan: --weight-streaming-layers must be >= 0", file=sys.stderr)
        return 2
    try:
        cfg = load_config(model)
        budget = M.parse_bytes(args.gpu_memory)
        total = M.parse_bytes(args.gpu_total) if args.gpu_total else None
    except (ConfigError, ValueError) as e:
        print(f"u1serve plan: {e}", file=sys.stderr)
        return 2
    fmt = lambda q: "bf16" if q == "none" else q   # noqa: E731
    side = args.max_image_size or int(checkpoint_max_tokens(model) ** 0.5) * IMAGE_BLOCK
    fused = args.colocate_engines == "fused"
    s = M.Settings(images=plan_image_limits(), und_format=fmt(args.und_quantization), gen_format=fmt(args.quantization),
                   max_image_side=side, cuda_graphs=args.cuda_graphs == "on", kv_cache_tokens=args.kv_cache_tokens,
                   kv_pool_gb=args.kv_pool_gb or (DEVICE_POOL_GB if fused else 16.0), engines=args.colocate_engines,
                   weight_streaming_layers=args.weight_streaming_layers or 0,
                   streaming_fallback=M.STREAMING_LAYERS if args.weight_streaming_layers is None else 0,
                   rl_waiting_bytes=RL_WAITING_BYTES if args.enable_rl else 0)
    result = M.plan(cfg, s, budget, args.mode)
    if args.json:
        out = {k: (v.as_dict(total) if v is not None else None) for k, v in result.items() if k != "weights"}
        out["weights"] = M.weight_table(result["weights"])
        print(json.dumps(out, indent=2))
    else:
        sys.stdout.write(M.render(result, total))
    return 0 if (result["asked"].fits or result["fix"] is not None) else 1


def add_knobs(sub) -> None:
    p = sub.add_parser("knobs", help="every U1SERVE_* environment variable: type, default, what it does (services/base/knobs.py)")
    p.add_argument("--markdown", action="store_true", help="the table of docs/configuration.md")
    p.set_defaults(func=cmd_knobs)


def cmd_knobs(args) -> int:
    from services.gateway.config import flag_knobs
    if args.markdown:
        sys.stdout.write(knobs.markdown(flag_knobs()))
        return 0
    for name, kind, default, why, read_by in knobs.rows(flag_knobs()):
        print(f"{name:34} {kind:5} {default or '-':18} {why} [{read_by}]")
    return 0


COMMANDS = [add_up, add_demo, add_tiny, add_tiny_lora, add_rl_train, add_ray, add_convert, add_plan, add_knobs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="u1serve", description="Serve SenseNova-U1: "
                                     "understanding + image generation behind one OpenAI API")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    sys.exit(args.func(args) or 0)


if __name__ == "__main__":
    main()
