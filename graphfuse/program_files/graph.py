"""The graph codec of graph.json: one JSON object per FX node, in graph order, with call
targets from the op allowlist; decoding rebuilds a GraphModule without running file code."""

from __future__ import annotations

import keyword
import operator
import re

import torch
import torch.fx

from graphfuse.errors import UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.layout import BucketLayout
from graphfuse.passes.graph import PASS_META

from .layers import describe
from .limits import MAX_NODES
from .ops import resolve_target, target_name
from .values import Decoder, Malformed, encode, short

NODE_KEYS = ("name", "op", "target", "args", "kwargs", "meta")
PHASES = (sig.FORWARD, sig.BACKWARD, sig.OPTIMIZER, sig.COMM)
PASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # meta "pass": a pass's NAME
CONSTANTS = "constants.safetensors"


def graph_to_json(
    gm: torch.fx.GraphModule, layout: BucketLayout | None = None
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The node records of `gm` and the tensors its get_attr nodes read. Only data is kept:
    the phase and result meta of each node; the placeholders' roles are the signature's.
    `layout` names the layer of a node that cannot be saved."""
    nodes, constants = [], {}
    for n in gm.graph.nodes:
        where = f"node {n.name}"
        target = n.target
        if n.op == "call_function":
            target = target_name(n.target)
            if target is None:
                raise _not_allowed(n, layout)
        elif n.op == "get_attr":
            value = operator.attrgetter(n.target)(gm)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedError(
                    f"cannot save {where}: get_attr {n.target} is a {type(value).__qualname__}, not a tensor"
                )
            constants[n.target] = value.detach().cpu().contiguous().clone()
        elif n.op not in ("placeholder", "output"):
            raise UnsupportedError(
                f"cannot save {where}: {n.op} nodes are not supported; a program graph is aten-level"
            )
        meta = {}
        if "phase" in n.meta:
            meta["phase"] = n.meta["phase"]
        if PASS_META in n.meta:
            meta["pass"] = n.meta[PASS_META]
        if "val" in n.meta:
            meta["val"] = encode(n.meta["val"], f"{where} meta['val']")
        args = [encode(a, where) for a in n.args]
        kwargs = {k: encode(v, where) for k, v in n.kwargs.items()}
        nodes.append({"name": n.name, "op": n.op, "target": target, "args": args, "kwargs": kwargs, "meta": meta})
    return nodes, constants


def _not_allowed(node: torch.fx.Node, layout: BucketLayout | None) -> UnsupportedError:
    """The refusal of a node whose operator a program file may not call: the operator, the
    model's layer, and what the user can do (the library's allowlist is not theirs to edit)."""
    op = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else repr(node.target)
    return UnsupportedError(
        f"cannot save the program: node {node.name} calls {op} {describe(node, layout)}, which is not in the "
        "program-file op allowlist. The model still trains with gf.compile (and torch.compile); only saving its "
        "program (gf.save_program, graphfuse trace) is refused. Please report the operator and the layer in a "
        "graphfuse issue so that program files can admit it"
    )


def graph_from_json(doc, constants: dict[str, torch.Tensor], version: int) -> torch.fx.GraphModule:
    """Rebuild the GraphModule of a parsed graph.json of format `version`; raises Malformed
    naming the node."""
    if not isinstance(doc, dict) or set(doc) != {"nodes"} or not isinstance(doc["nodes"], list):
        raise Malformed('the top level must be {"nodes": [...]}')
    nodes = doc["nodes"]
    if len(nodes) > MAX_NODES:
        raise Malformed(f"{len(nodes)} nodes, more than the limit {MAX_NODES}")
    graph, dec = torch.fx.Graph(), Decoder()
    attrs: dict[str, torch.Tensor] = {}  # get_attr target -> its constant
    for i, rec in enumerate(nodes):
        name = rec.get("name") if isinstance(rec, dict) else None
        try:
            node = _node(graph, dec, rec, constants, attrs, version)
        except Malformed as e:
            raise Malformed(f"node {i} ({short(name)}): {e}") from None
        dec.nodes[node.name] = node
    if not nodes or nodes[-1]["op"] != "output" or sum(r["op"] == "output" for r in nodes) != 1:
        raise Malformed("the graph must end with its one output node")
    try:
        graph.lint()
    except RuntimeError as e:
        raise Malformed(f"the graph is not well formed: {e}") from None
    try:
        return torch.fx.GraphModule(attrs, graph, class_name="GraphfuseProgram")
    except (RuntimeError, SyntaxError, TypeError, ValueError) as e:
        raise Malformed(f"FX cannot generate code for the graph ({type(e).__name__}: {short(e)})") from None


def _identifier(text, what: str) -> None:
    # Names, placeholder and get_attr targets and keyword names are written into FX's generated code.
    parts = text.split(".") if isinstance(text, str) else [None]
    if not all(isinstance(p, str) and p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise Malformed(f"{what} {short(text)} is not a Python identifier")


def _node(graph: torch.fx.Graph, dec: Decoder, rec, constants: dict, attrs: dict, version: int) -> torch.fx.Node:
    if not isinstance(rec, dict) or set(rec) != set(NODE_KEYS):
        raise Malformed(f"a node record must have exactly the keys {', '.join(NODE_KEYS)}")
    name, op, target = rec["name"], rec["op"], rec["target"]
    if not isinstance(name, str) or not isinstance(rec["args"], list) or not isinstance(rec["kwargs"], dict):
        raise Malformed("name must be a string, args a list and kwargs an object")
    args = tuple(dec.value(a) for a in rec["args"])
    kwargs = {k: dec.value(v) for k, v in rec["kwargs"].items()}
    for k in kwargs:
        _identifier(k, "keyword argument name")
    if op == "call_function":
        target = resolve_target(target)
    elif op in ("placeholder", "get_attr"):
        _identifier(target, f"{op} target")
        if op == "placeholder" and (args or kwargs):
            raise Malformed("a placeholder takes no arguments")
        if op == "get_attr":
            if target not in constants:
                raise Malformed(f"get_attr {target} has no tensor in {CONSTANTS}")
            attrs[target] = constants[target]
    elif op == "output":
        if target != "output" or len(args) != 1 or kwargs:
            raise Malformed("the output node takes one argument")
    else:
        raise Malformed(f"unsupported node op {short(op)}")
    node = graph.create_node(op, target, args, kwargs, name=name)
    if node.name != name:
        raise Malformed(f"node name {name!r} is not a valid unique identifier (FX renamed it {node.name!r})")
    node.meta.update(_meta(rec["meta"], dec, version))
    return node


def _meta(meta, dec: Decoder, version: int) -> dict:
    # Version 1 files also hold each placeholder's `gf_input`: a copy of the signature's input
    # spec, checked against it (verify) once the program is assembled. Version 2 derives it.
    keys = {"phase", "pass", "val"} | ({"gf_input"} if version == 1 else set())
    if not isinstance(meta, dict) or not set(meta) <= keys:
        raise Malformed(f"invalid meta {short(meta)}")
    out = {}
    if "phase" in meta:
        if meta["phase"] not in PHASES:
            raise Malformed(f"unknown phase {short(meta['phase'])}")
        out["phase"] = meta["phase"]
    if "pass" in meta:
        if not (isinstance(meta["pass"], str) and PASS_NAME.fullmatch(meta["pass"])):
            raise Malformed(f"meta pass must be a pass's name (an identifier), got {short(meta['pass'])}")
        out[PASS_META] = meta["pass"]
    if "gf_input" in meta:
        v = meta["gf_input"]
        if not (isinstance(v, list) and len(v) == 2 and v[0] in sig.INPUT_ROLES and isinstance(v[1], str)):
            raise Malformed(f"gf_input must be [role, name], got {short(v)}")
        out["gf_input"] = sig.InputSpec(v[0], v[1])
    if "val" in meta:
        out["val"] = dec.value(meta["val"], meta=True)
    return out
