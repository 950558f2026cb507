"""Fuse parameters: each bucket becomes one flat placeholder and every parameter a view of it;
the per-parameter new values are packed into one new bucket (so the program stays whole)."""

from __future__ import annotations

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta

from ._contract import always, expect
from .graph import add_input, aten, call, input_nodes, outputs, remove_input, set_outputs, sync_inputs

NAME = "fuse_params"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, program.layout is not None, "a bucket layout", "run plan_buckets first")
    expect(program, NAME, not program.signature.names(sig.BUCKET), "parameters not fused yet")
    new_params = set(program.signature.output_names(sig.NEW_PARAM))
    missing = [f for f in program.bucket_layout.fqns if f not in new_params]
    expect(program, NAME, not missing, f"a new-value output for every bucketed parameter (none for {missing})")


def run(program: Program) -> Program:
    graph = program.graph
    pairs = outputs(program)
    new_param = {s.target: n for s, n in pairs if s.role == sig.NEW_PARAM}
    pairs = [(s, n) for s, n in pairs if s.role != sig.NEW_PARAM]
    params = input_nodes(program)
    for bucket in program.bucket_layout.buckets:
        node = add_input(
            program, sig.InputSpec(sig.BUCKET, bucket.name), TensorMeta((bucket.size,), bucket.dtype, bucket.device)
        )
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        for slot in bucket.slots:
            old = params[sig.InputSpec(sig.PARAM, slot.fqn)]
            with graph.inserting_before(first_op):
                flat = call(graph, aten.slice.Tensor, node, 0, *slot.data_range, phase=sig.FORWARD)
                view = call(graph, aten.view.default, flat, list(slot.shape), phase=sig.FORWARD)
            old.replace_all_uses_with(view)
            remove_input(program, old)
        # Until the sharded update replaces it, the traced update writes the whole bucket back.
        with graph.inserting_before(graph.output_node()):
            pieces = []
            for slot in bucket.slots:
                flat = call(graph, aten.reshape.default, new_param[slot.fqn], [-1], phase=sig.OPTIMIZER)  # any layout
                if slot.padding:
                    flat = call(graph, aten.constant_pad_nd.default, flat, [0, slot.padding], 0.0, phase=sig.OPTIMIZER)
                pieces.append(flat)
            packed = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, pieces, phase=sig.OPTIMIZER)
        pairs.append((sig.OutputSpec(sig.NEW_BUCKET, bucket.name, bucket.name), packed))
    program = set_outputs(program, pairs)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.PARAM), "no per-parameter input left")
    expect(program, NAME, not program.signature.output_names(sig.NEW_PARAM), "no per-parameter output left")
    names = [b.name for b in program.bucket_layout.buckets]
    expect(program, NAME, program.signature.names(sig.BUCKET) == names, f"one bucket input per bucket, {names}")
    expect(
        program,
        NAME,
        program.signature.output_names(sig.NEW_BUCKET) == names,
        f"one new-bucket output per bucket, {names}",
    )
