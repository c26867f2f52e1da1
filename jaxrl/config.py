"""Typed configs: YAML/JSON files -> nested frozen dataclasses, with ``key=value`` overrides.

Any frozen dataclass whose fields carry type annotations can be loaded:

    cfg = load_config(TrainConfig, "configs/demo.yaml", ["optimizer.lr=1e-4", "rollout.group_size=8"])

Every key is checked against the dataclass: an unknown key is a ``ConfigError``
naming the dotted key and the keys allowed there; a value of the wrong type
names the key, the value, and the expected type (or the allowed values of a
``Literal``/``Enum``). Values of overrides are parsed as YAML scalars
(``8`` -> int, ``1e-4`` -> float, ``true`` -> bool, ``[1, 2]`` -> list), so
the command line and the file follow the same rules. A float that is NaN or
infinite is refused wherever it appears. The dataclasses' own
``__post_init__`` validation runs on construction; its ``ValueError`` is
re-raised with the dotted path of the section it came from.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import sys
import types
import typing
from typing import Any, Mapping, Sequence, TypeVar

from jaxrl.errors import needs_extra

T = TypeVar("T")


def _yaml():
    # Imported when a file or an override is parsed, so that from_dict (the losses' typed configs
    # included) works on the base install, which has no PyYAML.
    with needs_extra("reading a config file or key=value override"):
        import yaml
    return yaml


class ConfigError(ValueError):
    """A config file or override that does not match the typed config."""


class FieldError(ValueError):
    """A section's ``key`` holds a ``value`` it must not (it must be ``expected``); raised by a
    section's ``__post_init__``, re-raised by :func:`from_dict` under the key's dotted path, so a
    section nested in another (``critic.optimizer``) is named where it is."""

    def __init__(self, section: str, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{section}.{key}={value!r} must be {expected}")


# A config holds hundreds of values; YAML aliases can make a few lines stand for billions of them
# ("billion laughs"), which the deep copy of apply_overrides would then build in memory.
MAX_CONFIG_VALUES = 100_000
# Integers cross into numpy and JAX as int64: a larger one fails there with an OverflowError.
_INT_RANGE = (-(2**63), 2**63 - 1)


@functools.cache
def _strict_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one
    silently, so a typo'd second ``lr:`` would win without a word)."""
    yaml = _yaml()

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges keys that the mapping itself may override
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ConfigError(f"key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1}"
                                      f"); keep one of them")
                seen.add(key)
            return super().construct_mapping(node, deep)

    return StrictLoader


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"key {key!r} appears twice in one object; keep one of them")
    return dict(pairs)


def _check_expanded_size(value, what: str) -> None:
    """Refuses ``value`` when, with every alias written out, it holds more than MAX_CONFIG_VALUES
    values, or when an alias holds itself; each shared object is counted once, so the check
    itself stays small."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(v) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        if id(v) in open_:
            raise ConfigError(f"{what}: an alias refers to the mapping or list that holds it (`&a [*a]`), "
                              f"which no value can be; write the value out")
        if id(v) not in sizes:
            open_.add(id(v))
            sizes[id(v)] = 1 + sum(size(c) for c in ([*v.keys(), *v.values()] if isinstance(v, dict) else v))
            open_.discard(id(v))
        return sizes[id(v)]

    if size(value) > MAX_CONFIG_VALUES:
        raise ConfigError(f"{what}: its aliases expand to more than {MAX_CONFIG_VALUES:,} values (a config needs "
                          f"hundreds); write the repeated parts out or use fewer nested aliases")


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(tp, value, key: str):
    """Converts a YAML/JSON value to annotation ``tp``; raises ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1:  # `X | None` given a value: X's own error says what is wrong with it
            return _convert(others[0], value, key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} matches none of {_type_name(tp)} ({'; '.join(errors)})")
    if origin is typing.Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {list(args)}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed values: {[m.value for m in tp]}"
            ) from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (tuple, list, Sequence, typing.Sequence) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list for {_type_name(tp)}, got {value!r}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items for {_type_name(tp)}, got {value!r}")
            items = [_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return list(items) if origin is list or tp is list else tuple(items)
    if origin in (dict, Mapping, typing.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for {_type_name(tp)}, got {value!r}")
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, f"{key}.<key>"): _convert(val_tp, v, f"{key}.{k}") for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise ConfigError(f"{key}: {value} is outside the 64-bit integer range [-2**63, 2**63 - 1]; "
                                  f"give a smaller number")
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            # A NaN learning rate trains to all-NaN weights without an error; no setting needs inf.
            raise ConfigError(f"{key}: {value!r} is not a finite number; give a finite value")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Builds dataclass ``cls`` from a nested mapping, checking every key and type.

    Missing keys take the dataclass defaults; a missing key without a default is an
    error naming it. ``prefix`` is the dotted path of this section (for messages).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    where = f"{prefix}." if prefix else ""
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown key {where}{unknown[0]!s} in section {prefix or '<top>'} ({cls.__name__}); "
            f"allowed keys: {sorted(fields)}"
        )
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], f"{where}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key {where}{name} in section {prefix or '<top>'} ({cls.__name__})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except FieldError as e:
        raise ConfigError(f"section {prefix or '<top>'} ({cls.__name__}): {where}{e.key}={e.value!r} must be "
                          f"{e.expected}") from e
    except (ValueError, TypeError) as e:
        raise ConfigError(f"section {prefix or '<top>'} ({cls.__name__}): {e}") from e


def to_dict(config) -> dict:
    """The plain nested dict of a config dataclass (enums as values, tuples as lists)."""

    def plain(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def read_config_file(path: str | os.PathLike) -> dict:
    """Reads a YAML (``.yaml``/``.yml``) or JSON (``.json``) config file into a dict."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist; pass the path of a .yaml or .json file")
    with open(path) as f:
        text = f.read()
    yaml = _yaml()
    try:
        if path.endswith(".json"):
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            data = yaml.load(text, Loader=_strict_loader())  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"config file {path!r}: {e}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            f"config file {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}"
        ) from e
    _check_expanded_size(data, f"config file {path!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Returns a copy of ``data`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    data = json.loads(json.dumps(data))  # Deep copy of plain data.
    yaml = _yaml()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment in {dotted!r}")
        try:
            value = yaml.load(raw, Loader=_strict_loader()) if raw.strip() else ""  # noqa: S506
        except ConfigError as e:
            raise ConfigError(f"override {dotted}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value {raw!r} is not valid YAML: {e}") from e
        _check_expanded_size(value, f"override {dotted}")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Loads ``cls`` from a YAML/JSON file (or its defaults when ``path`` is None) plus overrides.

    The file's folder joins the end of ``sys.path``, so a module the config names ("my_rewards:score"
    for a ``kind: python`` reward, an env factory) may sit beside it, as a user's first task does;
    reward workers get the same ``sys.path``."""
    data = read_config_file(path) if path is not None else {}
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:
            sys.path.append(folder)
    return from_dict(cls, apply_overrides(data, overrides))
