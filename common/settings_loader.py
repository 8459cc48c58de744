"""The one settings loader of the router and the workers: a frozen settings dataclass filled
from defaults < YAML file (``--config`` / ``BULKHEAD_CONFIG``) < environment ``BULKHEAD_<FIELD>``
< command-line flags ``--field-name``.

A YAML file is either flat (setting -> value) or a whole deployment with sections ``router:``,
``worker:``, ``prefill:`` and ``decode:``; each process reads its own sections, later ones
winning, and ignores the others. Every field documents itself (``metadata={"doc": ...}``): the
flags' help and the README tables come from it, and the limits ``check_limits`` enforces
(``doc(text, choices=..., at_least=..., above=...)``). Field kinds understood: str, int, float, bool
(``--x / --no-x``, env ``1/0/true/false/yes/no/on/off``) and ``tuple[str, ...]`` (env and flag
values are comma lists; a flag may repeat).

Torch-free and network-free: ``bulkhead --help`` and the launcher import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

ENV_PREFIX = "BULKHEAD_"
SECTIONS = ("router", "worker", "prefill", "decode")
S = TypeVar("S")


class SettingsError(ValueError):
    """A setting has a value we cannot use; the message names the setting and the limit."""


def doc(text: str, *, choices: tuple[Any, ...] = (), at_least: float | None = None,
        above: float | None = None) -> dict[str, Any]:
    """A field's ``metadata``: its documentation and, for ``check_limits``, the values it
    allows (``choices``) or its lower bound (``at_least`` / strictly ``above``)."""
    limits = {"choices": choices, "at_least": at_least, "above": above}
    return {"doc": text, **{k: v for k, v in limits.items() if v or v == 0}}


def check_limits(settings: object) -> None:
    """Refuse a field of the dataclass ``settings`` outside the limits its ``doc`` metadata
    names, with an error naming the field and the limit."""
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise SettingsError(f"{f.name}: {value!r} is not one of "
                                f"{', '.join(str(c) for c in choices)}")
        if "at_least" in f.metadata and value < f.metadata["at_least"]:
            raise SettingsError(f"{f.name}: {value} must be >= {f.metadata['at_least']}")
        if "above" in f.metadata and value <= f.metadata["above"]:
            raise SettingsError(f"{f.name}: {value} must be > {f.metadata['above']}")


def field_kinds(cls: type) -> dict[str, type]:
    """Field name -> str, int, float, bool or tuple."""
    hints = typing.get_type_hints(cls)
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None: read as X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        out[f.name] = typing.get_origin(kind) or kind
    return out


def coerce(cls: type, name: str, value: Any) -> Any:  # noqa: ANN401 - a setting's value
    """``value`` (a string from env/flags or a YAML scalar/list) as field ``name``'s kind."""
    kind = field_kinds(cls)[name]
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is tuple:
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            return tuple(str(v) for v in value)
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name}: cannot read {value!r} as {kind.__name__}") from exc


def read_yaml(cls: type, path: str, sections: Sequence[str], what: str) -> dict[str, Any]:
    """The values of ``sections`` (merged in order) of the YAML file, or of the whole file when
    it has no section at all; unknown keys are refused naming ``what`` settings."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"config: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config: {path} must hold a mapping of setting -> value")
    if any(name in data for name in SECTIONS):
        values: dict[str, Any] = {}
        for name in sections:
            section = data.get(name) or {}
            if not isinstance(section, dict):
                raise SettingsError(f"config: section {name!r} of {path} must be a mapping")
            values.update(section)
    else:
        values = data
    unknown = sorted(set(values) - set(field_kinds(cls)))
    if unknown:
        raise SettingsError(f"config: unknown {what} settings in {path}: {', '.join(unknown)}")
    return {k: coerce(cls, k, v) for k, v in values.items()}


def build_parser(cls: type, prog: str, description: str, fixed: Sequence[str] = (),
                 aliases: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """A flag per field of ``cls`` but those in ``fixed``; each defaults to None so an unset
    flag overrides nothing. ``aliases``: field -> an extra flag name."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None,
                        help=f"YAML file of settings (env: {ENV_PREFIX}CONFIG; default: none).")
    kinds = field_kinds(cls)
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            continue
        flags = ["--" + f.name.replace("_", "-")]
        if aliases and f.name in aliases:
            flags.append(aliases[f.name])
        help_text = (f"{f.metadata['doc']} (env: {ENV_PREFIX}{f.name.upper()}; "
                     f"default: {f.default!r})")
        if kinds[f.name] is bool:
            parser.add_argument(*flags, dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        elif kinds[f.name] is tuple:  # `--x A --x B` or `--x A,B`
            parser.add_argument(*flags, dest=f.name, default=None, action="append",
                                help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=help_text)
    return parser


def load(cls: type[S], parser: argparse.ArgumentParser, argv: Sequence[str] | None,
         env: Mapping[str, str] | None, sections: Sequence[str], what: str,
         fixed: Mapping[str, Any] | None = None) -> S:
    """Defaults < YAML < environment < flags; ``fixed`` values (e.g. the role a subcommand
    sets) win over all of them."""
    env = os.environ if env is None else env
    fixed = dict(fixed or {})
    args = parser.parse_args(list(argv) if argv is not None else [])
    values: dict[str, Any] = {}
    config_path = args.config or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(read_yaml(cls, config_path, sections, what))
    names = [name for name in field_kinds(cls) if name not in fixed]
    for name in names:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values[name] = coerce(cls, name, raw)
    for name in names:
        raw = getattr(args, name, None)
        if raw is None:
            continue
        if isinstance(raw, list):
            raw = ",".join(raw)
        values[name] = coerce(cls, name, raw)
    return cls(**values, **fixed)


def settings_table(cls: type, fixed: Sequence[str] = ()) -> str:
    """Markdown table of every setting of ``cls`` but those in ``fixed`` (for the README)."""
    rows = ["| setting | env | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            continue
        text = f.metadata["doc"].replace("|", "\\|")  # a literal | would split the cell
        rows.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | "
                    f"`--{f.name.replace('_', '-')}` | `{f.default!r}` | {text} |")
    return "\n".join(rows)
