"""Registries for pluggable parts (environments, rewards, advantage estimators).

A name resolves to a registered entry, or, when it contains a colon, to an attribute of an
importable module (`mypkg.worlds:Library`), so users extend envace without editing it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    pass


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            return _import_attr(name, self.kind)
        raise RegistryError(
            f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or '(none)'}; "
            f"or give 'module.path:Name' to load your own"
        )

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _import_attr(spec: str, kind: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module {module_name!r} for {kind} {spec!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"module {module_name!r} has no attribute {attr!r} (for {kind} {spec!r})") from None
