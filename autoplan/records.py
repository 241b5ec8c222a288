"""Exact JSON round-trip for the frozen records that flow between stages.

Every record is a frozen dataclass whose fields are JSON-able: ``int``,
``float``, ``str``, ``bool``, ``None``, enums, tuples, ``dict[str, ...]`` and
other records.  :func:`to_dict` / :func:`from_dict` convert losslessly;
:func:`from_dict` rejects missing and unknown keys and ill-typed values with
the path of the offending field (:class:`~autoplan.errors.RecordError`).

Examples
--------
>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Point:
...     x_m: float
...     tags: tuple[str, ...] = ()
>>> from_json(Point, to_json(Point(1.5, ("a",)))) == Point(1.5, ("a",))
True
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import tempfile
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar

from .errors import RecordError

__all__ = ["to_dict", "from_dict", "to_json", "from_json", "atomic_write_text",
           "atomic_write_bytes", "Record"]

T = TypeVar("T")


class Record:
    """Mixin giving a frozen dataclass ``to_dict``/``to_json``/``from_dict``/``from_json``."""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        return to_json(self, indent=indent)

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        return from_dict(cls, data)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return from_json(cls, text)


#: Field metadata of a record field that is carried in memory but never written or read
#: (a plan's runners-up, the graph it was made from): ``field(..., metadata=TRANSIENT)``.
TRANSIENT = {"transient": True}


def _stored_fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if not f.metadata.get("transient")]


def to_dict(obj: Any) -> Any:
    """Convert a record (recursively) to plain JSON-able Python values (transient fields,
    :data:`TRANSIENT`, are left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _stored_fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        raise RecordError(f"non-finite float {obj!r} cannot be written to JSON")
    return obj


def to_json(obj: Any, *, indent: int | None = 1) -> str:
    """Serialize a record to JSON text (stable key order, exact floats)."""
    return json.dumps(to_dict(obj), indent=indent, allow_nan=False) + ("\n" if indent else "")


def from_json(cls: type[T], text: str) -> T:
    """Parse JSON text into ``cls``, validating every field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"not valid JSON ({exc}); expected a {cls.__name__} record") from None
    return from_dict(cls, data)


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build ``cls`` from plain values; raise :class:`RecordError` naming the bad field."""
    return _convert(cls, data, path or cls.__name__)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except RecordError as exc:
                errors.append(str(exc))
        raise RecordError(f"expected {_type_name(tp)}, got {value!r}", path)
    if origin is typing.Literal:
        if value not in args:
            raise RecordError(f"expected one of {list(args)}, got {value!r}", path)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecordError(f"expected an object ({tp.__name__}), got {type(value).__name__}", path)
        hints = _hints(tp)
        fields = {f.name: f for f in _stored_fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise RecordError(f"unknown key(s) {unknown}; expected keys {sorted(fields)}", path)
        kwargs = {}
        for name, field in fields.items():
            if name not in value:
                no_default = (field.default is dataclasses.MISSING
                              and field.default_factory is dataclasses.MISSING)
                if no_default:
                    raise RecordError(f"missing key {name!r} ({_type_name(hints[name])})", path)
                continue
            kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}")
        try:
            return tp(**kwargs)
        except RecordError:
            raise
        except (TypeError, ValueError) as exc:
            raise RecordError(str(exc), path) from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise RecordError(
                f"expected one of {[m.value for m in tp]}, got {value!r}", path) from None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise RecordError(f"expected a list, got {type(value).__name__}", path)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise RecordError(f"expected {len(args)} items, got {len(value)}", path)
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, typing.Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise RecordError(f"expected an object, got {type(value).__name__}", path)
        vt = args[1] if args else Any
        return {str(k): _convert(vt, v, f"{path}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"expected a number, got {value!r}", path)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"expected an integer, got {value!r}", path)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise RecordError(f"expected true/false, got {value!r}", path)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecordError(f"expected a string, got {value!r}", path)
        return value
    if tp is type(None):
        if value is not None:
            raise RecordError(f"expected null, got {value!r}", path)
        return None
    raise RecordError(f"unsupported field type {_type_name(tp)}", path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)       # as a plain open() would create it
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and an atomic rename."""
    atomic_write_bytes(path, text.encode("utf-8"))
