"""The command lines of the three services and `u1serve up` as data: each flag's option strings, default, choices,
action, type and whether it is required (`python -m tests.structure.flag_sets` prints them as JSON). test_flag_sets.py
compares them with the lists written before the flags were generated from the configs (data/flag_sets.json),
so a reshaping of the flag mechanism changes no name, default or choice."""
from __future__ import annotations

import argparse
import importlib
import json

PARSERS = {
    "understanding": ("services.understanding.server", "build_parser"),
    "generation": ("services.generation.server", "build_parser"),
    "gateway": ("services.gateway.config", "build_arg_parser"),
}


def _up_parser() -> argparse.ArgumentParser:
    from services.launch.cli import add_up
    sub = argparse.ArgumentParser().add_subparsers()
    add_up(sub)
    return sub.choices["up"]


def describe(parser: argparse.ArgumentParser) -> dict:
    out = {}
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        default, action = a.default, type(a).__name__
        if action == "_StoreFalseAction":     # `--no-x` storing False into x is the command line of a store_true
            default, action = not default, "_StoreTrueAction"
        out[a.option_strings[-1]] = {
            "options": sorted(a.option_strings), "default": default if default is None or isinstance(
                default, (int, float, str, bool)) else repr(default),
            "choices": list(a.choices) if a.choices is not None else None,
            "action": action, "required": a.required, "nargs": a.nargs,
            "type": getattr(a.type, "__name__", None) or ("str" if a.nargs != 0 else None)}   # None parses as str
    return out


def flag_sets() -> dict:
    sets = {name: describe(getattr(importlib.import_module(mod), fn)()) for name, (mod, fn) in PARSERS.items()}
    sets["up"] = describe(_up_parser())
    return sets


if __name__ == "__main__":
    print(json.dumps(flag_sets(), indent=1, sort_keys=True))
