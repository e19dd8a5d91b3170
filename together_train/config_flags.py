"""Command-line flags from a config dataclass: one ``--flag`` per field, the field's metadata its help.

Shared by the cookbook's recipes (``together_train_cookbook.cli``) and the server's ``serve`` /
``generator`` commands (``together_train_server.config``), so a setting is declared once, as a
typed field, and its flag, default and help follow.

Field metadata (all optional):
    help: the flag's help text.
    choices: allowed values.
    type: a converter ``str -> value`` (raising ``argparse.ArgumentTypeError`` for a bad value);
        default: the field's type (Optional unwrapped).
    action: ``"store_true"`` (a bool flag without ``--no-x``) or ``"append"`` (a list field, the flag
        given once per item); bools default to ``--x`` / ``--no-x``.
    required: the flag must be given.
    hidden: the flag works but is left out of ``--help`` (settings for tests and launchers).
    aliases: more flag spellings (e.g. ``("--local_rank",)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, TypeVar

__all__ = ["add_flags", "flag", "from_namespace"]

C = TypeVar("C")


def flag(name: str) -> str:
    """``lora_rank`` -> ``--lora-rank``."""
    return "--" + name.replace("_", "-")


def _flag_type(tp: Any) -> tuple[Callable[[str], Any], bool]:
    """(converter, is_bool) of a dataclass field type, unwrapping Optional and list."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    if typing.get_origin(base) is list:
        base = typing.get_args(base)[0]
    if base is bool:
        return (lambda s: s.lower() in ("1", "true", "yes")), True
    return base, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_flags(parser: argparse.ArgumentParser | Any, config_cls: type, *, defaults: bool = True) -> None:
    """Add one flag per field of the dataclass `config_cls` to `parser` (see the module docstring).

    ``defaults=False``: a flag not given sets nothing (``argparse.SUPPRESS``), so a subcommand can accept
    flags its parent parser already set without overwriting them.
    """
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        md = f.metadata
        conv, is_bool = _flag_type(hints[f.name])
        kw: dict[str, Any] = {"default": _default(f) if defaults else argparse.SUPPRESS,
                              "help": argparse.SUPPRESS if md.get("hidden") else md.get("help", "")}
        action = md.get("action")
        if action == "store_true" or (is_bool and action is None):
            kw["action"] = "store_true" if action else argparse.BooleanOptionalAction
        else:
            kw["type"] = md.get("type", conv)
            if action is not None:
                kw["action"] = action
            if md.get("choices") is not None:
                kw["choices"] = list(md["choices"])
        if md.get("required"):
            kw["required"] = True
        parser.add_argument(flag(f.name), *md.get("aliases", ()), dest=f.name, **kw)


def from_namespace(config_cls: type[C], ns: argparse.Namespace) -> C:
    """A `config_cls` instance from parsed flags (`add_flags`); attributes not in the dataclass are ignored."""
    names = [f.name for f in dataclasses.fields(typing.cast(Any, config_cls))]
    return config_cls(**{name: getattr(ns, name) for name in names if hasattr(ns, name)})
