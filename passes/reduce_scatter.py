"""Reduce-scatter gradients: pack each bucket's gradients and zero padding into one
flat buffer and average it across ranks with ONE reduce_scatter_tensor, issued as soon as
the bucket's last gradient exists. Marks `grad_shard:<bucket>` for the update."""

from __future__ import annotations

from graphfuse import signature as sig
from graphfuse.program import Program

from ._graph import aten, c10d, call, hoist, mark, position


def requires(program: Program) -> None:
    assert program.signature.names(sig.BUCKET), "fuse parameters first"


def run(program: Program) -> Program:
    graph, layout = program.graph, program.layout
    world = layout.world_size
    master = program.strategy.master_dtype
    for name in program.signature.grads.values():
        hoist(program.node(name))  # accumulated gradients: ready where the last backward made them
    order = position(graph)
    for bucket in layout.buckets:
        grads = {fqn: program.node(program.signature.grads[fqn]) for fqn in bucket.fqns}
        last = max(grads.values(), key=order.__getitem__)
        cast = master is not None and bucket.dtype != str(master).removeprefix("torch.")
        with graph.inserting_before(last.next):
            pieces = []
            for slot in bucket.slots:
                # reshape, not view: a gradient may come in any memory layout (a channels_last
                # conv weight's does) and must be flattened in its logical element order.
                flat = call(graph, aten.reshape.default, grads[slot.fqn], [-1], phase=sig.COMM)
                if cast:
                    # Gradients are averaged in the master dtype: an average of bf16 values in
                    # bf16 loses the low bits the fp32 master weights are there to keep.
                    flat = call(graph, aten._to_copy.default, flat, dtype=master, phase=sig.COMM)
                pieces.append(flat)
                if slot.padded > slot.numel:
                    # Padding as its own zero piece, so every gradient is a direct input of the
                    # cat: inductor can then write it straight into the packed buffer (a padded
                    # copy per gradient measured 45x slower on CPU; on an H200 the two are
                    # within 20%: tools/bench_update.py).
                    pieces.append(call(graph, aten.new_zeros.default, flat, [slot.padded - slot.numel], phase=sig.COMM))
            packed = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, pieces, phase=sig.COMM)
            shard = packed
            if world > 1:
                issued = call(graph, c10d.reduce_scatter_tensor.default, packed, "avg", world, program.group_name, phase=sig.COMM)
                shard = call(graph, c10d.wait_tensor.default, issued, phase=sig.COMM)
        program = mark(program, f"grad_shard:{bucket.name}", shard)
    return program


def ensures(program: Program) -> None:
    n = sum(1 for x in program.graph.nodes if x.target is c10d.reduce_scatter_tensor.default)
    expected = len(program.layout.buckets) if program.layout.world_size > 1 else 0
    assert n == expected, f"{n} reduce-scatters for {len(program.layout.buckets)} buckets"
