"""A program's dataflow graph as a networkx graph (one node per FX node, one edge per value read),
and that graph written as GraphML or DOT for graph viewers (`graphfuse inspect --graph FILE`)."""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx
import torch

from graphfuse.errors import UnsupportedError
from graphfuse.ir.program import Program
from graphfuse.ir.signature import InputSpec, OutputSpec
from graphfuse.passes import issues_collective

FORMATS = {".graphml": "GraphML", ".dot": "DOT"}


def _target(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', repr(t))}".lstrip(".")


def _shape_dtype(val: object) -> tuple[str, str]:
    """("2x3", "float32") of a tensor value; of a tuple of them, each joined by ";"; else ("", "")."""
    vals = val if isinstance(val, tuple | list) else (val,)
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors:
        return "", ""
    shapes = ["x".join(str(d) for d in t.shape) or "scalar" for t in tensors]
    return ";".join(shapes), ";".join(str(t.dtype).removeprefix("torch.") for t in tensors)


def dataflow_graph(program: Program) -> nx.DiGraph:
    """Nodes: the FX nodes by name, with op, target, tensor_shape ("2x3"), dtype, phase, collective, and for
    inputs and outputs their role and name in the signature (`role`, `name` on a placeholder;
    `output_role`, `output_name` on a node whose value the step returns). Edges: node a -> b for
    each value b reads from a. Shapes and dtypes come from node.meta["val"] where present."""
    g = nx.DiGraph(program_rank=program.rank, world_size=program.world_size)  # not "rank": a Graphviz graph attribute
    inputs = iter(program.signature.inputs)
    spec: InputSpec | OutputSpec  # an input's, then an output's
    for n in program.graph.nodes:
        shape, dtype = _shape_dtype(n.meta.get("val"))
        attrs = {
            "op": n.op,
            "target": _target(n),
            "tensor_shape": shape,
            "dtype": dtype,
            "phase": n.meta.get("phase", ""),
            "collective": issues_collective(n),
            "role": "",
            "name": "",
            "output_role": "",
            "output_name": "",
        }
        if n.op == "placeholder":
            spec = next(inputs)
            attrs.update(role=spec.role, name=spec.name)
        g.add_node(n.name, **attrs)
        g.add_edges_from((a.name, n.name) for a in n.all_input_nodes)
    output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    g.nodes[output.name]["role"] = "output"
    values = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    for spec, value in zip(program.signature.outputs, values, strict=False):
        if isinstance(value, torch.fx.Node):  # a node returned twice carries both roles
            node = g.nodes[value.name]
            node["output_role"] = ",".join(filter(None, [node["output_role"], spec.role]))
            node["output_name"] = ",".join(filter(None, [node["output_name"], spec.name]))
    return g


def _dot_id(text: object) -> str:
    return '"' + re.sub(r'(["\\])', r"\\\1", str(text)).replace("\n", "\\n") + '"'


def dot_text(g: nx.DiGraph) -> str:
    """`g` in Graphviz's DOT language, written here so that no pydot or pygraphviz is needed:
    every attribute kept, a label of name, target, shape and dtype, collectives in red."""
    lines = [f"digraph {_dot_id('graphfuse program')} {{", "  node [shape=box, fontname=monospace];"]
    lines += [f"  graph [{k}={_dot_id(v)}];" for k, v in g.graph.items()]
    for name, a in g.nodes(data=True):
        target = a["target"] if a["target"] != name else ""  # a placeholder's target is its name
        label = "\n".join(filter(None, [name, target, f"{a['tensor_shape']} {a['dtype']}".strip()]))
        extra = {"label": label, **({"color": "red", "penwidth": "2"} if a["collective"] else {})}
        attrs = ", ".join(f"{k}={_dot_id(v)}" for k, v in {**a, **extra}.items())
        lines.append(f"  {_dot_id(name)} [{attrs}];")
    lines += [f"  {_dot_id(a)} -> {_dot_id(b)};" for a, b in g.edges]
    return "\n".join(lines) + "\n}\n"


def write_graph(g: nx.DiGraph, path: str | Path) -> str:
    """Write `g` to `path` in the format its suffix names (.graphml or .dot); that format's name."""
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UnsupportedError(
            f"{path}: unknown graph format {path.suffix or '(no suffix)'!r}; "
            f"name the file {' or '.join('*' + s for s in FORMATS)}"
        )
    if kind == "GraphML":
        nx.write_graphml(g, path)
    else:
        path.write_text(dot_text(g))
    return kind
