"""`u1serve up` placement and the engine command lines it builds (no processes started)."""
import argparse
import os

import pytest

from services.launch import cli, stack


def up_args(*extra):
    p = argparse.ArgumentParser()
    stack.add_stack_flags(p, model_default=None)
    args = p.parse_args(["--model", "/m", *extra])
    stack.resolve_ports(args, probe=False)
    return args


def ctx_for(args):
    return {"model": "/m", "placement": stack.Placement(args), "pool": "pool", "pool_gb": 1.0,
            "env": {"U1SERVE_INTERNAL_TOKEN": "t"}, "model_name": "m", "default_size": "64x64"}


def test_colocate_shares_gpus_with_memory_fractions():
    args = up_args("--device", "cuda", "--mode", "colocate", "--und-gpus", "0,1", "--und-tp", "2",
                   "--gen-cfg-parallel", "2")
    ctx = ctx_for(args)
    und, gen = stack.build_und(args, ctx), stack.build_gen(args, ctx)
    assert und.env["CUDA_VISIBLE_DEVICES"] == gen.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert float(und.env["U1SERVE_GPU_MEMORY_FRACTION"]) + float(gen.env["U1SERVE_GPU_MEMORY_FRACTION"]) <= 0.95
    assert und.env["U1SERVE_INTERNAL_TOKEN"] == "t"


def test_separate_uses_disjoint_gpus():
    args = up_args("--device", "cuda", "--mode", "separate", "--und-tp", "2", "--gen-cfg-parallel", "2")
    ctx = ctx_for(args)
    assert stack.build_und(args, ctx).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert stack.build_gen(args, ctx).env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "U1SERVE_GPU_MEMORY_FRACTION" not in stack.build_gen(args, ctx).env
    with pytest.raises(SystemExit):
        stack.Placement(up_args("--device", "cuda", "--mode", "separate", "--und-gpus", "0", "--gen-gpus", "0"))
    with pytest.raises(SystemExit):
        stack.Placement(up_args("--device", "cuda", "--und-gpus", "0", "--und-tp", "2"))


def test_cpu_defaults():
    args = up_args("--device", "cpu")
    pl = stack.Placement(args)
    assert (pl.device, pl.dtype) == ("cpu", "float32")
    assert stack.build_und(args, ctx_for(args)).env["CUDA_VISIBLE_DEVICES"] == ""


def test_built_command_lines_parse_with_the_engines_own_parsers():
    """The launcher's flags are the engines' flags (catches drift between the two)."""
    from services.gateway.config import build_arg_parser as gateway_parser
    from services.generation.server import build_parser as gen_parser
    from services.understanding.server import build_parser as und_parser
    args = up_args("--device", "cpu", "--und-args", "--kv-cache-tokens 1024",
                   "--gen-args", "--max-batch-tokens 2048")
    ctx = ctx_for(args)
    for build, parser in ((stack.build_und, und_parser), (stack.build_gen, gen_parser),
                          (stack.build_gateway, gateway_parser)):
        spec = build(args, ctx)
        assert spec.argv[1] == "-m"
        parsed = parser().parse_args(spec.argv[3:])
        assert getattr(parsed, "model", "/m") == "/m"


def test_tiny_checkpoint_command(tmp_path):
    cli_main = cli.main
    with pytest.raises(SystemExit) as e:
        cli_main(["tiny-checkpoint", str(tmp_path / "cfg"), "--variant", "a3b", "--config-only"])
    assert e.value.code == 0
    files = os.listdir(tmp_path / "cfg")
    assert "config.json" in files and not any(f.endswith(".safetensors") for f in files)


def test_engine_ports_follow_the_gateway_port():
    args = up_args("--device", "cpu", "--port", "9000")
    assert (args.und_port, args.gen_port) == (9100, 9200)
    args = up_args("--device", "cpu", "--port", "9000", "--gen-port", "9300")
    assert (args.und_port, args.gen_port) == (9100, 9300)


def test_taken_ports_free_ones_or_an_error_that_names_the_flag():
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        p = argparse.ArgumentParser()
        stack.add_stack_flags(p, model_default=None)
        args = p.parse_args(["--model", "/m", "--host", "127.0.0.1", "--port", str(taken - 100)])
        stack.resolve_ports(args)                  # the derived understanding port is taken: a free one
        assert args.und_port != taken and args.gen_port == taken + 100
        for flags, flag in ((["--port", str(taken)], "--port"), (["--und-port", str(taken)], "--und-port"),
                            (["--gen-port", str(taken)], "--gen-port")):
            args = p.parse_args(["--model", "/m", "--host", "127.0.0.1", *flags])
            with pytest.raises(SystemExit) as e:
                stack.resolve_ports(args)
            assert f"({flag}" in str(e.value) and "already in use" in str(e.value)


def test_secrets_come_from_files_or_the_environment_and_stay_off_command_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("U1SERVE_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("U1SERVE_API_KEY", raising=False)
    (tmp_path / "key").write_text("sk-file\n")
    (tmp_path / "tok").write_text("tok-file\n")
    args = up_args("--device", "cpu", "--api-key-file", str(tmp_path / "key"),
                   "--internal-token-file", str(tmp_path / "tok"))
    assert stack.resolve_secrets(args) == ("tok-file", None)   # the key file goes to the gateway as a path
    ctx = {**ctx_for(args), "env": {"U1SERVE_INTERNAL_TOKEN": "tok-file"}, "api_key": None}
    specs = [b(args, ctx) for b in stack.SERVICE_BUILDERS]
    for spec in specs:
        assert not any("sk-file" in a or "tok-file" in a for a in spec.argv), spec.argv
        assert spec.env["U1SERVE_INTERNAL_TOKEN"] == "tok-file"
    assert specs[-1].argv[specs[-1].argv.index("--api-key-file") + 1] == str(tmp_path / "key")
    monkeypatch.setenv("U1SERVE_API_KEY", "sk-env")
    args = up_args("--device", "cpu")
    token, key = stack.resolve_secrets(args)
    assert key == "sk-env" and len(token) == 32            # always an internal token: a random one
    gateway = stack.build_gateway(args, {**ctx_for(args), "api_key": key})
    assert gateway.env["U1SERVE_API_KEY"] == "sk-env" and "--api-key-file" not in gateway.argv
    with pytest.raises(SystemExit):
        stack.resolve_secrets(up_args("--device", "cpu", "--gateway-args", "--api-key sk"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        stack.resolve_secrets(up_args("--device", "cpu", "--api-key-file", str(tmp_path / "empty")))
