"""Small graph-editing helpers the passes share: inputs and outputs kept in step with the
signature, node creation with a phase, and inlining a traced function."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse.capture.tracing import make_fx_exact, placeholder_name
from graphfuse.errors import PassContractError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# node.meta key: the NAME of the pass that created the node (run_pass stamps it; a captured node
# has none), saved in program files and shown by `graphfuse inspect --code`.
PASS_META = "graphfuse_pass"


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's inputs, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def add_input(program: Program, spec: sig.InputSpec, meta: TensorMeta) -> torch.fx.Node:
    """A new placeholder after the last one, recorded in the signature and inputs_meta."""
    graph = program.graph
    last = placeholders(graph)[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(placeholder_name(spec))
    node.meta["gf_input"] = spec
    program.inputs_meta[spec.name] = meta
    return node


def input_nodes(program: Program) -> dict[sig.InputSpec, torch.fx.Node]:
    """Every placeholder by its input spec (one scan, for passes that look up many)."""
    return {n.meta["gf_input"]: n for n in placeholders(program.graph)}


def grad_nodes(program: Program) -> dict[str, torch.fx.Node]:
    """Every trainable parameter's gradient node, by FQN (one scan of the graph)."""
    by_name = {n.name: n for n in program.graph.nodes}
    return {fqn: by_name[name] for fqn, name in program.signature.grads.items()}


def remove_input(program: Program, node: torch.fx.Node) -> None:
    """Drop an input that nothing uses any more, with its recorded metadata."""
    if node.users:
        raise PassContractError(
            f"input {node.name} cannot be removed: it still has users {[u.name for u in node.users]}"
        )
    program.inputs_meta.pop(node.meta["gf_input"].name, None)
    program.graph.erase_node(node)


def outputs(program: Program) -> list[tuple[sig.OutputSpec, torch.fx.Node]]:
    """Each output's role beside the node that computes it."""
    return list(zip(program.signature.outputs, program.output_args()))


def set_outputs(program: Program, pairs: list[tuple[sig.OutputSpec, torch.fx.Node]]) -> Program:
    """Make `pairs` the program's outputs, in the graph and in the signature together."""
    program.graph.output_node().args = (tuple(n for _, n in pairs),)
    return program.with_(signature=program.signature.with_(outputs=tuple(s for s, _ in pairs)))


def sync_inputs(program: Program) -> Program:
    """Re-read the signature's inputs from the placeholders (after adding or removing some)."""
    inputs = tuple(n.meta["gf_input"] for n in placeholders(program.graph))
    return program.with_(signature=program.signature.with_(inputs=inputs))


def call(graph: torch.fx.Graph, op, *args, phase: str, **kwargs) -> torch.fx.Node:
    """A new call of `op` at the graph's insertion point, tagged with its step phase."""
    node = graph.call_function(op, args, kwargs)
    node.meta["phase"] = phase
    return node


def inline(graph: torch.fx.Graph, fn: Callable, args: list[torch.fx.Node], metas: list[TensorMeta], phase: str):
    """Trace `fn` on fake tensors shaped like `metas` and copy its ops into `graph` at the
    current insertion point, with `args` in place of its inputs; returns fn's output nodes."""
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty(m.shape, dtype=getattr(torch, m.dtype)) for m in metas]
    sub = make_fx_exact(fn, tracing_mode="fake")(*fakes)
    val_map = dict(zip(placeholders(sub.graph), args))
    before = set(graph.nodes)
    out = graph.graph_copy(sub.graph, val_map)
    for n in graph.nodes:
        if n not in before:
            n.meta["phase"] = phase
            n.meta.pop("val", None)
    return out


def position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Every node's index in the graph's order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def ready_position(order: dict[torch.fx.Node, int], node: torch.fx.Node) -> int:
    """The earliest place `node` could run: right after the last of its inputs. With gradient
    accumulation the traced gradients are sums computed after the whole last backward; this
    is where the last micro-batch's backward made them ready."""
    return max((order[i] for i in node.all_input_nodes), default=order[node])


def hoist(node: torch.fx.Node) -> None:
    """Move `node` to right after the last of its inputs (always valid: nothing it reads moves)."""
    order = position(node.graph)
    inputs = [i for i in node.all_input_nodes if i.op != "placeholder"]
    if inputs:
        latest = max(inputs, key=order.__getitem__)
        if order[latest] + 1 < order[node]:
            latest.append(node)


def eliminate_dead_code(program: Program) -> None:
    """Dead-code elimination that keeps the values handed off to a later pass."""
    keep = set(program.handoffs.nodes())
    program.graph.eliminate_dead_code(is_impure_node=lambda n: n in keep or n.is_impure())


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective: one that starts communication, or the wait for one."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"


def issues_collective(node: torch.fx.Node) -> bool:
    """A collective that starts communication (not the wait for one)."""
    return is_collective(node) and node.target is not c10d.wait_tensor.default


def count_targets(program: Program) -> dict[str, int]:
    """How many nodes call each op (by its overload packet name), for graph tests and reports."""
    counts: dict[str, int] = {}
    for n in program.graph.nodes:
        if n.op == "call_function":
            name = str(getattr(n.target, "_overloadpacket", n.target))
            counts[name] = counts.get(name, 0) + 1
    return counts
