"""Typed reading of a Hugging Face JSON file: each number and flag is checked for its type and range as it
is read, and a bad one is an HFError naming the file, the key, the value and what is allowed.

config.json is written by hand and by tools of many versions: strings, nulls, booleans and lists turn up
where numbers go, and a value that reached the model unchecked failed later, inside a traced function,
naming nothing (or gave NaN without failing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

INT32_MAX = 2**31 - 1  # token ids and positions are int32 on the device
_REQUIRED = object()


class HFError(ValueError):
    """A Hugging Face folder (or a jaxgen model) that cannot be converted; the message says why."""


def read_object(path: Path) -> dict:
    """A JSON file holding an object, or HFError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{path}: holds a JSON {type(data).__name__}, expected an object of settings")
    return data


class Fields:
    """The entries of one JSON object (`where` names the file, `prefix` the enclosing key), read typed.
    A null counts as absent: the default applies (transformers writes nulls for unset options)."""

    def __init__(self, data: dict, where: str, prefix: str = ""):
        self.data, self.where, self.prefix = data, where, prefix

    def error(self, key: str, value: Any, allowed: str) -> HFError:
        return HFError(f"{self.where}: {self.prefix}{key}={value!r} is not allowed: {allowed}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any, allowed: str) -> Any:
        value = self.data.get(key)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise HFError(f"{self.where}: {self.prefix}{key} is missing or null; it is required: {allowed}")
        return default

    def integer(self, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = INT32_MAX) -> Any:
        """An integer in [lo, hi] (a whole float such as 4.0 is refused too: a tool wrote it wrong)."""
        allowed = f"an integer in [{lo}, {hi}]"
        value = self.raw(key, default, allowed)
        if value is not default and not (_is_int(value) and lo <= value <= hi):
            raise self.error(key, value, allowed)
        return value

    def number(self, key: str, default: Any = _REQUIRED, lo: float = 0.0, closed: bool = False) -> Any:
        """A finite number > lo (>= lo when `closed`), as a float."""
        allowed = f"a finite number {'>=' if closed else '>'} {lo}"
        value = self.raw(key, default, allowed)
        if value is default:
            return value
        if not (_is_number(value) and math.isfinite(value) and (value >= lo if closed else value > lo)):
            raise self.error(key, value, allowed)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default, "true or false")
        if not isinstance(value, bool):
            raise self.error(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.raw(key, default, "a string")
        if value is not default and not isinstance(value, str):
            raise self.error(key, value, "a string")
        return value

    def section(self, key: str) -> Fields:
        """The object under `key` (absent or null: an empty one)."""
        value = self.raw(key, {}, "an object")
        if not isinstance(value, dict):
            raise self.error(key, value, 'an object (e.g. {"rope_type": "linear", "factor": 2.0})')
        return Fields(value, self.where, f"{self.prefix}{key}.")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
