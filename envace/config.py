"""One config dataclass per command: it is the CLI (flags generated from its fields), it loads
from YAML, and it validates itself in `validate()` before any work starts.

Precedence: dataclass defaults < `--config FILE.yaml` < command-line flags.

A field whose type is itself a config dataclass (`TrainConfig.rollout: RolloutConfig`) nests
that config: its fields become flat options of the command (`--max-turns`, `max_turns:` in
YAML) with the command's own defaults (the field's default_factory), and YAML may also give
them as a section (`rollout: {max_turns: 4}`). A command hides nested fields that it decides
itself (`field(hidden={"mode": "why"})`): they are neither flags nor accepted options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A bad configuration, reported before any work starts."""


def field(default: Any = dataclasses.MISSING, help: str = "", choices: Callable[[], Sequence[str]] | None = None,
          hidden: Mapping[str, str] | None = None, **kw: Any) -> Any:
    """A dataclass field with CLI help text. `choices` returns the allowed values (read when the
    parser is built, so a registry's names are current). `hidden` (on a nested config) names the
    nested fields the command decides itself, each with the reason given when someone sets it."""
    metadata = {"help": help, "choices": choices, "hidden": dict(hidden or {})}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


@dataclasses.dataclass(frozen=True)
class Option:
    """One flat option of a command: a field of its config, or of a config nested in it."""

    name: str
    section: str | None  # the nested field that holds it; None for the command's own fields
    field: dataclasses.Field
    type: Any
    default: Any


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _sections(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of `cls` that nest a config dataclass, by name."""
    hints = typing.get_type_hints(cls)
    return {f.name: f for f in dataclasses.fields(cls) if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


def options(cls: type) -> dict[str, Option]:
    """Every option of command config `cls` by its flat name, in declaration order."""
    hints, sections = typing.get_type_hints(cls), _sections(cls)
    found: list[Option] = []
    for f in dataclasses.fields(cls):
        if f.name not in sections:
            found.append(Option(f.name, None, f, hints[f.name], _default(f)))
            continue
        nested_type, nested_default = hints[f.name], _default(f)
        nested_hints = typing.get_type_hints(nested_type)
        found += [Option(sub.name, f.name, sub, nested_hints[sub.name], getattr(nested_default, sub.name))
                  for sub in dataclasses.fields(nested_type) if sub.name not in f.metadata.get("hidden", {})]
    by_name = {o.name: o for o in found}
    if len(by_name) < len(found):
        clashes = sorted({o.name for o in found if sum(p.name == o.name for p in found) > 1})
        raise TypeError(f"{cls.__name__}: options {', '.join(clashes)} are declared twice (flat flags need unique names)")
    return by_name


def _hidden(cls: type) -> dict[str, str]:
    """Nested fields the command decides itself -> why they are not options."""
    return {name: why for f in _sections(cls).values() for name, why in f.metadata.get("hidden", {}).items()}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per option; a nested config's flags form their own group in --help.
    Defaults are left unset so YAML values are not overridden."""
    parser.add_argument("--config", dest="config_file", default=None, help="YAML file with any of these options")
    groups = {name: parser.add_argument_group(f"{name} options", f.metadata.get("help") or None) for name, f in _sections(cls).items()}
    for opt in options(cls).values():
        _add_flag(groups.get(opt.section, parser), opt)


def _add_flag(parser: Any, opt: Option) -> None:
    tp, _ = _unwrap_optional(opt.type)
    kw: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": f"{opt.field.metadata.get('help', '')} (default: {opt.default})"}
    choices = opt.field.metadata.get("choices")
    if tp is bool:
        parser.add_argument(_flag(opt.name), action=argparse.BooleanOptionalAction, **kw)
    elif get_origin(tp) is Literal or choices:
        parser.add_argument(_flag(opt.name), choices=list(choices() if choices else get_args(tp)), **kw)
    elif get_origin(tp) is list:
        (item,) = get_args(tp)
        parser.add_argument(_flag(opt.name), nargs="+", type=item, **kw)
    elif tp in (int, float, str):
        parser.add_argument(_flag(opt.name), type=tp, **kw)
    else:
        parser.add_argument(_flag(opt.name), type=json.loads, **{**kw, "help": kw["help"] + " [JSON]"})


def _check_type(cls: type, opt: Option, value: Any) -> Any:
    name = opt.name
    tp, optional = _unwrap_optional(opt.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{cls.__name__}.{name} must not be empty")
    choices = opt.field.metadata.get("choices")
    allowed = list(choices()) if choices else list(get_args(tp)) if get_origin(tp) is Literal else None
    if allowed is not None:
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not one of {allowed}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {tp.__name__}, got {value!r}")
    if get_origin(tp) is list and not isinstance(value, list):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return value


def flatten(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (YAML or keywords) with each nested section (`rollout: {max_turns: 4}`) lifted to
    flat option names, so both forms load; unknown and hidden keys are rejected by name."""
    opts, hidden, sections = options(cls), _hidden(cls), _sections(cls)
    flat: dict[str, Any] = {}

    def add(name: str, section: str | None, value: Any) -> None:
        given = f"{section}.{name}" if section else name
        if name not in opts or (section is not None and opts[name].section != section):
            if name in hidden:
                raise ConfigError(f"{given} is not an option of {cls.__name__}: {hidden[name]}")
            known = sorted(n for n, o in opts.items() if section is None or o.section == section)
            raise ConfigError(f"unknown option {given} for {cls.__name__}; known{f' in {section}' if section else ''}: {', '.join(known)}")
        if name in flat:
            raise ConfigError(f"{name} is given twice (flat and in its {opts[name].section} section)")
        flat[name] = value

    for key, value in values.items():
        if key not in sections:
            add(key, None, value)
        elif isinstance(value, Mapping):
            for name, v in value.items():
                add(name, key, v)
        else:
            raise ConfigError(f"{key} must be a mapping of its options ({key}: {{option: value}}), got {value!r}")
    return flat


def build(cls: type[C], values: Mapping[str, Any]) -> C:
    """Construct and validate a config from option values (flat, or with nested sections)."""
    opts = options(cls)
    checked = {name: _check_type(cls, opts[name], v) for name, v in flatten(cls, values).items()}
    kwargs = {name: v for name, v in checked.items() if opts[name].section is None}
    for section, f in _sections(cls).items():
        given = {name: v for name, v in checked.items() if opts[name].section == section}
        kwargs[section] = dataclasses.replace(_default(f), **given)
    cfg = cls(**kwargs)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def from_namespace(cls: type[C], ns: argparse.Namespace) -> C:
    values: dict[str, Any] = {}
    config_file = getattr(ns, "config_file", None)
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of option: value")
        values = flatten(cls, loaded)
    known = options(cls)
    values.update({k: v for k, v in vars(ns).items() if k in known})
    return build(cls, values)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config's options, flat (the names of the flags): what a run's config.yaml holds."""
    def owner(opt: Option) -> Any:
        return getattr(cfg, opt.section) if opt.section else cfg

    return {name: getattr(owner(opt), name) for name, opt in options(type(cfg)).items()}


def run_dir(output_dir: str | None, prefix: str) -> Path:
    """The command's output folder: the given one, else runs/<prefix>-<time>; created."""
    path = Path(output_dir) if output_dir else Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(cfg: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
