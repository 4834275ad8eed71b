"""Structured fuzzing of every public route by its OpenAPI schema (schemathesis): valid and invalid values of
every field, as JSON and multipart, against a real gateway in front of the real engines (the `u1serve up`
stack on the tiny checkpoint, CPU). No response may be a 5xx, and every response must conform to the schema
(documented status, content type and body).

The fuzzed gateway tightens the image limits (--max-side, --max-steps, --max-think-tokens, --max-prompt-chars:
/openapi.json carries them, so valid requests stay small) and each case asks for at most a few tokens and two
choices, so the run is bounded on a CPU.

The schema is the gateway's own, built in this process from the fuzzed gateway's flags (no server needed to
collect), and the first test checks that the running gateway serves exactly it. Loaded at collection, it takes
schemathesis's plain `parametrize` (one test per operation): its fixture-loaded form rewrites pytest's private
`Node._nodeid`, which pytest 9.2 removed (AttributeError on every case). Under pytest 9.2 (schemathesis 4.32.5) the
per-operation tests all report the one node id `test_no_5xx_and_responses_conform` (pytest builds it from the
function's name): each still runs, and a failed check's report carries the request (its curl line)."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                status_code_conformance)

from tests.system.stackproc import GatewayProc

EXAMPLES = 8                      # per operation: about a minute on a 2-core CI runner
MAX_TOKENS = 4
MAX_CHOICES = 2
FLAGS = ("--max-side", "64", "--max-pixels", "4096", "--max-steps", "2", "--max-prompt-chars", "256",
         "--max-think-tokens", "4", "--default-think-tokens", "4", "--default-steps", "2",
         "--upstream-idle-timeout-s", "60")


def gateway_openapi(*flags: str) -> dict:
    """/openapi.json of a gateway started with `flags` (as GatewayProc starts it), without starting one."""
    from services.gateway.app import create_app
    from services.gateway.config import build_arg_parser, config_from_args
    nowhere = "http://127.0.0.1:9"
    args = build_arg_parser().parse_args(["--und-url", nowhere, "--gen-url", nowhere, "--default-size", "64x64",
                                          *flags])
    return create_app(config_from_args(args)).openapi()


OPENAPI = gateway_openapi(*FLAGS)
# the RL routes (tag "rl") change the stack's state (weights) or run whole rollout groups: out of this fuzz
schema = schemathesis.openapi.from_dict(OPENAPI).exclude(tag="rl")


@pytest.fixture(scope="module")
def fuzzed(stack, tmp_path_factory):
    g = GatewayProc(stack.und, stack.gen, *FLAGS, env={"U1SERVE_INTERNAL_TOKEN": stack.token},
                    log_dir=str(tmp_path_factory.mktemp("fuzz"))).wait_up()
    yield g
    out = g.stop()
    assert "Traceback" not in out, out[-5000:]


def test_the_fuzzed_schema_is_the_served_one(fuzzed):
    assert httpx.get(fuzzed.base + "/openapi.json", timeout=30).json() == OPENAPI


def bounded(body):
    """A case's text budget cut to a few tokens and two choices (the fuzz is about fields, not long answers)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if "input" in body and body.get("max_output_tokens") is None:         # /v1/responses
        body["max_output_tokens"] = MAX_TOKENS
    if "messages" in body and isinstance(body.get("n"), int) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    for key in ("image_config", "extra_body"):
        if isinstance(body.get(key), dict):
            bounded(body[key])


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_responses_conform(case, fuzzed):
    bounded(case.body)
    case.call_and_validate(base_url=fuzzed.base, timeout=120,
                           checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance])
