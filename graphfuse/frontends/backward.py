"""The graph side of the torch.compile path: `rewrite_backward` packs and reduce-scatters, inside an
AOTAutograd backward graph, every bucket whose gradients that graph produces (the optimizer's
program then takes those shards as inputs: passes/shard_inputs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.fx

from graphfuse.ir.layout import BucketLayout
from graphfuse.passes.graph import aten, c10d, position


def _eligible(
    layout: BucketLayout, fqns: list[str | None], grads: list, elsewhere: set[str]
) -> tuple[list, dict[str, torch.fx.Node]]:
    """The buckets all of whose parameters get their gradient here (each parameter once), and
    none of which another compiled region also reads (its gradient would come in two parts)."""
    grad_of: dict[str, torch.fx.Node] = {}
    seen: set[str] = set()
    for fqn, g in zip(fqns, grads):
        if fqn is None:
            continue
        if fqn in seen:  # one parameter passed twice: AOTAutograd may merge its gradients
            grad_of.pop(fqn, None)
        elif isinstance(g, torch.fx.Node):
            grad_of[fqn] = g
        seen.add(fqn)
    whole = [b for b in layout.buckets if all(f in grad_of and f not in elsewhere for f in b.fqns)]
    return whole, grad_of


def _pack(graph: torch.fx.Graph, bucket, grad_of: dict, master: torch.dtype | None) -> torch.fx.Node:
    """The bucket's gradients and zero padding in one flat buffer (as passes/reduce_scatter.py)."""
    cast = master is not None and bucket.dtype != str(master).removeprefix("torch.")
    pieces = []
    for slot in bucket.slots:
        flat = graph.call_function(aten.reshape.default, (grad_of[slot.fqn], [-1]))
        if cast:
            flat = graph.call_function(aten._to_copy.default, (flat,), {"dtype": master})
        if slot.padding:  # after AOTAutograd ops are decomposed: new_zeros is not lowered, padding is
            flat = graph.call_function(aten.constant_pad_nd.default, (flat, [0, slot.padding], 0.0))
        pieces.append(flat)
    return pieces[0] if len(pieces) == 1 else graph.call_function(aten.cat.default, (pieces,))


def rewrite_backward(
    gm: torch.fx.GraphModule,
    fqns: list[str | None],
    layout: BucketLayout,
    group_name: str,
    inflight: int | None,
    master: torch.dtype | None = None,
    elsewhere: frozenset[str] = frozenset(),
) -> list[int]:
    """Rewrite the backward graph `gm` (outputs: one gradient per forward input, whose FQNs are
    `fqns`, None for a non-parameter): each bucket whose gradients all come from this graph is
    packed and reduce-scattered right after its last gradient, waited for as late as `inflight`
    collectives in flight allow, and appended to the outputs; its parameters' gradients become
    None. A bucket with a parameter in `elsewhere` (read by another compiled region) is left
    alone. Returns the buckets' indices in the order of the appended outputs."""
    graph = gm.graph
    out = graph.output_node()
    # a backward graph returns a tuple: one gradient (or None) per forward input
    grads = list(cast(Sequence[torch.fx.Node | None], out.args[0]))
    if len(grads) != len(fqns):  # not the one-gradient-per-input form this rewrite knows
        return []
    buckets, grad_of = _eligible(layout, fqns, grads, set(elsewhere))
    order = position(graph)
    buckets.sort(key=lambda b: max(order[grad_of[f]] for f in b.fqns))
    pending: list[int]  # indices into shards
    world, pending, shards = layout.world_size, [], []  # pending: issued, not yet waited for
    for bucket in buckets:
        last = max((grad_of[f] for f in bucket.fqns), key=order.__getitem__)
        with graph.inserting_before(last.next):  # new nodes in order, right after `last`
            packed = _pack(graph, bucket, grad_of, master)
            if world == 1:
                shards.append(packed)
                continue
            while inflight is not None and len(pending) >= inflight:  # Gloo: one at a time
                i = pending.pop(0)
                shards[i] = graph.call_function(c10d.wait_tensor.default, (shards[i],))
            shards.append(graph.call_function(c10d.reduce_scatter_tensor.default, (packed, "avg", world, group_name)))
            pending.append(len(shards) - 1)
        order = position(graph)
    with graph.inserting_before(out):  # the rest waited for as late as possible
        for i in pending:
            shards[i] = graph.call_function(c10d.wait_tensor.default, (shards[i],))
    reduced = {f for b in buckets for f in b.fqns}
    new = [None if f in reduced else g for f, g in zip(fqns, grads)]
    out.args = (tuple(new) + tuple(shards),)
    gm.recompile()
    return [b.index for b in buckets]
