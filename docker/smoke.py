"""The compose stack for real (docker/smoke.sh runs this): build the CPU image, `up` compose.cpu.yaml, drive the API
through the published port with the openai SDK and the API key, check the engines are unreachable from the host,
crash an engine and watch it come back, `down -v` and check nothing is left. A markdown table on stdout, exit 0
only when every check passed."""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPOSE_FILE = os.path.join(HERE, "compose.cpu.yaml")
SERVICES = ("understanding", "generation", "gateway")
ENGINE_PORTS = {"understanding": 8100, "generation": 8200}
POOL = "u1serve-kv"    # compose.cpu.yaml's --kv-pool-name
SIZE, STEPS = "64x64", 2


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], str]) -> bool:
        """One check: fn returns a detail line or raises; the outcome is recorded either way."""
        start = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as e:  # noqa: BLE001 - any failure is this check's result
            detail, ok = f"{type(e).__name__}: {e}"[:600], False
        self.checks.append(Check(name, ok, detail, time.monotonic() - start))
        print(f"[smoke] {'ok  ' if ok else 'FAIL'} {name} ({time.monotonic() - start:.1f} s): {detail}", flush=True)
        return ok

    def markdown(self) -> str:
        rows = ["| check | result | seconds | detail |", "|---|---|---:|---|"]
        for c in self.checks:
            rows.append(f"| {c.name} | {'ok' if c.ok else '**FAIL**'} | {c.seconds:.1f} | "
                        f"{c.detail.replace('|', '/').replace(chr(10), ' ')} |")
        passed = sum(c.ok for c in self.checks)
        facts = ", ".join(f"{k}: {v}" for k, v in self.facts.items())
        return "\n".join([f"## docker compose smoke: {passed}/{len(self.checks)} passed", "", facts, "", *rows])


def sh(argv: list[str], timeout: float = 120, check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {r.returncode}: {(r.stderr or r.stdout)[-800:]}")
    return r.stdout


def compose_client() -> list[str]:
    for argv in (["docker", "compose"], ["docker-compose"]):
        try:
            if subprocess.run(argv + ["version"], capture_output=True, timeout=30).returncode == 0:
                return argv
        except FileNotFoundError:
            continue
    raise SystemExit("no compose client (docker compose or docker-compose)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def wait_for(what: str, fn: Callable[[], object], timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class Stack:
    """compose.cpu.yaml as project `name`: secrets and env file in a private temporary directory."""

    def __init__(self, name: str, image: str, workdir: str):
        self.name, self.workdir = name, workdir
        self.port = free_port()
        self.api_key = "sk-" + secrets.token_hex(16)
        self.admin_key = "sk-admin-" + secrets.token_hex(16)
        # the tenants' file as an operator writes it: a comment, a blank line, two keys (the entrypoint takes all)
        self.second_key = "sk-" + secrets.token_hex(16)
        tenants = f"# tenants\n\n{self.api_key}\n{self.second_key}"
        for file, value in (("internal_token", secrets.token_hex(16)), ("api_key", tenants),
                            ("admin_api_key", self.admin_key)):
            path = os.path.join(workdir, file)
            with open(path, "w") as f:
                f.write(value + "\n")
            os.chmod(path, 0o644)   # bind-mounted: the container's non-root user reads it; the directory is 0700
        self.env_file = os.path.join(workdir, "smoke.env")
        with open(os.path.join(HERE, "cpu.env")) as f:
            env = [line for line in f.read().splitlines() if line and not line.startswith("#")]
        env += [f"INTERNAL_TOKEN_FILE={workdir}/internal_token", f"API_KEY_FILE={workdir}/api_key",
                f"ADMIN_API_KEY_FILE={workdir}/admin_api_key",
                f"GATEWAY_PORT={self.port}", f"U1SERVE_IMAGE={image}"]
        with open(self.env_file, "w") as f:
            f.write("\n".join(env) + "\n")   # later lines win
        self.base = f"http://127.0.0.1:{self.port}"
        self.compose = compose_client() + ["-p", name, "-f", COMPOSE_FILE, "--env-file", self.env_file]
        self.kv_mount = ""

    def run(self, *args: str, timeout: float = 300) -> str:
        return sh(self.compose + list(args), timeout=timeout)

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).split()
        if not ids:
            raise RuntimeError(f"no container for {service}")
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(sh(["docker", "inspect", self.container(service)]))[0]

    def healthy(self) -> bool:
        try:
            return all(self.inspect(s)["State"].get("Health", {}).get("Status") == "healthy" for s in SERVICES)
        except RuntimeError:
            return False

    def logs(self) -> str:
        return sh(self.compose + ["logs", "--no-color", "--tail", "40"], check=False)[-6000:]

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        return {kind: sh(["docker", kind, "ls", "-q", "--filter", label] + (["-a"] if kind == "container" else []))
                .split() for kind in ("container", "network", "volume")}


def api_checks(report: Report, stack: Stack) -> None:
    from openai import OpenAI
    from PIL import Image
    client = OpenAI(base_url=stack.base + "/v1", api_key=stack.api_key, max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    report.facts["model"] = model
    image_cfg = {"size": SIZE, "num_inference_steps": STEPS, "seed": 1}

    def png(b64: str) -> Image.Image:
        im = Image.open(io.BytesIO(base64.b64decode(b64)))
        im.load()
        return im

    def chat() -> str:
        r = client.chat.completions.create(model=model, max_tokens=12,
                                           messages=[{"role": "user", "content": "Say hello."}])
        msg = r.choices[0].message
        assert msg.role == "assistant" and r.usage.completion_tokens > 0, r
        return f"{r.usage.completion_tokens} tokens, finish {r.choices[0].finish_reason}"

    def chat_stream() -> str:
        chunks = list(client.chat.completions.create(model=model, max_tokens=12, stream=True,
                                                     messages=[{"role": "user", "content": "Hi"}]))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish, "no finish_reason in the stream"
        return f"{len(chunks)} chunks, {len(text)} chars, finish {finish[-1]}"

    made: list[bytes] = []

    def image() -> str:
        r = client.images.generate(model=model, prompt="a red cube", size=SIZE, extra_body=image_cfg)
        im = png(r.data[0].b64_json)
        made.append(base64.b64decode(r.data[0].b64_json))
        assert im.size == (64, 64), im.size
        return f"{im.format} {im.size[0]}x{im.size[1]}"

    def edit() -> str:
        src = made[0] if made else png_bytes()
        r = client.images.edit(model=model, prompt="make it green", image=("in.png", src, "image/png"),
                               extra_body={"num_inference_steps": STEPS})
        im = png(r.data[0].b64_json)
        return f"{im.format} {im.size[0]}x{im.size[1]}"

    def interleaved() -> str:
        # the random tiny model never picks <img> itself: a small logit bias on it (tests/system/test_6_interleave)
        r = client.chat.completions.create(
            model=model, max_tokens=24, modalities=["text", "image"], logit_bias={"262": 0.2},
            messages=[{"role": "user", "content": "Draw a red house, then describe it"}],
            extra_body={"image_config": {**image_cfg, "max_images": 1}})
        parts = r.choices[0].message.content
        assert isinstance(parts, list), parts
        kinds = [p["type"] for p in parts]
        assert "image_url" in kinds, kinds
        png(next(p for p in parts if p["type"] == "image_url")["image_url"]["url"].split(",", 1)[1])
        return f"parts {kinds}"

    def key_required() -> str:
        import openai
        try:
            OpenAI(base_url=stack.base + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        except openai.AuthenticationError as e:
            return f"wrong key -> {e.status_code}"
        raise AssertionError("a wrong API key was accepted")

    def roles() -> str:
        """The entrypoint handed both key files over: the file's second tenant key works; the operator key is
        accepted and kept apart (a tenant route refuses it, issue 37), a tenant key may not push weights."""
        import httpx
        import openai
        OpenAI(base_url=stack.base + "/v1", api_key=stack.second_key, max_retries=0).models.list()
        try:
            OpenAI(base_url=stack.base + "/v1", api_key=stack.admin_key, max_retries=0).chat.completions.create(
                model=model, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        except openai.PermissionDeniedError as e:
            operator = e.status_code
        else:
            raise AssertionError("the operator key was taken as a tenant's")
        r = httpx.post(stack.base + "/v1/rl/weights", json={"path": "/tmp/x"},
                       headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=30)
        assert r.status_code in (403, 404), r.text      # 404: the RL routes are off (no --enable-rl)
        return f"second tenant key ok, operator key on chat -> {operator}, tenant key on weights -> {r.status_code}"

    for name, fn in (("chat", chat), ("chat stream", chat_stream), ("image", image), ("edit", edit),
                     ("interleaved answer", interleaved), ("API key required", key_required),
                     ("tenant and operator keys", roles)):
        report.run(name, fn)


def png_bytes() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def engines_unreachable(stack: Stack) -> str:
    """The engines publish no port, and their addresses on the internal network do not answer the host. A TCP
    connect proves nothing (a sandbox's proxy may accept any), so the test is the engine's own /health answer:
    the gateway's container gets it (the control), the host must not."""
    import httpx
    gateway, tried = stack.container("gateway"), []
    for service, port in ENGINE_PORTS.items():
        info = stack.inspect(service)
        published = {k: v for k, v in (info["NetworkSettings"]["Ports"] or {}).items() if v}
        assert not published and not info["HostConfig"]["PortBindings"], f"{service} publishes {published}"
        nets = info["NetworkSettings"]["Networks"]
        assert list(nets) == [f"{stack.name}_engines"], f"{service} is on {list(nets)}"
        control = json.loads(sh(["docker", "exec", gateway, "curl", "-fsS", "-m", "5",
                                 f"http://{service}:{port}/health"]))
        address = nets[f"{stack.name}_engines"]["IPAddress"]
        try:
            r = httpx.get(f"http://{address}:{port}/health", timeout=3)
            answer = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            answer = None
            tried.append(f"{service} {address}:{port}: {type(e).__name__}")
        else:
            tried.append(f"{service} {address}:{port}: HTTP {r.status_code}, not the engine")
        assert not (isinstance(answer, dict) and answer.keys() == control.keys()), \
            f"{service} answers the host on {address}:{port}"
    return "no published ports; " + "; ".join(tried) + " (the gateway's container reaches both)"


def kv_volume(stack: Stack) -> str:
    """The pool is in the engines' shared tmpfs volume (both see it); its host mount point."""
    volume = f"{stack.name}_kv-shm"
    mount = json.loads(sh(["docker", "volume", "inspect", volume]))[0]["Mountpoint"]
    for service in ENGINE_PORTS:
        listing = sh(["docker", "exec", stack.container(service), "ls", "/dev/shm"]).split()
        assert POOL in listing, f"{service}: /dev/shm holds {listing}"
    stack.kv_mount = mount
    return f"{POOL} in volume {volume} (tmpfs at {mount}), seen by both engines"


def gateway_ok(stack: Stack) -> bool:
    import httpx
    try:
        r = httpx.get(stack.base + "/health", timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def crash_and_recover(stack: Stack, service: str) -> str:
    """SIGKILL the engine's main process from the host (a crash: `docker kill` would count as a manual stop, which
    the restart policy honours), then wait for docker to restart it, healthy, and the gateway to serve again."""
    import httpx
    before = stack.inspect(service)
    pid, restarts = before["State"]["Pid"], before["RestartCount"]
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(f"{service} restarted", lambda: stack.inspect(service)["RestartCount"] > restarts, 60, 0.5)
    wait_for(f"{service} healthy again", lambda: stack.inspect(service)["State"].get("Health", {})
             .get("Status") == "healthy", 300)
    wait_for("gateway /health", lambda: gateway_ok(stack), 120)
    back = time.monotonic() - start
    r = httpx.post(stack.base + "/v1/images/generations", timeout=180,
                   headers={"Authorization": f"Bearer {stack.api_key}"},
                   json={"prompt": "after the crash", "size": SIZE, "num_inference_steps": STEPS})
    assert r.status_code == 200 and r.json()["data"][0]["b64_json"], r.text[:300]
    return f"killed pid {pid}; restart {restarts} -> {stack.inspect(service)['RestartCount']}, healthy and " \
           f"serving again after {back:.0f} s; an image request after it: 200"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", default="u1serve:cpu")
    ap.add_argument("--no-build", action="store_true", help="use --image as it is (fail if it is absent)")
    ap.add_argument("--crash", choices=ENGINE_PORTS, default="understanding", help="the engine to kill")
    ap.add_argument("--up-timeout", type=float, default=400)
    ap.add_argument("--keep", action="store_true", help="leave the stack up (no down check)")
    ap.add_argument("--json", help="write the checks here too")
    args = ap.parse_args()
    report = Report()
    name = f"u1smoke{os.getpid()}"

    def build() -> str:
        if not args.no_build:
            sh([os.path.join(HERE, "build.sh"), "--variant", "cpu", "--tag", args.image], timeout=1800)
        size = int(sh(["docker", "image", "inspect", args.image, "--format", "{{.Size}}"]))
        report.facts["image"] = f"{args.image} {size / 1e6:.0f} MB"
        return report.facts["image"]

    if not report.run("build the CPU image", build):
        print(report.markdown())
        return 1
    workdir = tempfile.mkdtemp(prefix="u1smoke-")
    os.chmod(workdir, 0o700)
    stack = Stack(name, args.image, workdir)
    shm_before = host_shm()
    up_ok = False
    try:
        def up() -> str:
            start = time.monotonic()
            stack.run("up", "-d", timeout=args.up_timeout)
            try:
                wait_for("all three healthy", stack.healthy, args.up_timeout)
            except TimeoutError as e:
                raise TimeoutError(f"{e}\n{stack.logs()}") from None
            return f"project {name}, gateway on 127.0.0.1:{stack.port}, healthy after {time.monotonic() - start:.0f} s"

        up_ok = report.run("compose up, all healthy", up)
        if up_ok:
            report.run("KV pool in the shared volume", lambda: kv_volume(stack))
            api_checks(report, stack)
            report.run("engines unreachable from the host", lambda: engines_unreachable(stack))
            report.run(f"{args.crash} crash: restarted, gateway recovers", lambda: crash_and_recover(stack, args.crash))
    finally:
        if not up_ok:
            print(stack.logs())
        if not args.keep:
            def down() -> str:
                stack.run("down", "-v", "--remove-orphans", timeout=180)
                left = {k: v for k, v in stack.leftovers().items() if v}
                assert not left, f"left behind: {left}"
                # the pool lived in the volume: its tmpfs is unmounted, and nothing of ours came to the host's
                with open("/proc/self/mounts") as f:
                    mounted = stack.kv_mount and stack.kv_mount in f.read()
                assert not mounted, f"{stack.kv_mount} is still mounted"
                assert POOL not in host_shm() - shm_before, f"/dev/shm/{POOL} on the host"
                return "no containers, networks, volumes of the project; the KV tmpfs is unmounted; " \
                       "no new /dev/shm segment on the host"
            report.run("compose down -v, nothing left", down)
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(report.markdown())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"facts": report.facts, "checks": [c.__dict__ for c in report.checks]}, f, indent=2)
    return 0 if report.checks and all(c.ok for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
