"""Defer the parameter all-gather: the step ends with each rank's updated shard written into its
range of the bucket (no all-gather at the end); each bucket's all-gather of that shard is issued
at the head of the next step, in forward order, and its result replaces the bucket everywhere the
step reads it. Applies only with `Strategy.overlap_param_gather` at world size > 1."""

from __future__ import annotations

import torch

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, arg_node

from ._contract import expect
from .graph import aten, c10d, call, input_nodes, outputs, placeholders, position, set_outputs

NAME = "defer_gather"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()

# Ops that only re-describe a tensor's memory: moving them next to their first reader costs
# nothing and lets a bucket's gathered value be waited for where the forward first computes on it.
VIEW_OPS = {
    aten.slice.Tensor,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
}


def applies(program: Program) -> bool:
    # An update-only program (gf.shard_optimizer) has no forward to defer into.
    return (
        program.strategy.overlap_param_gather is True
        and program.bucket_layout.world_size > 1
        and not program.signature.names(sig.GRAD)
    )


def requires(program: Program) -> None:
    names = [b.name for b in program.bucket_layout.buckets]
    expect(
        program,
        NAME,
        program.signature.output_names(sig.NEW_BUCKET) == names,
        f"one new-bucket output per bucket, {names}",
        "run all_gather first",
    )
    for spec, node in outputs(program):
        if spec.role == sig.NEW_BUCKET:
            ok = (
                node.target is c10d.wait_tensor.default and arg_node(node).target is c10d.all_gather_into_tensor.default
            )
            expect(program, NAME, ok, f"the new {spec.name} to be the wait on its all-gather")


def run(program: Program) -> Program:
    graph, layout = program.graph, program.bucket_layout
    pairs = []
    for spec, node in outputs(program):
        if spec.role != sig.NEW_BUCKET:
            pairs.append((spec, node))
            continue
        gather = arg_node(node)  # requires checked: the wait on the all-gather of the shard
        pairs.append((sig.OutputSpec(sig.NEW_BUCKET_SHARD, spec.name, spec.target), arg_node(gather)))
    program = set_outputs(program, pairs)
    for node in [
        n
        for n in graph.nodes
        if n.target is c10d.wait_tensor.default and n.args[0].target is c10d.all_gather_into_tensor.default
    ]:
        gather = node.args[0]
        graph.erase_node(node)
        graph.erase_node(gather)

    inputs = input_nodes(program)
    bucket_inputs = [inputs[sig.InputSpec(sig.BUCKET, b.name)] for b in layout.buckets]
    order = position(graph)
    first_use = {ph: min((_first_compute_use(u, order) for u in ph.users), default=len(order)) for ph in bucket_inputs}
    anchor = placeholders(graph)[-1]
    for bucket, ph in sorted(zip(layout.buckets, bucket_inputs), key=lambda bp: first_use[bp[1]]):
        readers = list(ph.users)
        lo, hi = bucket.shard_range(program.rank)
        with graph.inserting_after(anchor):
            shard = call(graph, aten.slice.Tensor, ph, 0, lo, hi, phase=sig.COMM)
        with graph.inserting_after(shard):
            issued = call(
                graph, c10d.all_gather_into_tensor.default, shard, layout.world_size, program.group_name, phase=sig.COMM
            )
        with graph.inserting_after(issued):
            full = call(graph, c10d.wait_tensor.default, issued, phase=sig.COMM)
        for reader in readers:
            reader.replace_input_with(ph, full)
        _sink_views(full)
        anchor = full
    return program


def _first_compute_use(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> int:
    """Where the graph first computes on `node`, looking through views of it."""
    if node.target not in VIEW_OPS:
        return order[node]
    return min((_first_compute_use(u, order) for u in node.users), default=len(order))


def _sink_views(root: torch.fx.Node) -> None:
    """Move every view of `root` (and views of those) to just before its first reader, deepest
    first: a view then stands next to the op that computes on it, and so does its source."""
    chain, frontier = [], [root]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in VIEW_OPS and u not in chain:
                chain.append(u)
                frontier.append(u)
    order = position(root.graph)
    for view in sorted(chain, key=order.__getitem__, reverse=True):
        order = position(root.graph)
        if view.users:
            first = min(view.users, key=order.__getitem__)
            first.prepend(view)


def ensures(program: Program) -> None:
    layout = program.bucket_layout
    names = [b.name for b in layout.buckets]
    expect(
        program,
        NAME,
        not program.signature.output_names(sig.NEW_BUCKET),
        "no whole-bucket output (the step ends with shards)",
    )
    expect(
        program,
        NAME,
        program.signature.output_names(sig.NEW_BUCKET_SHARD) == names,
        f"one new-bucket-shard output per bucket, {names}",
    )
    gathers = [n for n in program.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    expect(
        program,
        NAME,
        len(gathers) == len(names),
        f"{len(names)} all-gathers at the head of the step, found {len(gathers)}",
    )
    inputs = input_nodes(program)
    for bucket in layout.buckets:
        readers = list(inputs[sig.InputSpec(sig.BUCKET, bucket.name)].users)
        ok = (
            len(readers) == 1 and readers[0].target is aten.slice.Tensor and all(u in gathers for u in readers[0].users)
        )
        expect(
            program,
            NAME,
            ok,
            f"{bucket.name} read only as this rank's shard, by its all-gather (the rest of it is stale)",
        )
