"""Fuse parameters: each bucket becomes one flat placeholder and every parameter a view of it."""

from __future__ import annotations

from graphfuse import signature as sig
from graphfuse.program import Program, TensorMeta
from ._graph import add_input, aten, call, input_node, remove_input, sync_inputs


def requires(program: Program) -> None:
    assert program.layout is not None, "plan buckets first"
    assert not program.signature.names(sig.BUCKET), "parameters are already fused"


def run(program: Program) -> Program:
    graph = program.graph
    for bucket in program.layout.buckets:
        node = add_input(program, sig.InputSpec(sig.BUCKET, bucket.name), TensorMeta((bucket.size,), bucket.dtype, bucket.device))
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        for slot in bucket.slots:
            old = input_node(program, sig.PARAM, slot.fqn)
            with graph.inserting_before(first_op):
                flat = call(graph, aten.slice.Tensor, node, 0, slot.offset, slot.offset + slot.numel, phase=sig.FORWARD)
                view = call(graph, aten.view.default, flat, list(slot.shape), phase=sig.FORWARD)
            old.replace_all_uses_with(view)
            remove_input(program, old)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    assert not program.signature.names(sig.PARAM), "no per-parameter input remains"
    assert len(program.signature.names(sig.BUCKET)) == len(program.layout.buckets)
