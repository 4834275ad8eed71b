"""Command-line flags generated from a frozen config dataclass, so each setting is declared once: its type and
default on the field, its help (and choices, metavar, a repeatable flag) in the field's metadata. `--help`
shows every default; `from_args` builds the config back from the parsed namespace.

    @dataclass(frozen=True)
    class Config:
        model: str = field(metadata=flag("checkpoint directory"))          # no default: a required flag
        max_jobs: int = field(default=16, metadata=flag("jobs per step"))

    add_flags(parser, Config)   ->   --model (required), --max-jobs N (default: 16)
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar

C = TypeVar("C")


def flag(help: str, *, choices: Optional[Sequence] = None, metavar: Optional[str] = None,
         parse: Optional[Callable[[str], Any]] = None, repeat: bool = False) -> dict:
    """A field's flag: `parse` turns one command-line string into the field's value (default: the field's
    type); `repeat`: the flag may be given several times and the field is the tuple of the values."""
    return {"flag": {"help": help, "choices": choices, "metavar": metavar, "parse": parse, "repeat": repeat}}


def _scalar(annotation) -> Callable[[str], Any]:
    """int / float / str of `int`, `Optional[float]`, `str | None` (the field's type as a parser)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    return base if base in (int, float, str) else str


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field of `cls` that declares one (`flag(...)` in its metadata)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": spec["help"]}
        if spec["choices"] is not None:
            kw["choices"] = list(spec["choices"])
        if spec["metavar"] is not None:
            kw["metavar"] = spec["metavar"]
        kw["type"] = spec["parse"] or (str if spec["repeat"] else _scalar(hints[f.name]))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kw["default"] = list(default) if spec["repeat"] else default
            kw["help"] += " (default: %(default)s)"
        if spec["repeat"]:
            kw["action"] = "append"
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def from_args(cls: type[C], args: argparse.Namespace, **overrides) -> C:
    """The config of the parsed flags (a repeated flag's list as a tuple); `overrides` replace fields (values
    resolved after parsing, or fields without a flag)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**{**values, **overrides})
