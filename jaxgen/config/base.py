"""What every config section shares: `ConfigError`, the checks, and building frozen dataclasses from
YAML data with dotted overrides (`model.num_layers=4`), each value checked against its field's type.
A `Literal` field's allowed values are its annotation: `check_literals` holds any section to them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key or value that jaxgen cannot use."""


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


@functools.cache
def literal_fields(cls) -> dict[str, tuple]:
    """{field name: its allowed values} of the `Literal`-typed fields of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}  # fmt: skip


def check_literals(obj, section: str) -> None:
    """Every `Literal` field of `obj` holds one of its allowed values (ConfigError naming the key, the
    value and what is allowed): the one check for all of them, read from the annotations."""
    for name, allowed in literal_fields(type(obj)).items():
        value = getattr(obj, name)
        check(value in allowed, f"{section}.{name}", value, ", ".join(map(str, allowed)))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks and converts one YAML/CLI value to the field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        check(value in args, key, value, ", ".join(map(str, args)))
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        check(isinstance(value, list | tuple), key, value, "a list")
        return tuple(coerce(v, args[0], key) for v in value)
    if dataclasses.is_dataclass(tp):
        check(isinstance(value, dict), key, value, "a mapping of " + ", ".join(field_names(tp)))
        return build(tp, value, key + ".")
    if tp is bool:
        check(isinstance(value, bool), key, value, "true or false")
        return value
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        check(isinstance(value, int | float) and not isinstance(value, bool), key, value, "a number")
        return float(value)
    if tp is str:
        check(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def build(cls, data: dict, prefix: str = ""):
    hints = _known(cls, data, prefix)
    kwargs = {k: coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def check_types(cls, data: dict, prefix: str = "") -> None:
    """Every key of `data` known and every value of its field's type, without building `cls`: for a layer of
    settings (a file) whose values a later layer (an override) may replace; a bad value is an error anyway."""
    hints = _known(cls, data, prefix)
    for key, value in data.items():
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            check_types(hints[key], value, prefix + key + ".")
        else:
            coerce(value, hints[key], prefix + key)


def _known(cls, data: dict, prefix: str) -> dict:
    """The type hints of `cls`; ConfigError naming the first key of `data` that is not one of its fields."""
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; allowed keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(field_names(cls))}"
        )
    return hints


def _parse_scalar(text: str, item: str) -> Any:
    """A CLI value is read as YAML, so `4`, `1e-3`, `true`, `null` and `[a, b]` all work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r} is not a YAML value ({yaml_problem(e)})") from None


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies `a.b=value` strings to a nested dict (copied)."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. model.num_layers=4)")
        key, text = item.split("=", 1)
        set_key(data, key.strip(), _parse_scalar(text, item), item)
    return data


def set_key(data: dict, key: str, value: Any, item: str) -> None:
    """Sets dotted `key` in the nested dict `data` (in place); `item` names the setting in errors."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _deep_copy(data: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


SHIPPED = Path(__file__).parents[2] / "configs"  # the repository's configs/


def read_yaml(path: str | Path) -> dict:
    """A YAML file's mapping; a relative `configs/X.yaml` that is not under the working folder is the shipped
    one (the command lines' defaults name them so, and work from any folder)."""
    path = Path(path)
    relative = not path.is_absolute() and path.parts[:1] == ("configs",)
    if relative and not path.exists() and (SHIPPED.parent / path).exists():
        path = SHIPPED.parent / path
    if not path.exists():
        shipped = sorted(p.name for p in SHIPPED.glob("*.yaml"))
        raise ConfigError(f"config file {str(path)!r} does not exist; shipped configs: {', '.join(shipped)}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def plain(value):
    """Tuples as lists, all the way down: what YAML writes."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value
