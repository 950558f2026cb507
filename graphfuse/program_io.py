"""Program files: a rewritten per-rank `Program` saved as plain JSON (graph and metadata) and
safetensors (constants), and loaded back without running any code from the file.

The format is described in docs/program-format.md; `FORMAT_VERSION` is its version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import keyword
import math
import operator
import os
import re
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse import signature as sig
from graphfuse.errors import GraphfuseError, ProgramFormatError, UnsupportedError
from graphfuse.layout import BucketLayout
from graphfuse.optim import GroupSpec, OptimSpec
from graphfuse.program import PassRun, Program, TensorMeta
from graphfuse.strategy import Strategy

FORMAT_NAME = "graphfuse-program"
FORMAT_VERSION = 1
MANIFEST, PROGRAM, GRAPH, CONSTANTS = "manifest.json", "program.json", "graph.json", "constants.safetensors"
FILES = (PROGRAM, GRAPH, CONSTANTS)  # what a manifest may list; manifest.json lists the others

# Call targets a loaded graph may name: operator overloads of these namespaces, and these
# Python functions. Nothing else is ever looked up.
OP_NAMESPACES = ("aten", "prims", "_c10d_functional")
BUILTINS: dict[str, Any] = {"operator.getitem": operator.getitem}

_KNOWN_FIELDS = ("graph_module", "signature", "optim", "inputs_meta", "strategy", "layout", "passes", "world_size", "rank", "group_name", "handoffs")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


class _Malformed(Exception):
    """Raised while decoding; load_program turns it into a ProgramFormatError naming the file."""


# ---- values --------------------------------------------------------------------------


def _enum_name(value) -> str:
    return str(value).removeprefix("torch.")


def _encode(value, where: str) -> dict:
    """One argument or meta value as a JSON object with exactly one key naming its type."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, torch.Tensor):  # only meta values: shape, stride, dtype and device
        return {"tensor": {"shape": list(value.shape), "stride": list(value.stride()), "dtype": _enum_name(value.dtype), "device": str(value.device)}}
    if value is None:
        return {"none": None}
    if type(value) is bool:
        return {"bool": value}
    if type(value) is int:
        return {"int": value}
    if type(value) is float:
        return {"float": value if math.isfinite(value) else repr(value)}  # "inf", "-inf", "nan"
    if type(value) is str:
        return {"str": value}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode(v, where) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": _enum_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": _enum_name(value)}
    if isinstance(value, torch.layout):
        return {"layout": _enum_name(value)}
    raise UnsupportedError(f"cannot save {where}: a value of type {type(value).__qualname__} has no program-file encoding")


def _torch_enum(name, cls: type, what: str):
    value = getattr(torch, name, None) if isinstance(name, str) and _IDENT.match(name) else None
    if not isinstance(value, cls):
        raise _Malformed(f"{name!r} is not a {what}")
    return value


def _dtype(name) -> torch.dtype:
    return _torch_enum(name, torch.dtype, "torch dtype")


class _Decoder:
    """Decodes values of one graph; node references must name a node defined earlier."""

    def __init__(self) -> None:
        self.nodes: dict[str, torch.fx.Node] = {}
        self.fake_mode = FakeTensorMode()

    def value(self, obj, meta: bool = False):
        if not isinstance(obj, dict) or len(obj) != 1:
            raise _Malformed(f"a value must be an object with one key, got {_short(obj)}")
        ((kind, v),) = obj.items()
        if kind == "node" and not meta:
            if v not in self.nodes:
                raise _Malformed(f"reference to node {v!r}, which is not defined before it")
            return self.nodes[v]
        if kind == "tensor" and meta:
            return self._fake(v)
        if kind in ("list", "tuple") and isinstance(v, list):
            items = [self.value(x, meta) for x in v]
            return items if kind == "list" else tuple(items)
        if kind == "none" and v is None:
            return None
        if kind == "bool" and type(v) is bool:
            return v
        if kind == "int" and type(v) is int:
            return v
        if kind == "float":
            if type(v) in (int, float):
                return float(v)
            if v in ("inf", "-inf", "nan"):
                return float(v)
        if kind == "str" and type(v) is str:
            return v
        if kind == "dtype":
            return _dtype(v)
        if kind == "memory_format":
            return _torch_enum(v, torch.memory_format, "torch memory format")
        if kind == "layout":
            return _torch_enum(v, torch.layout, "torch layout")
        if kind == "device" and type(v) is str:
            return self._device(v)
        raise _Malformed(f"invalid {'meta ' if meta else ''}value {_short(obj)}")

    @staticmethod
    def _device(v: str) -> torch.device:
        if not re.fullmatch(r"[a-z_]+(:[0-9]+)?", v):
            raise _Malformed(f"invalid device {v!r}")
        try:
            return torch.device(v)
        except RuntimeError as e:
            raise _Malformed(f"invalid device {v!r}: {e}") from None

    def _fake(self, t) -> torch.Tensor:
        if not isinstance(t, dict) or set(t) != {"shape", "stride", "dtype", "device"}:
            raise _Malformed(f"invalid tensor meta {_short(t)}")
        shape, stride = t["shape"], t["stride"]
        for dims in (shape, stride):
            if not (isinstance(dims, list) and all(type(d) is int and d >= 0 for d in dims)) or len(dims) != len(shape):
                raise _Malformed(f"invalid tensor meta {_short(t)}")
        with self.fake_mode:
            return torch.empty_strided(shape, stride, dtype=_dtype(t["dtype"]), device=self._device(t["device"]))


def _short(obj) -> str:
    text = json.dumps(obj) if not isinstance(obj, Exception) else str(obj)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- targets -------------------------------------------------------------------------


def target_name(target) -> str | None:
    """The qualified name a program file uses for a call target, or None if it has none."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace in OP_NAMESPACES:
        return str(target)  # "aten.add.Tensor"
    for name, fn in BUILTINS.items():
        if target is fn:
            return name
    return None


def resolve_target(name) -> Any:
    """The call target named `name`, looked up only in the allowlist (no import, no eval)."""
    if isinstance(name, str) and name in BUILTINS:
        return BUILTINS[name]
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] not in OP_NAMESPACES or not all(_IDENT.match(p) and not p.startswith("__") for p in parts):
        raise _Malformed(
            f"unknown operator {name!r}: a program file may call only operators of {', '.join(OP_NAMESPACES)} "
            f"and {', '.join(BUILTINS)}"
        )
    namespace, packet, overload = parts
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        op = None
    if not isinstance(op, torch._ops.OpOverload) or str(op) != name:
        raise _Malformed(f"unknown operator {name!r}: this torch ({torch.__version__}) has no such operator overload")
    return op


# ---- graph ---------------------------------------------------------------------------


def _graph_to_json(gm: torch.fx.GraphModule) -> tuple[list[dict], dict[str, torch.Tensor]]:
    nodes, constants = [], {}
    for n in gm.graph.nodes:
        where = f"node {n.name}"
        if n.op == "call_function":
            target = target_name(n.target)
            if target is None:
                raise UnsupportedError(
                    f"cannot save {where}: it calls {n.target!r}; a program file holds only operators of "
                    f"{', '.join(OP_NAMESPACES)} and {', '.join(BUILTINS)}"
                )
        elif n.op in ("placeholder", "output"):
            target = n.target
        elif n.op == "get_attr":
            value = operator.attrgetter(n.target)(gm)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedError(f"cannot save {where}: get_attr {n.target} is a {type(value).__qualname__}, not a tensor")
            constants[n.target] = value.detach().cpu().contiguous().clone()
            target = n.target
        else:
            raise UnsupportedError(f"cannot save {where}: {n.op} nodes are not supported; a program graph is aten-level")
        meta = {}
        if "phase" in n.meta:
            meta["phase"] = n.meta["phase"]
        if "gf_input" in n.meta:
            meta["gf_input"] = [n.meta["gf_input"].role, n.meta["gf_input"].name]
        if "val" in n.meta:
            meta["val"] = _encode(n.meta["val"], f"{where} meta['val']")
        nodes.append({
            "name": n.name,
            "op": n.op,
            "target": target,
            "args": [_encode(a, where) for a in n.args],
            "kwargs": {k: _encode(v, where) for k, v in n.kwargs.items()},
            "meta": meta,
        })
    return nodes, constants


def _check_target_identifier(target, what: str) -> None:
    # Placeholder and get_attr targets are written into the generated Python code as they are.
    parts = target.split(".") if isinstance(target, str) else [None]
    if not all(isinstance(p, str) and p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise _Malformed(f"{what} target {_short(target)} is not a Python identifier")


def _graph_from_json(nodes, constants: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    if not isinstance(nodes, list):
        raise _Malformed("'nodes' must be a list")
    graph, dec, attrs = torch.fx.Graph(), _Decoder(), {}
    for i, rec in enumerate(nodes):
        if not isinstance(rec, dict) or set(rec) != {"name", "op", "target", "args", "kwargs", "meta"}:
            raise _Malformed(f"node record {i} must have exactly name, op, target, args, kwargs and meta")
        name, op, target = rec["name"], rec["op"], rec["target"]
        where = f"node {i} ({_short(name)})"
        if not isinstance(name, str) or not isinstance(rec["args"], list) or not isinstance(rec["kwargs"], dict):
            raise _Malformed(f"{where}: name must be a string, args a list and kwargs an object")
        try:
            args = tuple(dec.value(a) for a in rec["args"])
            kwargs = {k: dec.value(v) for k, v in rec["kwargs"].items()}
            for k in kwargs:  # FX writes `name=value` into the generated code
                if not k.isidentifier() or keyword.iskeyword(k):
                    raise _Malformed(f"keyword argument name {_short(k)} is not a Python identifier")
            if op == "call_function":
                target = resolve_target(target)
            elif op in ("placeholder", "get_attr"):
                _check_target_identifier(target, op)
                if op == "placeholder" and (args or kwargs):
                    raise _Malformed("a placeholder takes no arguments")
                if op == "get_attr":
                    if target not in constants:
                        raise _Malformed(f"get_attr {target} has no tensor in {CONSTANTS}")
                    attrs[target] = constants[target]
            elif op == "output":
                if target != "output" or len(args) != 1 or kwargs:
                    raise _Malformed("the output node takes one argument")
            else:
                raise _Malformed(f"unsupported node op {_short(op)}")
            node = graph.create_node(op, target, args, kwargs, name=name)
            if node.name != name:
                raise _Malformed(f"node name {name!r} is not a valid unique identifier (FX renamed it {node.name!r})")
            node.meta.update(_meta_from_json(rec["meta"], dec))
        except _Malformed as e:
            raise _Malformed(f"{where}: {e}") from None
        dec.nodes[name] = node
    if not nodes or nodes[-1].get("op") != "output" or sum(r["op"] == "output" for r in nodes) != 1:
        raise _Malformed("the graph must end with its one output node")
    try:
        graph.lint()
    except RuntimeError as e:
        raise _Malformed(f"the graph is not well formed: {e}") from None
    try:
        return torch.fx.GraphModule(attrs, graph, class_name="GraphfuseProgram")
    except (RuntimeError, SyntaxError, TypeError, ValueError) as e:
        raise _Malformed(f"FX cannot generate code for the graph ({type(e).__name__}: {_short(e)})") from None


def _meta_from_json(meta, dec: _Decoder) -> dict:
    if not isinstance(meta, dict) or not set(meta) <= {"phase", "gf_input", "val"}:
        raise _Malformed(f"invalid meta {_short(meta)}")
    out = {}
    if "phase" in meta:
        if meta["phase"] not in (sig.FORWARD, sig.BACKWARD, sig.OPTIMIZER, sig.COMM):
            raise _Malformed(f"unknown phase {_short(meta['phase'])}")
        out["phase"] = meta["phase"]
    if "gf_input" in meta:
        role, name = _pair(meta["gf_input"], "gf_input")
        if role not in sig.INPUT_ROLES:
            raise _Malformed(f"unknown input role {role!r}")
        out["gf_input"] = sig.InputSpec(role, name)
    if "val" in meta:
        out["val"] = dec.value(meta["val"], meta=True)
    return out


def _pair(v, what: str) -> tuple[str, str]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)):
        raise _Malformed(f"{what} must be [role, name], got {_short(v)}")
    return v[0], v[1]


# ---- program metadata ----------------------------------------------------------------


def _extra_fields() -> list[str]:
    """Program fields added after this module was written (e.g. a checkpoint `state_plan`)."""
    return [f.name for f in dataclasses.fields(Program) if f.name not in _KNOWN_FIELDS]


def _extra_to_json(name: str, value) -> dict | None:
    if value is None:
        return None
    cls = type(value)
    if hasattr(value, "to_json"):
        data = value.to_json()
    elif dataclasses.is_dataclass(value):
        data = dataclasses.asdict(value)
    else:
        raise UnsupportedError(f"cannot save Program.{name}: a {cls.__qualname__} is neither a dataclass nor has to_json()")
    if not cls.__module__.startswith("graphfuse."):
        raise UnsupportedError(f"cannot save Program.{name}: its type {cls.__module__}.{cls.__qualname__} is not a graphfuse class")
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedError(f"cannot save Program.{name}: it does not serialise to JSON ({e})") from None
    return {"type": f"{cls.__module__}:{cls.__qualname__}", "value": data}


def _extra_from_json(name: str, rec) -> Any:
    if rec is None:
        return None
    if not isinstance(rec, dict) or set(rec) != {"type", "value"} or not isinstance(rec["type"], str):
        raise _Malformed(f"extra field {name} must be {{type, value}}")
    module_name, _, qualname = rec["type"].partition(":")
    # Only graphfuse's own, already-imported dataclasses: the file cannot make us import anything.
    module = sys.modules.get(module_name) if module_name.startswith("graphfuse.") else None
    cls = getattr(module, qualname, None) if module is not None and _IDENT.match(qualname) else None
    if cls is None or not isinstance(cls, type) or not (hasattr(cls, "from_json") or dataclasses.is_dataclass(cls)):
        raise _Malformed(f"extra field {name}: unknown type {rec['type']!r}")
    if hasattr(cls, "from_json"):
        return cls.from_json(rec["value"])
    return _from_plain(cls, rec["value"])


def _from_plain(tp, data):
    """Rebuild a value of type `tp` from `dataclasses.asdict`-style JSON."""
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        if not isinstance(data, dict) or set(data) - set(hints):
            raise _Malformed(f"{tp.__qualname__}: unexpected fields {_short(data)}")
        return tp(**{k: _from_plain(hints[k], v) for k, v in data.items()})
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in targs:
            return None
        return _from_plain(next(a for a in targs if a is not type(None)), data)
    if origin is tuple:
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(_from_plain(targs[0], x) for x in data)
        return tuple(_from_plain(a, x) for a, x in zip(targs, data, strict=True))
    if origin is list:
        return [_from_plain(targs[0], x) for x in data]
    if origin is dict:
        return {k: _from_plain(targs[1], v) for k, v in data.items()}
    if tp in (int, str, bool) and type(data) is not tp or tp is float and type(data) not in (int, float):
        raise _Malformed(f"expected a {tp.__name__}, got {_short(data)}")
    return data


def _program_to_json(program: Program) -> dict:
    layout = program.layout
    return {
        "signature": program.signature.to_json(),
        "optim": {"cls_name": program.optim.cls_name, "groups": [dataclasses.asdict(g) for g in program.optim.groups]},
        "inputs_meta": {name: m.to_json() for name, m in program.inputs_meta.items()},
        "strategy": program.strategy.to_json(),
        "layout": None if layout is None else layout.to_json(),
        "layout_fingerprint": None if layout is None else layout.fingerprint,
        "passes": list(program.pass_names),
        "world_size": program.world_size,
        "rank": program.rank,
        "group_name": program.group_name,
        "extra": {name: _extra_to_json(name, getattr(program, name)) for name in _extra_fields()},
    }


def _program_from_json(d, gm: torch.fx.GraphModule) -> Program:
    if not isinstance(d, dict):
        raise _Malformed("the top level must be an object")
    signature = sig.Signature.from_json(d["signature"])
    for s in signature.inputs:
        if s.role not in sig.INPUT_ROLES:
            raise _Malformed(f"input {s.name!r} has unknown role {s.role!r}")
    for what, mapping in (("grads", signature.grads), ("aliases", signature.aliases)):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise _Malformed(f"signature.{what} must map strings to strings")
    if not isinstance(signature.batch_spec, str):
        raise _Malformed("signature.batch_spec must be a string")
    if signature.batch_spec:
        torch.utils._pytree.treespec_loads(signature.batch_spec)  # raises on a malformed spec
    if d["optim"]["cls_name"] not in ("AdamW", "Adam", "SGD"):
        raise _Malformed(f"unknown optimizer {_short(d['optim']['cls_name'])}")
    groups = []
    for g in d["optim"]["groups"]:
        groups.append(GroupSpec(**{**g, "params": tuple(g["params"])}))
    optim = OptimSpec(d["optim"]["cls_name"], tuple(groups))
    inputs_meta = {}
    for name, m in d["inputs_meta"].items():
        meta = TensorMeta.from_json(m)
        _dtype(meta.dtype)
        if not all(type(x) is int and x >= 0 for x in meta.shape):
            raise _Malformed(f"inputs_meta[{name!r}] has an invalid shape")
        inputs_meta[name] = meta
    strategy = d["strategy"]
    if strategy.get("master_dtype") is not None:
        _dtype(strategy["master_dtype"])
    layout = None
    if d["layout"] is not None:
        layout = BucketLayout.from_json(d["layout"])
        for b in layout.buckets:
            _dtype(b.dtype)
        if layout.fingerprint != d["layout_fingerprint"]:
            raise _Malformed(f"layout fingerprint {layout.fingerprint} is not the recorded {d['layout_fingerprint']}")
    world_size, rank, group_name, passes = d["world_size"], d["rank"], d["group_name"], d["passes"]
    if type(world_size) is not int or type(rank) is not int or not 0 <= rank < world_size:
        raise _Malformed(f"rank {rank!r} of world size {world_size!r} is not a rank of that world")
    if not isinstance(group_name, str) or not (isinstance(passes, list) and all(isinstance(p, str) for p in passes)):
        raise _Malformed("group_name must be a string and passes a list of strings")
    if layout is None and signature.names(sig.BUCKET) or layout is not None and layout.world_size != world_size:
        raise _Malformed(f"the bucket layout does not fit the program (world size {world_size}, {len(signature.names(sig.BUCKET))} buckets)")
    extra = d.get("extra", {})
    if not isinstance(extra, dict):
        raise _Malformed("extra must be an object")
    fields = dict(
        graph_module=gm,
        signature=signature,
        optim=optim,
        inputs_meta=inputs_meta,
        strategy=Strategy.from_json(strategy),
        layout=layout,
        passes=tuple(PassRun(p) for p in passes),
        world_size=world_size,
        rank=rank,
        group_name=group_name,
    )
    for name in _extra_fields():
        if name in extra:
            fields[name] = _extra_from_json(name, extra[name])
    return Program(**fields)


# ---- files ---------------------------------------------------------------------------


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, allow_nan=False, ensure_ascii=False) + "\n").encode()


def _graph_bytes(nodes: list[dict]) -> bytes:
    # One node per line: readable, and a diff of two programs is a diff of their nodes.
    body = ",\n".join(json.dumps(n, allow_nan=False, ensure_ascii=False) for n in nodes)
    return ('{"nodes": [\n' + body + "\n]}\n").encode()


def save_program(program: Program, path: str | os.PathLike) -> None:
    """Write `program` to the directory `path` (replaced atomically if it holds a program)."""
    from graphfuse import __version__

    path = Path(path)
    nodes, constants = _graph_to_json(program.graph_module)
    files = {PROGRAM: _json_bytes(_program_to_json(program)), GRAPH: _graph_bytes(nodes)}
    if constants:
        from safetensors.torch import save

        files[CONSTANTS] = save(constants)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "torch_version": torch.__version__,
        "graphfuse_version": __version__,
        "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()},
    }
    files[MANIFEST] = _json_bytes(manifest)
    if path.exists() and not (path.is_dir() and ((path / MANIFEST).is_file() or not any(path.iterdir()))):
        raise GraphfuseError(f"{path} exists and is not a program directory; choose another path or remove it")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _read_checked(path: Path, name: str, entry) -> bytes:
    if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and isinstance(entry.get("sha256"), str) and _HEX64.match(entry["sha256"])):
        raise ProgramFormatError(f"{path / MANIFEST}: the entry of {name} must be {{bytes, sha256}}")
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise ProgramFormatError(f"{path / name}: cannot read the file ({e.strerror}); the program is incomplete") from None
    if len(data) != entry["bytes"]:
        how = "truncated" if len(data) < entry["bytes"] else "altered"
        raise ProgramFormatError(f"{path / name}: {how}: {len(data)} bytes, the manifest says {entry['bytes']}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ProgramFormatError(f"{path / name}: altered: its sha256 is not the one in the manifest")
    return data


def _parse_json(path: Path, data: bytes):
    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProgramFormatError(f"{path}: not a JSON file of this format ({type(e).__name__}: {_short(e)})") from None


def load_program(path: str | os.PathLike) -> Program:
    """Read a program written by `save_program`. Runs no code from the file: JSON and
    safetensors only, call targets from an allowlist; any defect raises ProgramFormatError."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ProgramFormatError(f"{path}: not a program directory (no {MANIFEST}); save one with gf.save_program")
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError as e:
        raise ProgramFormatError(f"{path / MANIFEST}: cannot read the file ({e.strerror})") from None
    manifest = _parse_json(path / MANIFEST, raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ProgramFormatError(f"{path / MANIFEST}: not a graphfuse program manifest (format must be {FORMAT_NAME!r})")
    version = manifest.get("version")
    if type(version) is not int or version < 1:
        raise ProgramFormatError(f"{path / MANIFEST}: invalid format version {version!r}")
    if version > FORMAT_VERSION:
        raise ProgramFormatError(
            f"{path / MANIFEST}: format version {version} is newer than this graphfuse reads ({FORMAT_VERSION}); "
            f"the program was written by graphfuse {manifest.get('graphfuse_version')}: upgrade graphfuse"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not set(listed) <= set(FILES) or not {PROGRAM, GRAPH} <= set(listed):
        raise ProgramFormatError(f"{path / MANIFEST}: 'files' must list {PROGRAM}, {GRAPH} and optionally {CONSTANTS}, nothing else")
    data = {name: _read_checked(path, name, entry) for name, entry in listed.items()}

    constants: dict[str, torch.Tensor] = {}
    if CONSTANTS in data:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            constants = load(data[CONSTANTS])
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise ProgramFormatError(f"{path / CONSTANTS}: not a safetensors file ({_short(e)})") from None
    graph_doc = _parse_json(path / GRAPH, data[GRAPH])
    try:
        if not isinstance(graph_doc, dict) or set(graph_doc) != {"nodes"}:
            raise _Malformed("the top level must be {\"nodes\": [...]}")
        gm = _graph_from_json(graph_doc["nodes"], constants)
    except (_Malformed, RecursionError, LookupError, TypeError, ValueError, AttributeError) as e:
        what = str(e) if isinstance(e, _Malformed) else f"malformed ({type(e).__name__}: {_short(e)})"
        raise ProgramFormatError(f"{path / GRAPH}: {what}") from None
    try:
        program = _program_from_json(_parse_json(path / PROGRAM, data[PROGRAM]), gm)
    except (_Malformed, GraphfuseError, LookupError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ProgramFormatError):
            raise
        raise ProgramFormatError(f"{path / PROGRAM}: invalid program metadata ({type(e).__name__}: {_short(e)})") from None
    return _verified(program, path)


def _shapes(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    if isinstance(val, (list, tuple)):
        return [_shapes(v) for v in val]
    return val


def _verified(program: Program, path: Path) -> Program:
    """Verify the program, and run it on fake tensors: every operator must accept its
    arguments and give the shape and dtype the file's meta records."""
    from graphfuse.passes.verify import check_values, fake_values, verify

    try:
        verify(program, propagate=False)
    except GraphfuseError as e:
        raise ProgramFormatError(f"{path}: the graph and the program metadata disagree: {e}") from None
    try:
        values = fake_values(program)
        check_values(program, values)
    except Exception as e:  # whatever an operator raises on arguments it does not accept
        raise ProgramFormatError(f"{path / GRAPH}: the graph does not run on fake tensors ({type(e).__name__}: {_short(e)})") from None
    for node in program.graph.nodes:
        if "val" in node.meta and _shapes(values.get(node)) != _shapes(node.meta["val"]):
            raise ProgramFormatError(
                f"{path / GRAPH}: node {node.name}: meta records {_shapes(node.meta['val'])}, its operator gives {_shapes(values.get(node))}"
            )
    return program


# ---- the `graphfuse program info` command ----------------------------------------------


def cli_info(path: str, code: bool = False) -> int:
    """Print a saved program's passes, ranks, layout, signature and op counts."""
    from rich.console import Console
    from rich.table import Table

    from graphfuse.passes._graph import count_targets

    program = load_program(path)
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    console = Console()
    console.print(f"[bold]{path}[/bold]: {FORMAT_NAME} v{manifest['version']}, written by graphfuse "
                  f"{manifest['graphfuse_version']} on torch {manifest['torch_version']}")
    console.print(f"rank {program.rank} of {program.world_size}, process group {program.group_name or '-'}; "
                  f"optimizer {program.optim.cls_name}, param groups: {len(program.optim.groups)}")
    console.print("files: " + ", ".join(f"{name} {entry['bytes']:,} B" for name, entry in manifest["files"].items()))
    console.print("passes: " + " → ".join(program.pass_names))
    if program.layout is not None:
        layout = program.layout
        t = Table(title=f"layout {layout.fingerprint}: {len(layout.buckets)} buckets, align {layout.align_bytes} B, cap {layout.bucket_bytes} B")
        for col in ("bucket", "dtype", "group", "params", "elements", "bytes", "shard elements"):
            t.add_column(col, justify="left" if col in ("bucket", "dtype") else "right")
        for b in layout.buckets:
            t.add_row(b.name, b.dtype, str(b.group), str(len(b.slots)), f"{b.size:,}", f"{b.nbytes:,}", f"{b.shard_size:,}")
        console.print(t)
    t = Table(title="signature")
    t.add_column("kind")
    t.add_column("role")
    t.add_column("count", justify="right")
    for kind, specs in (("input", program.signature.inputs), ("output", program.signature.outputs)):
        counts: dict[str, int] = {}
        for s in specs:
            counts[s.role] = counts.get(s.role, 0) + 1
        for role, n in counts.items():
            t.add_row(kind, role, str(n))
    console.print(t)
    t = Table(title=f"ops ({sum(1 for _ in program.graph.nodes)} nodes)")
    t.add_column("op")
    t.add_column("count", justify="right")
    for name, n in sorted(count_targets(program).items(), key=lambda kv: (-kv[1], kv[0])):
        t.add_row(name, str(n))
    console.print(t)
    if code:
        console.print(program.graph_module.code, markup=False, highlight=False)
    return 0
