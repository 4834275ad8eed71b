"""docker/entrypoint.sh run for real (as the image runs it): the internal token from its file into the
environment; the key files checked and handed to the gateway, which then accepts every key of the file and no
other. An empty file, a file of blank lines or comments only, a malformed line and a key shared by tenants and
operators stop the container (exit 2) instead of starting a keyless or wrongly keyed gateway."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from services.kit.proc import preexec_die_with_parent
from services.base.netutil import free_port
from tests.waiting import wait_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(ROOT, "docker", "entrypoint.sh")
KEY_A, KEY_B = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-0123456789abcdef"
ADMIN = "sk-operator-0123456789abcdef"


def gateway_argv(port: int) -> list[str]:
    """The gateway as compose runs it (no key flag: the entrypoint adds it), engines that do not exist."""
    dead = f"http://127.0.0.1:{free_port()}"
    return [sys.executable, "-m", "services.gateway.server", "--host", "127.0.0.1", "--port", str(port),
            "--und-url", dead, "--gen-url", dead]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "tok").write_text("tok-123\n")

    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)
    write.env = {"PATH": os.environ["PATH"], "PYTHONPATH": ROOT, "U1SERVE_INTERNAL_TOKEN_FILE": str(tmp_path / "tok")}
    return write


def entry(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([ENTRY, *argv], env=env, capture_output=True, text=True, timeout=60)


def test_the_internal_token_file_goes_into_the_environment(files):
    r = entry(["sh", "-c", 'echo "$U1SERVE_INTERNAL_TOKEN|${U1SERVE_INTERNAL_TOKEN_FILE-gone}"'], files.env)
    assert r.returncode == 0 and r.stdout.strip() == "tok-123|gone", r.stderr
    files("tok", "change-me-to-a-random-string\n")
    r = entry(["true"], files.env)
    assert r.returncode == 2 and "internal token" in r.stderr
    r = entry(["true"], {**files.env, "U1SERVE_INTERNAL_TOKEN_FILE": "/nonexistent/tok"})
    assert r.returncode == 2 and "not a readable file" in r.stderr


@pytest.mark.parametrize("text, why", [
    ("", "holds no key"),
    ("\n\n", "holds no key"),
    ("# sk-looks-like-a-key-but-is-a-comment\n  # indented comment\n", "holds no key"),
    (f"{KEY_A} # tenant a\n", "not one key"),
    (f"{KEY_A}\nsk-two words-0123456789\n", "key line 2 is not one key"),
    ("sk-short\n", "shorter than 16"),
    ("change-me-to-a-random-key\n", "placeholder"),
])
def test_a_key_file_without_exactly_keys_stops_the_gateway(files, text, why):
    """Each of these started a keyless gateway on 0.0.0.0, or one keyed by a comment line."""
    env = {**files.env, "U1SERVE_API_KEY_FILE": files("keys", text)}
    r = entry(gateway_argv(free_port()), env)
    assert r.returncode == 2 and why in r.stderr, (r.returncode, r.stderr)
    assert "Uvicorn running" not in r.stderr + r.stdout


def test_key_files_are_the_gateways_and_operators_stay_apart(files):
    keys = files("keys", f"{KEY_A}\n")
    r = entry(["sh", "-c", "true"], {**files.env, "U1SERVE_API_KEY_FILE": keys})
    assert r.returncode == 2 and "is the gateway's" in r.stderr
    env = {**files.env, "U1SERVE_API_KEY_FILE": keys, "U1SERVE_ADMIN_API_KEY_FILE": files("admin", f"{KEY_A}\n")}
    r = entry(gateway_argv(free_port()), env)
    assert r.returncode == 2 and "in both" in r.stderr, r.stderr
    r = entry(gateway_argv(free_port()), {**env, "U1SERVE_ADMIN_API_KEY_FILE": files("admin", "\n")})
    assert r.returncode == 2 and "U1SERVE_ADMIN_API_KEY_FILE" in r.stderr and "holds no key" in r.stderr


class EntryGateway:
    """The real gateway started through the entrypoint."""

    def __init__(self, env: dict, log_path: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([ENTRY, *gateway_argv(self.port)], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=preexec_die_with_parent)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def __enter__(self) -> "EntryGateway":
        wait_ok(self.base + "/health/live", self.proc, self.output, 90, "the gateway behind the entrypoint")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def status(self, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.base + "/v1/models", headers=headers, timeout=10).status_code


@pytest.mark.timeout(180)
@pytest.mark.parametrize("text", [f"\n{KEY_A}\n{KEY_B}\n",                          # a blank first line
                                  f"# tenants\n\n  {KEY_A}  \n# b:\n{KEY_B}\r\n"])    # comments, spaces, CRLF
def test_the_gateway_takes_every_key_of_the_file(files, tmp_path, text):
    env = {**files.env, "U1SERVE_API_KEY_FILE": files("keys", text)}
    with EntryGateway(env, str(tmp_path / "gateway.log")) as g:
        assert g.status(KEY_A) != 401 and g.status(KEY_B) != 401
        for wrong in ("sk-wrong-0123456789abcdef", "# tenants", "# b:", None):
            assert g.status(wrong) == 401, wrong
    assert KEY_A not in g.output() and KEY_B not in g.output()       # the keys are not logged


@pytest.mark.timeout(180)
def test_the_operator_key_file_reaches_the_gateway(files, tmp_path):
    """Needs the gateway's --admin-api-key-file (issue 37's roles): an operator key is accepted, and is no
    tenant's key file entry."""
    env = {**files.env, "U1SERVE_API_KEY_FILE": files("keys", f"{KEY_A}\n"),
           "U1SERVE_ADMIN_API_KEY_FILE": files("admin", f"# operators\n{ADMIN}\n")}
    with EntryGateway(env, str(tmp_path / "gateway.log")) as g:
        assert g.status(KEY_A) != 401 and g.status(ADMIN) != 401
        assert g.status("sk-wrong-0123456789abcdef") == 401
