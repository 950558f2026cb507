"""Reduce-scatter gradients: pack each bucket's gradients and zero padding into one
flat buffer and average it across ranks with ONE reduce_scatter_tensor, issued as soon as
the bucket's last gradient exists. Hands each bucket's averaged shard on as `grad_shards`."""

from __future__ import annotations

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program

from ._contract import always, expect
from .graph import aten, c10d, call, grad_nodes, hoist, position

NAME = "reduce_scatter"
NEEDS: tuple[str, ...] = ()
PROVIDES = ("grad_shards",)


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, bool(program.signature.names(sig.BUCKET)), "bucket inputs", "run fuse_params first")
    missing = [f for f in program.bucket_layout.fqns if f not in program.signature.grads]
    expect(program, NAME, not missing, f"a gradient node for every bucketed parameter (none for {missing})")


def run(program: Program) -> Program:
    graph, layout = program.graph, program.bucket_layout
    world = layout.world_size
    master = program.strategy.master_dtype
    grad_of = grad_nodes(program)
    for node in grad_of.values():
        hoist(node)  # accumulated gradients: ready where the last backward made them
    order = position(graph)
    shards = []
    for bucket in layout.buckets:
        grads = {fqn: grad_of[fqn] for fqn in bucket.fqns}
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
                if slot.padding:
                    # Padding as its own zero piece, so every gradient is a direct input of the
                    # cat: inductor can then write it straight into the packed buffer (a padded
                    # copy per gradient measured 45x slower on CPU; on an H200 the two are
                    # within 20%: tools/bench_update.py).
                    pieces.append(call(graph, aten.new_zeros.default, flat, [slot.padding], phase=sig.COMM))
            packed = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, pieces, phase=sig.COMM)
            shard = packed
            if world > 1:
                issued = call(
                    graph, c10d.reduce_scatter_tensor.default, packed, "avg", world, program.group_name, phase=sig.COMM
                )
                shard = call(graph, c10d.wait_tensor.default, issued, phase=sig.COMM)
        shards.append(shard)
    return program.handing_off(grad_shards=tuple(shards))


def ensures(program: Program) -> None:
    layout = program.bucket_layout
    scatters = [x for x in program.graph.nodes if x.target is c10d.reduce_scatter_tensor.default]
    expected = len(layout.buckets) if layout.world_size > 1 else 0
    found = (
        f"{expected} reduce-scatters for {len(layout.buckets)} buckets at world size {layout.world_size}, "
        f"found {len(scatters)}"
    )
    expect(program, NAME, len(scatters) == expected, found)
    if layout.world_size > 1:
        shards = program.handoffs.grad_shards
        assert shards is not None  # run set them
        waited = [s.args[0] for s in shards if s.target is c10d.wait_tensor.default]
        expect(
            program,
            NAME,
            sorted(map(str, waited)) == sorted(map(str, scatters)),
            "each bucket's gradient shard to be the wait on its own reduce-scatter",
        )
