"""Typed settings from plain mappings, with messages that name the key, the value and what is allowed. A leaf
module shared by the config schema and the backends' own settings (quantize options, runtime options)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.infra.errors import ConfigError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not valid: expected {allowed}")


def one_of(key: str, value: Any, allowed: tuple) -> None:
    require(value in allowed, key, value, "one of " + ", ".join(map(str, allowed)))


def positive_int(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value, "a positive integer")


def build_settings(cls, data: Any, key: str):
    """``cls(**data)`` for a dataclass ``cls``; an unknown or missing key fails naming ``key`` and what is known.
    A ``__post_init__`` validates the values (with the helpers above)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key} must be a mapping, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{key} has unknown key(s) {', '.join(unknown)}: expected some of {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:  # a missing required key
        raise ConfigError(f"{key}: {exc}") from None
