"""`u1serve rl-train`'s flags and how they become a TrainConfig (argparse only: importing it is instant)."""
from __future__ import annotations

import argparse

# the tiny checkpoint's random weights cannot denoise: its clean-image estimate barely depends on the state, so
# with the usual t_eps the final image would carry no trace of the SDE noise the policy is credited for. t_eps 0.5
# makes the last step blend the state in (z_N = z + dt/t_eps * (x^ - z)), so rewards see the trained transitions.
# text_lr: at lr 1e-3 MixGRPO's think-chars term did not move in 12 iterations (0.15 -> 0.07, noise); each token's
# logit is its own LM-head row, pushed only when that token is sampled, so the head needs a larger step (0.15 -> 0.71).
TINY_DEFAULTS = {"size": "32x32", "num_inference_steps": 4, "group_size": 4, "guidance_scale": 1.0,
                 "timestep_shift": 1.0, "t_eps": 0.5, "lr": 1e-3, "text_lr": 3e-2, "think_max_tokens": 4,
                 "prompts": ["a red fox in the snow", "a lighthouse at dusk"]}
FLAG_FIELDS = ("size", "num_inference_steps", "group_size", "guidance_scale", "timestep_shift", "t_eps", "lr",
               "noise_level", "kl_beta", "clip_range", "text_clip_range", "updates_per_iteration", "seed",
               "timestep_fraction", "window_size", "window_shift", "window_every", "think_max_tokens",
               "think_temperature", "text_weight", "text_lr", "max_grad_norm", "train_branch")


def add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algo", choices=["flow-grpo", "dance-grpo", "mix-grpo"], required=True)
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--base", default=None, help="attach to the stack at this URL instead of starting one")
    p.add_argument("--api-key", default=None, help="the stack's API key (default: U1SERVE_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="the stack's operator key, for the weight pushes (default: U1SERVE_ADMIN_API_KEY)")
    p.add_argument("--model", default="tiny",
                   help="checkpoint the trainer's copy is built from (the stack's own); 'tiny' = the tiny one")
    p.add_argument("--push", choices=["auto", "path", "upload"], default="auto",
                   help="how new weights reach the stack: path (the engines read our temp dir; same host), upload "
                        "(POST the safetensors bytes); auto: path for a loopback stack, else upload")
    p.add_argument("--prompt", action="append", dest="prompts", default=None, help="a training prompt (repeatable)")
    p.add_argument("--reward", action="append", dest="rewards", default=None,
                   help="NAME[:ARG][@WEIGHT] (repeatable): brightness, colour:R,G,B, think-length:N, "
                        "think-keyword:WORD, think-chars:CHARS (default: brightness; mix-grpo adds think-chars)")
    p.add_argument("--group-size", type=int, dest="group_size")
    p.add_argument("--size")
    p.add_argument("--steps", type=int, dest="num_inference_steps")
    p.add_argument("--guidance-scale", type=float, dest="guidance_scale")
    p.add_argument("--timestep-shift", type=float, dest="timestep_shift")
    p.add_argument("--t-eps", type=float, dest="t_eps")
    p.add_argument("--noise-level", type=float, dest="noise_level")
    p.add_argument("--lr", type=float)
    p.add_argument("--kl-beta", type=float, dest="kl_beta", help="weight of the k3 KL to the reference (default 0)")
    p.add_argument("--clip-range", type=float, dest="clip_range", help="image PPO clip (default 1e-4)")
    p.add_argument("--text-clip-range", type=float, dest="text_clip_range", help="think-token PPO clip (0.2)")
    p.add_argument("--updates-per-iteration", type=int, dest="updates_per_iteration")
    p.add_argument("--max-grad-norm", type=float, dest="max_grad_norm")
    p.add_argument("--seed", type=int)
    p.add_argument("--window", default=None, help="flow-grpo: START,SIZE SDE window (default: every step but last)")
    p.add_argument("--timestep-fraction", type=float, dest="timestep_fraction", help="dance-grpo (0.6)")
    p.add_argument("--same-initial-noise", action="store_true", help="dance-grpo: one initial noise per group")
    p.add_argument("--window-size", type=int, dest="window_size", help="mix-grpo (2)")
    p.add_argument("--window-shift", type=int, dest="window_shift", help="mix-grpo (1)")
    p.add_argument("--window-every", type=int, dest="window_every", help="mix-grpo: iterations per position (3)")
    p.add_argument("--think-max-tokens", type=int, dest="think_max_tokens")
    p.add_argument("--think-temperature", type=float, dest="think_temperature")
    p.add_argument("--text-weight", type=float, dest="text_weight", help="mix-grpo: weight of the think loss")
    p.add_argument("--text-lr", type=float, dest="text_lr",
                   help="mix-grpo: learning rate of the LM head (the think tokens' logits); default --lr")
    p.add_argument("--train-branch", choices=["gen", "und", "both"], dest="train_branch")


def config_from_args(args: argparse.Namespace):
    from .trainer import TrainConfig
    values = dict(TINY_DEFAULTS) if args.model == "tiny" else {}
    for name in FLAG_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if args.prompts:
        values["prompts"] = args.prompts
    values["rewards"] = args.rewards or (["brightness", "think-chars"] if args.algo == "mix-grpo"
                                         else ["brightness"])
    if args.window:
        start, size = (int(x) for x in args.window.split(","))
        values["window"] = (start, size)
    return TrainConfig(algo=args.algo, same_initial_noise=args.same_initial_noise, **values)
