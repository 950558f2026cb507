"""The value codec of graph.json: every argument and meta value is a JSON object with one key
naming its type; decoding checks types, nesting and tensor limits and makes fake tensors."""

from __future__ import annotations

import json
import math
import re

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse.errors import UnsupportedError

from .limits import MAX_DEPTH, MAX_NDIM, MAX_NUMEL

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
DEVICE = re.compile(r"[a-z_]{1,32}(:[0-9]{1,4})?\Z")


class Malformed(Exception):
    """A defect found while decoding; the loader turns it into a ProgramFormatError naming the file."""


def short(obj) -> str:
    """`obj` as at most 80 characters of JSON (or of its message), for error messages."""
    try:
        text = str(obj) if isinstance(obj, BaseException) else json.dumps(obj)
    except (TypeError, ValueError, RecursionError):
        text = type(obj).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def enum_name(value) -> str:
    return str(value).removeprefix("torch.")


def encode(value, where: str) -> dict:
    """One argument or meta value as a JSON object with exactly one key naming its type."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, torch.Tensor):  # only meta values: shape, stride, dtype and device
        return {
            "tensor": {
                "shape": list(value.shape),
                "stride": list(value.stride()),
                "dtype": enum_name(value.dtype),
                "device": str(value.device),
            }
        }
    if value is None:
        return {"none": None}
    if type(value) in (bool, int, str):
        return {type(value).__name__: value}
    if type(value) is float:
        return {"float": value if math.isfinite(value) else repr(value)}  # "inf", "-inf", "nan"
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [encode(v, where) for v in value]}
    for cls, kind in ((torch.dtype, "dtype"), (torch.memory_format, "memory_format"), (torch.layout, "layout")):
        if isinstance(value, cls):
            return {kind: enum_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise UnsupportedError(
        f"cannot save {where}: a value of type {type(value).__qualname__} has no program-file encoding"
    )


def torch_enum(name, cls: type, what: str):
    value = getattr(torch, name, None) if isinstance(name, str) and IDENT.match(name) else None
    if not isinstance(value, cls):
        raise Malformed(f"{short(name)} is not a {what}")
    return value


def dtype(name) -> torch.dtype:
    return torch_enum(name, torch.dtype, "torch dtype")


def device(v) -> torch.device:
    if not isinstance(v, str) or not DEVICE.match(v):
        raise Malformed(f"invalid device {short(v)}")
    try:
        return torch.device(v)
    except RuntimeError as e:
        raise Malformed(f"invalid device {v!r}: {e}") from None


def dims(value, what: str, ndim: int | None = None) -> tuple[int, ...]:
    """A list of sizes (or strides): non-negative ints, at most MAX_NDIM of them, each and
    their product within MAX_NUMEL (so nothing later computes with absurd numbers)."""
    if not isinstance(value, list) or len(value) > MAX_NDIM or ndim is not None and len(value) != ndim:
        raise Malformed(f"{what} must be a list of at most {MAX_NDIM} sizes, got {short(value)}")
    numel = 1
    for d in value:
        if type(d) is not int or not 0 <= d <= MAX_NUMEL:
            raise Malformed(f"{what} {short(value)}: every size must be an int in [0, 2^48]")
        numel *= d
    if numel > MAX_NUMEL:
        raise Malformed(f"{what} {short(value)} has {numel} elements, more than the limit 2^48")
    return tuple(value)


class Decoder:
    """Decodes the values of one graph; a node reference must name a node defined earlier."""

    def __init__(self) -> None:
        self.nodes: dict[str, torch.fx.Node] = {}
        self.fake_mode = FakeTensorMode()

    def value(self, obj, meta: bool = False, depth: int = 0):
        if depth > MAX_DEPTH:
            raise Malformed(f"values nest deeper than {MAX_DEPTH} levels")
        if not isinstance(obj, dict) or len(obj) != 1:
            raise Malformed(f"a value must be an object with one key, got {short(obj)}")
        ((kind, v),) = obj.items()
        if kind in ("list", "tuple") and isinstance(v, list):
            items = [self.value(x, meta, depth + 1) for x in v]
            return items if kind == "list" else tuple(items)
        if kind == "node" and not meta:
            if not isinstance(v, str) or v not in self.nodes:
                raise Malformed(f"reference to node {short(v)}, which is not defined before it")
            return self.nodes[v]
        if kind == "tensor" and meta:
            return self.fake(v)
        return _scalar(kind, v, obj, meta)

    def fake(self, t) -> torch.Tensor:
        if not isinstance(t, dict) or set(t) != {"shape", "stride", "dtype", "device"}:
            raise Malformed(f"invalid tensor meta {short(t)}")
        shape = dims(t["shape"], "tensor shape")
        stride = dims(t["stride"], "tensor stride", ndim=len(shape))
        span = sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
        if span > MAX_NUMEL:
            raise Malformed(f"tensor meta {short(t)} spans more than 2^48 elements")
        with self.fake_mode:
            return torch.empty_strided(shape, stride, dtype=dtype(t["dtype"]), device=device(t["device"]))


def _scalar(kind: str, v, obj, meta: bool):
    if kind == "none" and v is None:
        return None
    if kind in ("bool", "int", "str") and type(v).__name__ == kind:
        return v
    if kind == "float" and (type(v) in (int, float) or v in ("inf", "-inf", "nan")):
        return float(v)
    if kind == "dtype":
        return dtype(v)
    if kind == "memory_format":
        return torch_enum(v, torch.memory_format, "torch memory format")
    if kind == "layout":
        return torch_enum(v, torch.layout, "torch layout")
    if kind == "device":
        return device(v)
    raise Malformed(f"invalid {'meta ' if meta else ''}value {short(obj)}")
