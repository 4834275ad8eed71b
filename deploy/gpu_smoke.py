#!/usr/bin/env python3
"""Smoke test of one deployment profile through the public API (deploy/gpu_smoke.sh runs every profile).

    python -m deploy.gpu_smoke run --profile colocate-1 --out OUT/colocate-1.json
    python -m deploy.gpu_smoke report OUT          # markdown table of OUT/*.json, OUT/summary.json
    python -m deploy.gpu_smoke profiles --gpus 2   # the default profiles of a machine with 2 GPUs

A run starts `u1serve up` (GPU profiles: the random-weight 8B geometry, `u1serve tiny-checkpoint DIR --variant
u1-8b` + U1SERVE_RANDOM_WEIGHTS=1; `cpu`: the tiny checkpoint), with two tenant keys and an operator key from files (RL and runtime LoRA on), then checks:
chat, a chat stream, an image stream, a 1024² image (256² on CPU), an edit, the Responses API (text, then the image
tool continuing it), the roles (a tenant pushing weights 403, the operator key on chat 403), hostile inputs (temperature 1e-40,
repetition_penalty 1e-300, seed 2**64, NaN, Infinity, nesting deeper than 32, a decompression-bomb image,
non-ASCII and wrong keys: a 4xx, never a 5xx), a burst of 32 mixed requests with cancels (bench_load), then
/health, empty KV pools (understanding's shm_pages_used, generation's queue), on a GPU (graphs are on by default) that
generation's steps replayed CUDA graphs, clean logs (no Traceback, no 500), and stops the stack
(exit code 0, nothing left running).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import time
from typing import Callable, Optional

import httpx

from bench.bench_load import LoadConfig, bomb_png, data_url, png, run_burst, summarize
from bench.profile_stack import PROFILES, Stack, profiles_for
from services.kit import sse

STEPS = 4


def _png_size(b64: str) -> tuple[int, int]:
    raw = base64.b64decode(b64)
    return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")


# ---------------------------------------------------------------------------------------------- checks
def checks(stack: Stack) -> list[tuple[str, Callable[[httpx.Client], str]]]:
    """(name, check) pairs; a check returns a detail string or raises AssertionError."""
    side = 256 if stack.gpus == 0 else 1024
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}

    def status_of(c, path, *, raw=None, body=None, headers=None, want=(400,)):
        r = c.post(path, content=raw, json=body, headers={"content-type": "application/json", **(headers or {})})
        assert r.status_code in want, f"HTTP {r.status_code} (want {want}): {r.text[:300]}"
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "code"}, r.text[:300]
            return f"{r.status_code} {err['code']}"
        return str(r.status_code)

    def c_chat(c):
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text[:300]
        return f"{r.json()['usage']['completion_tokens']} tokens"

    def c_chat_stream(c):
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200, r.read()[:300]
            lines = list(r.iter_lines())
        events = list(sse.events(lines))
        assert events and sse.encode(sse.DONE).decode().strip() in lines, lines[-3:]
        return f"{len(events)} events"

    def c_image_stream(c):
        body = {"prompt": "a red fox", "size": "256x256", "num_inference_steps": STEPS, "stream": True}
        with c.stream("POST", "/v1/images/generations", json=body) as r:
            assert r.status_code == 200, r.read()[:300]
            kinds = [ev.get("type") for ev in sse.events(r.iter_lines())]
        assert kinds.count("image_generation.progress") == STEPS and kinds[-1] == "image_generation.completed", kinds
        return f"{len(kinds)} events"

    def c_image(c):
        t0 = time.monotonic()
        r = c.post("/v1/images/generations", json={"prompt": "a lighthouse", "size": f"{side}x{side}",
                                                    "num_inference_steps": STEPS, "seed": 7})
        assert r.status_code == 200, r.text[:300]
        assert _png_size(r.json()["data"][0]["b64_json"]) == (side, side)
        return f"{side}x{side}, {STEPS} steps, {time.monotonic() - t0:.1f} s"

    def c_step_cache(c):
        # threshold 10: every finite change reuses, so a branch that never reuses measured NaN/Inf; a NaN image or
        # prefix is answered 500 nonfinite_output / nonfinite_prefix (its message says where) and fails here too
        r = c.post("/v1/images/generations", json={"prompt": "a lighthouse", "size": f"{side}x{side}", "seed": 7,
                                                    "num_inference_steps": 3 * STEPS,
                                                    "cache": {"mode": "first_block", "threshold": 10.0}})
        assert r.status_code == 200, r.text[:300]
        steps = r.json()["data"][0].get("branch_steps") or {}
        reused = {b: v.get("reused", 0) for b, v in steps.items()}
        assert reused and all(reused.values()), f"a branch reused nothing (non-finite changes?): {steps}"
        return f"reused per branch {reused} of {3 * STEPS} steps"

    def c_edit(c):
        r = c.post("/v1/images/edits", files=[("image[]", ("in.png", png(96, 64), "image/png"))],
                   data={"prompt": "make it blue", "num_inference_steps": str(STEPS), "size": "256x256"})
        assert r.status_code == 200, r.text[:300]
        return "200"

    def c_responses(c):
        # the Responses API (docs/responses.md): a text answer, then the image tool continuing it (stored)
        r = c.post("/v1/responses", json={"input": "Say hello.", "max_output_tokens": 8})
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text[:300]  # 8 tokens
        r = c.post("/v1/responses", json={"input": "a red fox", "previous_response_id": r.json()["id"],
                                          "tools": [{"type": "image_generation", "size": "256x256",
                                                     "num_inference_steps": STEPS}]})
        assert r.status_code == 200, r.text[:300]
        calls = [o for o in r.json()["output"] if o["type"] == "image_generation_call"]
        assert calls and _png_size(calls[0]["result"]) == (256, 256), r.text[:300]
        return "text, then an image_generation_call 256x256"

    def c_roles(c):
        # issue 37: weights are the operator's; the operator key is no tenant's; one tenant's ids are not another's
        no_auth = {"Authorization": ""}
        tenant = status_of(c, "/v1/rl/weights", body={"path": "/nonexistent", "version": "x"}, want=(403,))
        op = status_of(c, "/v1/chat/completions", body=chat, want=(403,),
                       headers={**no_auth, "Authorization": f"Bearer {stack.operator_key}"})
        other = c.get("/v1/rl/trajectories/traj-0000", headers={"Authorization": f"Bearer {stack.tenant_b}"})
        assert other.status_code == 404, other.text[:300]
        return f"tenant pushing weights {tenant}; operator key on chat {op}; unknown trajectory 404"

    hostile = [
        ("temperature 1e-40", lambda c: status_of(c, "/v1/chat/completions", body={**chat, "temperature": 1e-40},
                                                  want=(200,))),
        ("repetition_penalty 1e-300", lambda c: status_of(c, "/v1/chat/completions",
                                                          body={**chat, "repetition_penalty": 1e-300},
                                                          want=(200, 400))),
        ("seed 2**64", lambda c: status_of(c, "/v1/images/generations", raw=json.dumps(
            {"prompt": "x", "size": "64x64", "seed": 2**64}).encode())),
        ("NaN", lambda c: status_of(c, "/v1/chat/completions",
                                    raw=b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')),
        ("Infinity", lambda c: status_of(c, "/v1/images/generations",
                                         raw=b'{"prompt": "x", "guidance_scale": Infinity}')),
        ("nesting 64 deep", lambda c: status_of(c, "/v1/chat/completions", raw=b'{"a":' * 64 + b"1" + b"}" * 64)),
        ("decompression bomb", lambda c: status_of(c, "/v1/images/edits", body={
            "prompt": "x", "image": [data_url(bomb_png())]}, want=(400, 413))),
        ("non-ASCII API key", lambda c: status_of(c, "/v1/chat/completions", body=chat, want=(401,),
                                                  headers={"Authorization": "Bearer sk-t\u00e9st".encode()})),
        ("wrong API key", lambda c: status_of(c, "/v1/chat/completions", body=chat, want=(401,),
                                              headers={"Authorization": "Bearer sk-wrong"})),
    ]

    def c_burst(c):
        outs = run_burst(stack.base, 32, LoadConfig(size="64x64" if stack.gpus == 0 else "256x256", steps=STEPS,
                                                    max_tokens=8, api_key=stack.api_key))
        s = summarize(outs, 1.0)
        assert s["count_5xx"] == 0 and s["transport_errors"] == 0, s["codes_5xx"]
        kinds = s["by_kind"]
        assert kinds["cancel"]["n"] >= 4 and kinds["bad"]["ok"] == 0, kinds
        for k in ("chat", "chat_stream", "image", "image_stream", "edit"):
            assert kinds[k]["ok"] == kinds[k]["n"], (k, kinds[k], [f"{o.status} {o.error_code}" for o in outs
                                                                  if o.kind == k and o.status != 200])
        return f"{s['requests']} requests, {s['images']} images, statuses " + \
            ", ".join(f"{k} {v['statuses']}" for k, v in kinds.items())

    return [("chat", c_chat), ("chat stream", c_chat_stream), ("image stream", c_image_stream),
            ("image", c_image), ("step cache reuses", c_step_cache), ("edit", c_edit), ("responses", c_responses),
            ("roles", c_roles), *hostile, ("burst of 32 with cancels", c_burst)]


def run_profile(profile: str, out: Optional[str], work_dir: Optional[str] = None) -> dict:
    t0 = time.monotonic()
    result = {"profile": profile, "checks": [], "ok": False}
    stack = Stack(profile, work_dir, tenants=True)    # two tenant keys and an operator key, RL and runtime LoRA on
    try:
        with stack:
            result["startup_s"] = round(stack.startup_s, 1)
            with stack.client() as c:
                for name, check in checks(stack):
                    t = time.monotonic()
                    try:
                        detail, ok = check(c), True
                    except Exception as exc:
                        detail, ok = f"{type(exc).__name__}: {exc}"[:500], False
                    result["checks"].append({"name": name, "ok": ok, "detail": detail,
                                             "seconds": round(time.monotonic() - t, 2)})
                    print(f"{'ok  ' if ok else 'FAIL'} {profile}: {name}: {detail}", flush=True)
            problems = stack.settle_problems()
            result["checks"].append({"name": "idle, KV pools empty", "ok": not problems,
                                     "detail": "; ".join(problems) or "gateway 200, shm_pages_used 0, queue 0"})
            if stack.graphs_expected():
                problems = stack.graph_problems()
                result["checks"].append({"name": "CUDA graphs replayed", "ok": not problems,
                                         "detail": "; ".join(problems) or "generation steps replay graphs"})
    except Exception as exc:
        result["checks"].append({"name": "start-up", "ok": False, "detail": f"{exc}"[-3000:]})
    logs = stack.log_problems()
    result["checks"].append({"name": "clean logs", "ok": not logs, "detail": "; ".join(logs[:5]) or "no Traceback, no 500"})
    result["checks"].append({"name": "clean stop", "ok": stack.exit_code == 0,
                             "detail": f"u1serve up exited {stack.exit_code}"})
    result["ok"] = all(c["ok"] for c in result["checks"])
    result["seconds"] = round(time.monotonic() - t0, 1)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if work_dir is None:
        shutil.rmtree(stack.dir, ignore_errors=True)
    return result


def report(out_dir: str, expected: list[str]) -> int:
    results = {}
    for name in expected:
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
        else:
            results[name] = {"profile": name, "ok": False, "checks": [
                {"name": "time limit", "ok": False, "detail": "no result: killed at its time limit or crashed"}]}
    lines = ["| profile | check | result | detail |", "|---|---|---|---|"]
    for name, r in results.items():
        head = f"{name} ({r.get('seconds', '?')} s, up in {r.get('startup_s', '?')} s)"
        for i, c in enumerate(r["checks"]):
            detail = str(c["detail"]).replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {head if i == 0 else ''} | {c['name']} | {'ok' if c['ok'] else '**FAIL**'} | {detail} |")
    print("\n".join(lines))
    summary = {"ok": all(r["ok"] for r in results.values()), "profiles": results}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if summary["ok"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--profile", choices=list(PROFILES), required=True)
    r.add_argument("--out", default=None)
    r.add_argument("--work-dir", default=None, help="keep the model, logs and run dir here")
    rep = sub.add_parser("report")
    rep.add_argument("out_dir")
    rep.add_argument("--profiles", required=True, help="comma-separated: the profiles that should have run")
    pr = sub.add_parser("profiles")
    pr.add_argument("--gpus", type=int, required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        return 0 if run_profile(args.profile, args.out, args.work_dir)["ok"] else 1
    if args.cmd == "report":
        return report(args.out_dir, [x for x in args.profiles.split(",") if x])
    print(",".join(profiles_for(args.gpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
