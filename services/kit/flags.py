"""Command-line flags generated from a frozen config dataclass, so each setting is declared once: its type and
default on the field, its help (and choices, metavar, a repeatable flag) in the field's metadata. `--help`
shows every default; `from_args` builds the config back from the parsed namespace.

    @dataclass(frozen=True)
    class Config:
        model: str = field(metadata=flag("checkpoint directory"))          # no default: a required flag
        max_jobs: int = field(default=16, metadata=flag("jobs per step"))
        prefix_cache: bool = field(default=True, metadata=flag("the prefix cache"))
        public_docs: bool = field(default=False, metadata=flag("serve /docs"))

    add_flags(parser, Config)   ->   --model (required), --max-jobs N (default: 16), --no-prefix-cache,
                                     --public-docs

A bool field is a switch: default False -> `--name` turns it on; default True -> `--no-name` turns it off;
`Optional[bool]` with default None -> `--name` / `--no-name`, None when neither is given. With `env` (a family
of environment knobs, services/base/knobs.py FlagFamily), each flag's default is its knob's value when set: the
field's own knob (`flag(knob=...)`) or the family's member named after the flag (`flag(env=False)`: none).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar

C = TypeVar("C")


def flag(help: str, *, choices: Optional[Sequence] = None, metavar: Optional[str] = None,
         parse: Optional[Callable[[str], Any]] = None, repeat: bool = False, env: bool = True,
         knob: Any = None) -> dict:
    """A field's flag: `parse` turns one command-line string into the field's value (default: the field's
    type); `repeat`: the flag may be given several times and the field is the tuple of the values; `knob`: the
    environment knob of its default (else, with add_flags' `env`, the family's; `env=False`: none)."""
    return {"flag": {"help": help, "choices": choices, "metavar": metavar, "parse": parse, "repeat": repeat,
                     "env": env, "knob": knob}}


def _base(annotation) -> Any:
    """int of `int`, `Optional[int]`, `int | None` (the field's type without None)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _scalar(annotation) -> Callable[[str], Any]:
    """int / float / str of `int`, `Optional[float]`, `str | None` (the field's type as a parser)."""
    base = _base(annotation)
    return base if base in (int, float, str) else str


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _argument(f: dataclasses.Field, annotation, env: Any) -> tuple[str, dict[str, Any]]:
    """The flag name and argparse settings of a field with a flag."""
    spec = f.metadata["flag"]
    name = "--" + f.name.replace("_", "-")
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    default = None if required else _default(f)
    switch = _base(annotation) is bool
    knob = spec["knob"] or (env.knob(name, bool if switch else _scalar(annotation), default)
                            if env is not None and spec["env"] else None)
    kw: dict[str, Any] = {"dest": f.name, "help": spec["help"]}
    if switch:
        kw["action"] = (argparse.BooleanOptionalAction if f.default is None
                        else "store_false" if f.default else "store_true")
        if f.default is True:
            name = "--no-" + f.name.replace("_", "-")
        kw["default"] = knob.get() if knob is not None else default
        if knob is not None:
            kw["help"] += f" (env {knob.name}=1)" if f.default is False else f" (env {knob.name})"
        return name, kw
    if spec["choices"] is not None:
        kw["choices"] = list(spec["choices"])
    if spec["metavar"] is not None:
        kw["metavar"] = spec["metavar"]
    kw["type"] = spec["parse"] or (str if spec["repeat"] else _scalar(annotation))
    if required:
        kw["required"] = True
    else:
        raw = knob.raw() if knob is not None else None
        kw["default"] = raw if raw is not None else list(default) if spec["repeat"] and default is not None \
            else default
        kw["help"] += " (default: %(default)s)"
    if knob is not None:
        kw["help"] += f" (env {knob.name})"
    if spec["repeat"]:
        kw["action"] = "append"
    return name, kw


def add_flags(parser: argparse.ArgumentParser, cls: type, *, env: Any = None) -> None:
    """One `--field-name` flag per field of `cls` that declares one (`flag(...)` in its metadata)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            name, kw = _argument(f, hints[f.name], env)
            parser.add_argument(name, **kw)


def add_flag_of(parser: argparse.ArgumentParser, cls: type, field: str, *, prefix: str = "", about: str = "",
                **overrides) -> None:
    """The flag of another program's config field, under `--<prefix><field-name>` (the launcher's --gen-sp is the
    generation server's --sp): its type, default, choices and help come from the field, the help led by `about`
    (which program); `overrides` replace argparse settings (a default the launcher resolves itself, a choice it
    adds). The value lands in `args.<prefix><field>`, underscored."""
    f = next(f for f in dataclasses.fields(cls) if f.name == field)
    name, kw = _argument(f, typing.get_type_hints(cls)[field], None)
    kw["dest"] = (prefix + field).replace("-", "_")
    kw["help"] = f"{about}: {kw['help']}" if about else kw["help"]
    kw.update(overrides)
    parser.add_argument("--" + prefix + name[2:], **kw)


def check_choices(config: Any) -> None:
    """ValueError naming the flag for a field whose value is not among its flag's choices (a config's
    `__post_init__` calls it, so a config built in process is checked as a parsed one)."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("flag", {}).get("choices")
        if choices is not None and getattr(config, f.name) not in choices:
            raise ValueError(f"--{f.name.replace('_', '-')} must be one of {', '.join(map(str, choices))}, got "
                             f"{getattr(config, f.name)!r}")


def choices_of(cls: type, field: str) -> tuple:
    """The choices a config field's flag declares."""
    return tuple(next(f for f in dataclasses.fields(cls) if f.name == field).metadata["flag"]["choices"])


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
