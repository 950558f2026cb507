"""Checks of program.json's nested values before anything is built from them: the batch tree
(depth, pytree types), the bucket layout's arithmetic, and the layout against the graph's inputs."""

from __future__ import annotations

import json

import torch
import torch.utils._pytree as pytree

from graphfuse.errors import GraphfuseError
from graphfuse.ir import signature as sig
from graphfuse.ir.layout import FORMAT as LAYOUT_FORMAT
from graphfuse.ir.layout import BucketLayout
from graphfuse.ir.program import Program

from .limits import MAX_DEPTH, MAX_NUMEL
from .values import DEVICE, Malformed, dims, dtype, short

# Containers a batch may be built of; a leaf has type null. Other pytree types are refused.
BATCH_TYPES = ("builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict")
_NODE_KEYS = {"type", "context", "children_spec"}


def batch_spec(spec: str) -> None:
    """Refuse a batch tree (torch's treespec_dumps, protocol 1) that nests deeper than
    MAX_DEPTH or names a type outside BATCH_TYPES, before torch parses it."""
    if spec == "":
        return
    try:
        doc = json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"signature.batch_spec is not JSON ({type(e).__name__})") from None
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] == 1):
        raise Malformed("signature.batch_spec must be [1, <tree>] (torch pytree protocol 1)")
    _tree(doc[1], 0)
    try:
        pytree.treespec_loads(spec)
    except (ValueError, TypeError, KeyError, NotImplementedError) as e:
        raise Malformed(f"signature.batch_spec is not a batch tree: {short(e)}") from None


def _tree(node, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise Malformed(f"signature.batch_spec nests deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict) or set(node) != _NODE_KEYS or not isinstance(node["children_spec"], list):
        raise Malformed(f"signature.batch_spec: invalid tree node {short(node)}")
    kind = node["type"]
    if kind is None:
        if node["children_spec"] or node["context"] is not None:
            raise Malformed("signature.batch_spec: a leaf has no children and no context")
        return
    if kind not in BATCH_TYPES:
        raise Malformed(
            f"signature.batch_spec: unknown pytree type {short(kind)}; a batch is built of {', '.join(BATCH_TYPES)}"
        )
    if not isinstance(node["context"], str):
        raise Malformed("signature.batch_spec: a container's context must be a JSON string")
    for child in node["children_spec"]:
        _tree(child, depth + 1)


def layout(d, world_size: int) -> BucketLayout:
    """The BucketLayout of program.json's `layout`, refused unless its arithmetic holds: each
    bucket's slots lie back to back from 0 and fill `size`, a multiple of the world size."""
    top = {"format", "world_size", "align_bytes", "bucket_bytes", "buckets"}
    if not isinstance(d, dict) or set(d) != top or d["format"] != LAYOUT_FORMAT or not isinstance(d["buckets"], list):
        raise Malformed(f"layout must be an object with exactly {', '.join(sorted(top))} (format {LAYOUT_FORMAT})")
    if d["world_size"] != world_size:
        raise Malformed(f"the layout is for world size {short(d['world_size'])}, the program for {world_size}")
    if not all(type(d[k]) is int and 0 < d[k] <= MAX_NUMEL for k in ("align_bytes", "bucket_bytes")):
        raise Malformed("layout.align_bytes and layout.bucket_bytes must be positive ints")
    fqns: set[str] = set()
    for i, b in enumerate(d["buckets"]):
        _bucket(b, i, world_size, fqns)
    try:
        return BucketLayout.from_json(d)
    except (GraphfuseError, LookupError, TypeError, ValueError) as e:
        raise Malformed(f"invalid layout: {short(e)}") from None


def _bucket(b, i: int, world_size: int, fqns: set[str]) -> None:
    where = f"layout bucket {i}"
    keys = {"dtype", "device", "group", "size", "params"}
    if not isinstance(b, dict) or set(b) != keys or not isinstance(b["params"], list) or not b["params"]:
        raise Malformed(f"{where} must be an object with exactly {', '.join(sorted(keys))} and some params")
    dtype(b["dtype"])
    size = b["size"]
    if (
        not (isinstance(b["device"], str) and DEVICE.match(b["device"]))
        or type(b["group"]) is not int
        or b["group"] < 0
    ):
        raise Malformed(f"{where}: device must be a device type and group a param group index")
    if type(size) is not int or not 0 < size <= MAX_NUMEL or size % world_size:
        raise Malformed(
            f"{where}: size {short(size)} must be a positive multiple of the world size {world_size}, at most 2^48"
        )
    offset = 0
    for p in b["params"]:
        if not (isinstance(p, list) and len(p) == 5 and isinstance(p[0], str) and all(type(x) is int for x in p[2:])):
            raise Malformed(f"{where}: a param must be [fqn, shape, offset, numel, padded], got {short(p)}")
        fqn, shape, at, numel, padded = p
        count = 1
        for n in dims(shape, f"{where} param {short(fqn)} shape"):
            count *= n
        if fqn in fqns or at != offset or numel != count or not numel <= padded:
            raise Malformed(
                f"{where}: param {short(fqn)} (offset {at}, numel {numel}, padded {padded}) does not follow "
                f"the previous one at {offset}, or does not hold its shape, or appears twice"
            )
        fqns.add(fqn)
        offset += padded
    if offset != size:
        raise Malformed(f"{where}: its params fill {offset} elements, but its size is {size}")


def inputs_fit(program: Program) -> None:
    """Every placeholder's recorded shape and dtype is its inputs_meta, and the bucket and
    shard inputs have the sizes and dtypes the layout gives them: checked before any
    tensor is made, so a file cannot make the runtime allocate what its graph does not use."""
    for node, spec in zip(program.placeholders(), program.signature.inputs):
        m, val = program.inputs_meta.get(spec.name), node.meta.get("val")
        if (
            m is not None
            and isinstance(val, torch.Tensor)
            and (tuple(val.shape), val.dtype) != (m.shape, dtype(m.dtype))
        ):
            raise Malformed(
                f"the placeholders do not match the signature's inputs: input {spec.name}: the graph records "
                f"{tuple(val.shape)} {val.dtype}, inputs_meta {m.shape} {m.dtype}"
            )
    layout, names = program.layout, set(program.signature.names(sig.BUCKET))
    if layout is None:
        if names or program.signature.names(sig.SHARD):
            raise Malformed("the program has bucket inputs but no bucket layout")
        return
    buckets = {b.name for b in layout.buckets}
    if names and names != buckets:
        raise Malformed(f"the bucket inputs {sorted(names)} are not the layout's {len(layout.buckets)} buckets")
    for name in program.signature.names(sig.SHARD):
        if name.split(".", 1)[0] not in buckets:
            raise Malformed(f"shard input {name} belongs to no bucket of the layout")
    for b in layout.buckets:
        shard_dtypes = {b.dtype, "float32"}  # a state shard is the bucket's dtype, or fp32 masters and moments
        for name in program.signature.names(sig.SHARD):
            if name.split(".", 1)[0] == b.name:  # a state not shaped like its parameter has a layout of its own
                _fits(program, name, (program.state_layout(b, name.split(".", 1)[1]).shard_size,), shard_dtypes)
        if b.name in names:
            _fits(program, b.name, (b.size,), {b.dtype})


def _fits(program: Program, name: str, shape: tuple[int, ...], dtypes: set[str]) -> None:
    m = program.inputs_meta.get(name)
    if m is None or m.shape != shape or m.dtype not in dtypes:
        raise Malformed(
            f"input {name} is {None if m is None else (m.shape, m.dtype)}, but the bucket layout gives it "
            f"shape {shape} and dtype {' or '.join(sorted(dtypes))}"
        )
