"""`graphfuse.json`, graphfuse's record of a checkpoint: a frozen dataclass parsed strictly (every
field typed, no unknown field) and sealed with a CRC-32 of its canonical JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphfuse.errors import CheckpointError, GraphfuseError
from graphfuse.ir.layout import BucketLayout
from graphfuse.ir.state_layout import state_bucket

FORMAT = 2  # 2: adds "optimizer", "save_id" and the record's own "crc32"; format 1 still loads
MODES = ("unbalanced", "balanced")
MAX_ELEMENTS = 2**40  # no real bucket comes near; a larger one is an edited record


@dataclass(frozen=True)
class Record:
    """What graphfuse.json holds (docs/checkpoint-format.md describes each field)."""

    format: int
    mode: str
    world_size: int
    fingerprint: str
    layout: dict
    shards: dict[str, str]  # state shard "bucket<b>.<state>" -> dtype
    aliases: dict[str, str]  # tied FQN -> canonical FQN
    groups: list[list[str]]
    step_groups: list[int]
    steps: list[int]
    param_groups: list[dict]
    files: dict[str, dict[str, int]]  # file name -> {"bytes", "crc32"}
    torch: str
    optimizer: str | None = None  # the optimizer's class name (format 2)
    save_id: str | None = None  # one id per save, also in the marker of its staging directory
    # state shard -> {FQN: shape} where its states are not shaped like their parameters (Adafactor's
    # factors; Program.state_shapes); written only when there are some, so other files read as before
    state_shapes: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        if not body["state_shapes"]:
            del body["state_shapes"]
        return json.dumps({**body, "crc32": _seal(body)}, indent=1)

    def shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """`state_shapes` with tuple shapes, as graphfuse.checkpoint.plan.derive_plan takes them."""
        return {n: {f: tuple(shape) for f, shape in m.items()} for n, m in self.state_shapes.items()}

    def bucket_layout(self) -> BucketLayout:
        return parse_layout(self.layout, self.world_size, self.fingerprint)


def _seal(body: dict) -> int:
    """CRC-32 of the canonical JSON of every field but "crc32" (sorted keys, no spaces)."""
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ---- strict parsing --------------------------------------------------------------------------
class _Bad(Exception):
    pass


def _int(v, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= MAX_ELEMENTS:
        raise _Bad(f"{what} must be an integer in [{lo}, 2^40], got {v!r}")
    return v


def _str(v, what: str) -> str:
    if not isinstance(v, str):
        raise _Bad(f"{what} must be a string, got {v!r}")
    return v


def _list(v, what: str, item) -> list:
    if not isinstance(v, list):
        raise _Bad(f"{what} must be a list, got {type(v).__name__}")
    return [item(x, f"{what}[{i}]") for i, x in enumerate(v)]


def _map(v, what: str, value) -> dict:
    if not isinstance(v, dict):
        raise _Bad(f"{what} must be an object, got {type(v).__name__}")
    return {k: value(x, f"{what}[{k!r}]") for k, x in v.items()}


def _dtype(v, what: str) -> str:
    if not isinstance(v, str) or not isinstance(getattr(torch, v, None), torch.dtype):
        raise _Bad(f"{what} must name a torch dtype, got {v!r}")
    return v


def _choice(v, what: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise _Bad(f"{what} must be one of {choices}, got {v!r}")
    return v


def _hyper(v, what: str):
    """A hyper-parameter value: a JSON scalar or a list of numbers (betas; Adafactor's eps, whose
    first may be null)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise _Bad(f"{what} must be finite, got {v!r}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list) and all(x is None or isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return [_hyper(x, what) for x in v]  # finite, as a scalar must be
    raise _Bad(f"{what} must be a number, bool, string, null or list of numbers (or nulls), got {v!r}")


def _group(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise _Bad(f"{what} must be an object, got {type(v).__name__}")
    g = _map({k: x for k, x in v.items() if k != "params"}, what, _hyper)
    return {**g, "params": _list(v.get("params"), f"{what}['params']", _str)}


def _file(v, what: str) -> dict:
    rec = _map(v, what, lambda x, w: _int(x, w))
    if set(rec) != {"bytes", "crc32"}:
        raise _Bad(f"{what} must hold exactly 'bytes' and 'crc32'")
    return rec


_FIELDS: dict[str, Callable[[object, str], Any]] = {  # field -> its checker, which returns the value
    "format": lambda v, w: _int(v, w, 1),
    "mode": lambda v, w: _choice(v, w, MODES),
    "world_size": lambda v, w: _int(v, w, 1),
    "fingerprint": _str,
    "layout": lambda v, w: _map(v, w, lambda x, _: x),
    "shards": lambda v, w: _map(v, w, _dtype),
    "aliases": lambda v, w: _map(v, w, _str),
    "groups": lambda v, w: _list(v, w, lambda g, wg: _list(g, wg, _str)),
    "step_groups": lambda v, w: _list(v, w, _int),
    "steps": lambda v, w: _list(v, w, _int),
    "param_groups": lambda v, w: _list(v, w, _group),
    "files": lambda v, w: _map(v, w, _file),
    "torch": _str,
    "optimizer": _str,
    "save_id": lambda v, w: None if v is None else _str(v, w),  # None: an in-memory state dict
    "state_shapes": lambda v, w: _map(v, w, lambda m, wm: _map(m, wm, lambda x, wx: _list(x, wx, _int))),
}


def parse(text: str, f: Path) -> Record:
    """The record in `text` (the contents of file `f`), or CheckpointError naming the field."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{f}: not JSON ({e}); the checkpoint is damaged") from None
    return from_dict(d, str(f), sealed=True)


def from_dict(d, where: str, sealed: bool = False) -> Record:
    """A record from its JSON object; `sealed`: the object carries its CRC-32 (format 2 files)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a JSON object; the checkpoint is damaged")
    d = dict(d)
    version = d.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT:
        raise CheckpointError(
            f"{where}: format {version!r} is not one this graphfuse reads (1 to {FORMAT}); upgrade graphfuse"
        )
    crc = d.pop("crc32", None)
    if sealed and version >= 2 and crc != _seal(d):
        raise CheckpointError(
            f"{where}: its CRC-32 does not match its contents (edited or damaged); the checkpoint is damaged"
        )
    names = {fl.name for fl in dataclasses.fields(Record)}
    required = names - {"state_shapes"} - ({"optimizer", "save_id"} if version == 1 else set())
    unknown, missing = sorted(set(d) - names), sorted(required - set(d))
    try:
        if unknown or missing:
            raise _Bad(f"unknown fields {unknown}" if unknown else f"missing fields {missing}")
        record = Record(**{k: _FIELDS[k](v, k) for k, v in d.items()})
        _cross_check(record)
    except _Bad as e:
        raise CheckpointError(f"{where}: {e}; the checkpoint is damaged") from None
    return record


def _cross_check(r: Record) -> None:
    if len(r.steps) != len(r.groups) or len(r.param_groups) != len(r.groups):
        raise _Bad(f"{len(r.groups)} groups, {len(r.steps)} steps and {len(r.param_groups)} param_groups differ")
    if any(g >= len(r.groups) for g in r.step_groups):
        raise _Bad(f"step_groups {r.step_groups} name a group beyond {len(r.groups)}")
    try:
        layout = r.bucket_layout()
    except CheckpointError as e:
        raise _Bad(str(e)) from None
    names = {b.name for b in layout.buckets}
    for shard in r.shards:
        if shard.split(".", 1)[0] not in names or "." not in shard:
            raise _Bad(f"shards names {shard!r}, which is not '<bucket>.<state>' of a bucket in the layout")
    buckets = {b.name: b for b in layout.buckets}
    for shard, shapes in r.shapes().items():
        if shard not in r.shards or not set(shapes) <= set(buckets[shard.split(".", 1)[0]].fqns):
            raise _Bad(f"state_shapes names {shard!r} or parameters that are not in its bucket")
        try:
            state_bucket(buckets[shard.split(".", 1)[0]], shapes)
        except GraphfuseError as e:
            raise _Bad(f"state_shapes of {shard!r}: {e}") from None


def parse_layout(d: dict, world_size: int, fingerprint: str) -> BucketLayout:
    """The bucket layout a record holds, refused unless it is well formed, matches its
    fingerprint, and every parameter lies inside its bucket without overlap."""
    try:
        layout = BucketLayout.from_json(d)
    except (GraphfuseError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"layout is malformed ({type(e).__name__}: {e})") from None
    if layout.world_size != world_size or layout.fingerprint != fingerprint:
        raise CheckpointError(f"layout does not match world_size {world_size} and fingerprint {fingerprint!r}")
    seen: set[str] = set()
    for b in layout.buckets:
        try:
            _int(b.size, f"{b.name} size")
            _dtype(b.dtype, f"{b.name} dtype")
        except _Bad as e:
            raise CheckpointError(f"layout: {e}") from None
        if b.size % world_size:
            raise CheckpointError(f"layout: {b.name} size {b.size} does not split into {world_size} shards")
        end = 0
        for s in b.slots:
            ok = (
                re.fullmatch(r"[^@\s]+", str(s.fqn)) is not None
                and s.fqn not in seen
                and all(isinstance(n, int) and n >= 0 for n in (*s.shape, s.offset, s.numel, s.padded))
                and math.prod(s.shape) == s.numel <= s.padded
                and end <= s.offset
                and s.offset + s.padded <= b.size
            )
            if not ok:
                raise CheckpointError(f"layout: parameter {s.fqn!r} of {b.name} has an impossible place or shape")
            seen.add(s.fqn)
            end = s.offset + s.padded
    return layout


def read(path: Path) -> Record | None:
    """The record of the checkpoint directory `path`, or None for a plain DCP checkpoint."""
    f = path / "graphfuse.json"
    try:
        text = f.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); the checkpoint is damaged") from None
    return parse(text, f)
