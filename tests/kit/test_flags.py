"""kit.flags: a config dataclass's fields are its flags (type, default, choices, help declared once), bool fields
are switches, an environment knob family gives defaults, another program's field is a flag under a prefix, and a
config checks its choices itself."""
import argparse
from dataclasses import dataclass, field
from typing import Optional

import pytest

from services import knobs
from services.kit import flags
from services.kit.flags import flag


@dataclass(frozen=True)
class Demo:
    model: str = field(metadata=flag("checkpoint"))
    jobs: int = field(default=16, metadata=flag("jobs per step"))
    mode: str = field(default="a", metadata=flag("mode", choices=("a", "b")))
    cache: bool = field(default=True, metadata=flag("the cache, on unless this flag is given"))
    docs: bool = field(default=False, metadata=flag("serve /docs"))
    salt: Optional[bool] = field(default=None, metadata=flag("salt (unset: decided later)"))
    tags: tuple[str, ...] = field(default=(), metadata=flag("a tag (repeatable)", repeat=True, env=False))
    internal: str = ""                      # no flag

    def __post_init__(self):
        flags.check_choices(self)


def _parser(env=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    flags.add_flags(p, Demo, env=env)
    return p


def test_fields_are_flags():
    cfg = flags.from_args(Demo, _parser().parse_args(["--model", "m"]))
    assert cfg == Demo(model="m")
    cfg = flags.from_args(Demo, _parser().parse_args(
        ["--model", "m", "--jobs", "3", "--mode", "b", "--no-cache", "--docs", "--no-salt", "--tags", "x",
         "--tags", "y"]))
    assert cfg == Demo(model="m", jobs=3, mode="b", cache=False, docs=True, salt=False, tags=("x", "y"))
    assert "(default: 16)" in " ".join(_parser().format_help().split())
    with pytest.raises(SystemExit):
        _parser().parse_args([])                            # --model is required


def test_env_family_gives_defaults(monkeypatch):
    family = knobs.FlagFamily("U1SERVE_<FLAG>", "test", "test")
    monkeypatch.setenv("U1SERVE_JOBS", "5")
    monkeypatch.setenv("U1SERVE_DOCS", "1")
    monkeypatch.setenv("U1SERVE_TAGS", "ignored")           # env=False: no knob
    cfg = flags.from_args(Demo, _parser(family).parse_args(["--model", "m"]))
    assert (cfg.jobs, cfg.docs, cfg.tags) == (5, True, ())
    assert set(family.members) == {"U1SERVE_MODEL", "U1SERVE_JOBS", "U1SERVE_MODE", "U1SERVE_CACHE",
                                   "U1SERVE_DOCS", "U1SERVE_SALT"}


def test_flag_of_another_programs_field():
    p = argparse.ArgumentParser()
    flags.add_flag_of(p, Demo, "jobs", prefix="gen-", about="generation")
    flags.add_flag_of(p, Demo, "mode", prefix="gen-", about="generation", default=None)
    assert vars(p.parse_args([])) == {"gen_jobs": 16, "gen_mode": None}
    assert p.parse_args(["--gen-mode", "b"]).gen_mode == "b"
    with pytest.raises(SystemExit):
        p.parse_args(["--gen-mode", "c"])                    # the field's choices
    assert "generation: jobs per step" in " ".join(p.format_help().split())
    assert flags.choices_of(Demo, "mode") == ("a", "b")


def test_in_process_config_checks_its_choices():
    with pytest.raises(ValueError, match="--mode must be one of a, b"):
        Demo(model="m", mode="c")
