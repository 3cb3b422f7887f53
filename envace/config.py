"""One config dataclass per command: it is the CLI (flags generated from its fields), it loads
from YAML, and it validates itself in `validate()` before any work starts.

Precedence: dataclass defaults < `--config FILE.yaml` < command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A bad configuration, reported before any work starts."""


def field(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field with CLI help text."""
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field. Defaults are left unset so YAML values are not overridden."""
    hints = typing.get_type_hints(cls)
    parser.add_argument("--config", dest="config_file", default=None, help="YAML file with any of these options")
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {default})"}
        if tp is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
        elif get_origin(tp) is Literal:
            parser.add_argument(_flag(f.name), choices=list(get_args(tp)), **kw)
        elif get_origin(tp) is list:
            (item,) = get_args(tp)
            parser.add_argument(_flag(f.name), nargs="+", type=item, **kw)
        elif tp in (int, float, str):
            parser.add_argument(_flag(f.name), type=tp, **kw)
        else:
            parser.add_argument(_flag(f.name), type=json.loads, **{**kw, "help": kw["help"] + " [JSON]"})


def _check_type(cls: type, name: str, value: Any, tp: Any) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{cls.__name__}.{name} must not be empty")
    if get_origin(tp) is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{name}={value!r} is not one of {list(get_args(tp))}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {tp.__name__}, got {value!r}")
    if get_origin(tp) is list and not isinstance(value, list):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return value


def build(cls: type[C], values: dict[str, Any]) -> C:
    """Construct and validate a config from a flat dict, rejecting unknown keys by name."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown option(s) for {cls.__name__}: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    checked = {k: _check_type(cls, k, v, hints[k]) for k, v in values.items()}
    cfg = cls(**checked)
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
        values.update(loaded)
    values.update({k: v for k, v in vars(ns).items() if k != "config_file" and k in {f.name for f in dataclasses.fields(cls)}})
    return build(cls, values)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def run_dir(output_dir: str | None, prefix: str) -> Path:
    """The command's output folder: the given one, else runs/<prefix>-<time>; created."""
    path = Path(output_dir) if output_dir else Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(cfg: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
