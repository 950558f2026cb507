"""The codec of program.json: the program's signature, optimizer, inputs, strategy, layout
and place in the job, as plain data with strict types. Version 1 documents are converted."""

from __future__ import annotations

import dataclasses

import torch.fx

from graphfuse.errors import GraphfuseError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import PassRun, Program, TensorMeta
from graphfuse.optim import CLASSES, RULES, GroupSpec, OptimSpec
from graphfuse.strategy import Strategy

from . import checks
from .values import IDENT, Malformed, dims, dtype, short

KEYS = ("signature", "optim", "inputs_meta", "strategy", "layout", "passes", "world_size", "rank", "group_name")
SIGNATURE_KEYS = ("inputs", "outputs", "grads", "aliases", "batch_spec")
OPTIMIZERS = tuple(CLASSES)
MAX_WORLD_SIZE = 2**20


def program_to_json(program: Program) -> dict:
    """program.json of format version 2: data only (no pass scratch, nothing derivable)."""
    s, layout = program.signature, program.layout
    return {
        "signature": {
            "inputs": [[i.role, i.name] for i in s.inputs],
            "outputs": [[o.role, o.name, o.target] for o in s.outputs],
            "grads": dict(s.grads),
            "aliases": dict(s.aliases),
            "batch_spec": s.batch_spec,
        },
        "optim": {"cls_name": program.optim.cls_name, "groups": [dataclasses.asdict(g) for g in program.optim.groups]},
        "inputs_meta": {name: m.to_json() for name, m in program.inputs_meta.items()},
        "strategy": program.strategy.to_json(),
        "layout": None if layout is None else layout.to_json(),
        "passes": list(program.pass_names),
        "world_size": program.world_size,
        "rank": program.rank,
        "group_name": program.group_name,
    }


def upgrade_v1(doc) -> dict:
    """A version 1 program.json as version 2: the stored state plan (`extra`) and the layout
    fingerprint are derived on load instead, and the passes' `marks` were their scratch."""
    doc = dict(_fields(doc, "program.json", KEYS, optional=("layout_fingerprint", "extra")))
    doc.pop("extra", None)
    doc.pop("layout_fingerprint", None)
    s = _fields(doc["signature"], "signature", SIGNATURE_KEYS, optional=("marks",))
    doc["signature"] = {k: v for k, v in s.items() if k != "marks"}
    return doc


def program_from_json(doc, gm: torch.fx.GraphModule) -> Program:
    """The Program of a version 2 program.json and its graph; raises Malformed naming the field."""
    d = _fields(doc, "program.json", KEYS)
    world_size, rank, group_name, passes = d["world_size"], d["rank"], d["group_name"], d["passes"]
    if (
        type(world_size) is not int
        or not 1 <= world_size <= MAX_WORLD_SIZE
        or type(rank) is not int
        or not 0 <= rank < world_size
    ):
        raise Malformed(f"rank {short(rank)} of world size {short(world_size)} is not a rank of that world")
    if not isinstance(group_name, str) or len(group_name) > 256:
        raise Malformed("group_name must be a string")
    if not isinstance(passes, list) or not all(isinstance(p, str) and IDENT.match(p) for p in passes):
        raise Malformed("passes must be a list of pass names")
    layout = None if d["layout"] is None else checks.layout(d["layout"], world_size)
    return Program(
        graph_module=gm,
        signature=_signature(d["signature"]),
        optim=_optim(d["optim"]),
        inputs_meta=_inputs_meta(d["inputs_meta"]),
        strategy=_strategy(d["strategy"]),
        layout=layout,
        passes=tuple(PassRun(p) for p in passes),
        world_size=world_size,
        rank=rank,
        group_name=group_name,
    )


def _fields(d, what: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(d, dict) or not set(keys) <= set(d) <= set(keys) | set(optional):
        raise Malformed(f"{what} must be an object with exactly the keys {', '.join(keys)}, got {short(d)}")
    return d


def _strings(d, what: str) -> dict[str, str]:
    if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
        raise Malformed(f"{what} must map strings to strings")
    return dict(d)


def _signature(d) -> sig.Signature:
    d = _fields(d, "signature", SIGNATURE_KEYS)
    inputs, outputs = d["inputs"], d["outputs"]
    if not isinstance(inputs, list) or not all(
        isinstance(x, list) and len(x) == 2 and x[0] in sig.INPUT_ROLES and isinstance(x[1], str) for x in inputs
    ):
        raise Malformed(f"signature.inputs must be a list of [role, name] with a role of {', '.join(sig.INPUT_ROLES)}")
    if not isinstance(outputs, list) or not all(
        isinstance(x, list)
        and len(x) == 3
        and x[0] in sig.OUTPUT_ROLES
        and isinstance(x[1], str)
        and (x[2] is None or isinstance(x[2], str))
        for x in outputs
    ):
        raise Malformed(
            f"signature.outputs must be a list of [role, name, target] with a role of {', '.join(sig.OUTPUT_ROLES)}"
        )
    spec = d["batch_spec"]
    if not isinstance(spec, str):
        raise Malformed("signature.batch_spec must be a string")
    checks.batch_spec(spec)
    return sig.Signature(
        inputs=tuple(sig.InputSpec(r, n) for r, n in inputs),
        outputs=tuple(sig.OutputSpec(r, n, t) for r, n, t in outputs),
        grads=_strings(d["grads"], "signature.grads"),
        aliases=_strings(d["aliases"], "signature.aliases"),
        batch_spec=spec,
    )


def _optim(d) -> OptimSpec:
    d = _fields(d, "optim", ("cls_name", "groups"))
    if not isinstance(d["cls_name"], str) or not set(d["cls_name"].split("+")) <= set(
        OPTIMIZERS
    ):  # "Muon+AdamW": several
        raise Malformed(f"unknown optimizer {short(d['cls_name'])}; one of {', '.join(OPTIMIZERS)}")
    if not isinstance(d["groups"], list):
        raise Malformed("optim.groups must be a list")
    return OptimSpec(d["cls_name"], tuple(_group(g, i) for i, g in enumerate(d["groups"])))


def _group(g, i: int) -> GroupSpec:
    fields = {f.name: f for f in dataclasses.fields(GroupSpec)}
    if isinstance(g, dict) and "lr" in g:  # written while ASGD's lr was baked in; every lr is read per step now
        g = {k: v for k, v in g.items() if k != "lr"}
    if not isinstance(g, dict) or not {"kind", "params"} <= set(g) <= set(fields):
        raise Malformed(f"optim.groups[{i}] must hold kind, params and fields of {', '.join(fields)}")
    if g["kind"] not in RULES or not (isinstance(g["params"], list) and all(isinstance(p, str) for p in g["params"])):
        raise Malformed(f"optim.groups[{i}]: kind must be one of {', '.join(RULES)} and params a list of names")
    for name, value in g.items():
        expected = type(fields[name].default)  # bool or float (None: a float or null); kind and params have none
        number = type(value) in (int, float) or expected is type(None) and value is None
        if expected is bool and type(value) is not bool or expected in (float, type(None)) and not number:
            what = "float or null" if expected is type(None) else expected.__name__
            raise Malformed(f"optim.groups[{i}].{name} must be a {what}, got {short(value)}")
    return GroupSpec(**{**g, "params": tuple(g["params"])})


def _inputs_meta(d) -> dict[str, TensorMeta]:
    if not isinstance(d, dict):
        raise Malformed("inputs_meta must be an object")
    out = {}
    for name, m in d.items():
        if not (isinstance(m, list) and len(m) == 3 and isinstance(m[2], str) and IDENT.match(m[2])):
            raise Malformed(f"inputs_meta[{short(name)}] must be [shape, dtype, device type], got {short(m)}")
        dtype(m[1])
        out[name] = TensorMeta(dims(m[0], f"inputs_meta[{short(name)}] shape"), m[1], m[2])
    return out


def _strategy(d) -> Strategy:
    fields = {f.name for f in dataclasses.fields(Strategy)}
    if (
        not isinstance(d, dict)
        or not set(d) <= fields
        or not all(v is None or type(v) in (bool, int, float, str) for v in d.values())
    ):
        raise Malformed(f"strategy must be an object of plain values with keys among {', '.join(sorted(fields))}")
    if d.get("master_dtype") is not None:
        dtype(d["master_dtype"])
    try:
        return Strategy.from_json(d)
    except (GraphfuseError, TypeError, ValueError) as e:
        raise Malformed(f"invalid strategy: {short(e)}") from None
