"""kit.flags: a config dataclass's fields are its flags (type, default, choices, help declared once), bool fields
are switches, an environment knob family gives defaults, another program's field is a flag under a prefix, and a
config checks its choices itself. (The fields borrow gateway flag names, whose U1SERVE_* knobs are declared.)"""
import argparse
from dataclasses import dataclass, field
from typing import Optional

import pytest

from services.base import knobs
from services.kit import flags
from services.kit.flags import flag


@dataclass(frozen=True)
class Demo:
    model_name: str = field(metadata=flag("a name"))
    max_steps: int = field(default=16, metadata=flag("steps"))
    log_level: str = field(default="info", metadata=flag("log level", choices=("info", "debug")))
    public_metrics: bool = field(default=True, metadata=flag("on unless this flag is given"))
    public_docs: bool = field(default=False, metadata=flag("serve /docs"))
    enable_rl: Optional[bool] = field(default=None, metadata=flag("unset: decided later"))
    route_body_mb: tuple[str, ...] = field(default=(), metadata=flag("repeatable", repeat=True, env=False))
    internal: str = ""                      # no flag

    def __post_init__(self):
        flags.check_choices(self)


def _parser(env=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    flags.add_flags(p, Demo, env=env)
    return p


def test_fields_are_flags():
    cfg = flags.from_args(Demo, _parser().parse_args(["--model-name", "m"]))
    assert cfg == Demo(model_name="m")
    cfg = flags.from_args(Demo, _parser().parse_args(
        ["--model-name", "m", "--max-steps", "3", "--log-level", "debug", "--no-public-metrics", "--public-docs",
         "--no-enable-rl", "--route-body-mb", "x", "--route-body-mb", "y"]))
    assert cfg == Demo(model_name="m", max_steps=3, log_level="debug", public_metrics=False, public_docs=True,
                       enable_rl=False, route_body_mb=("x", "y"))
    assert "(default: 16)" in " ".join(_parser().format_help().split())
    with pytest.raises(SystemExit):
        _parser().parse_args([])                            # --model-name is required


def test_env_family_gives_defaults(monkeypatch):
    family = knobs.FlagFamily("U1SERVE_<FLAG>", "test", "test")
    monkeypatch.setenv("U1SERVE_MAX_STEPS", "5")
    monkeypatch.setenv("U1SERVE_PUBLIC_DOCS", "1")
    cfg = flags.from_args(Demo, _parser(family).parse_args(["--model-name", "m"]))
    assert (cfg.max_steps, cfg.public_docs, cfg.route_body_mb) == (5, True, ())
    assert set(family.members) == {"U1SERVE_MODEL_NAME", "U1SERVE_MAX_STEPS", "U1SERVE_LOG_LEVEL",
                                   "U1SERVE_PUBLIC_METRICS", "U1SERVE_PUBLIC_DOCS", "U1SERVE_ENABLE_RL"}


def test_flag_of_another_programs_field():
    p = argparse.ArgumentParser()
    flags.add_flag_of(p, Demo, "max_steps", prefix="gen-", about="generation")
    flags.add_flag_of(p, Demo, "log_level", prefix="gen-", about="generation", default=None)
    assert vars(p.parse_args([])) == {"gen_max_steps": 16, "gen_log_level": None}
    assert p.parse_args(["--gen-log-level", "debug"]).gen_log_level == "debug"
    with pytest.raises(SystemExit):
        p.parse_args(["--gen-log-level", "loud"])            # the field's choices
    assert "generation: steps" in " ".join(p.format_help().split())
    assert flags.choices_of(Demo, "log_level") == ("info", "debug")


def test_in_process_config_checks_its_choices():
    with pytest.raises(ValueError, match="--log-level must be one of info, debug"):
        Demo(model_name="m", log_level="loud")
