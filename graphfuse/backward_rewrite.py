"""The graph side of the torch.compile path: `rewrite_backward` packs and reduce-scatters, inside an
AOTAutograd backward graph, every bucket whose gradients that graph produces; `ShardInputs` is the
reduce-scatter pass of the optimizer's program for the buckets whose shards come from a backward."""

from __future__ import annotations

import torch
import torch.fx

from graphfuse import signature as sig
from graphfuse.errors import PassContractError
from graphfuse.layout import BucketLayout
from graphfuse.passes import reduce_scatter
from graphfuse.passes.graph import add_input, aten, c10d, input_nodes, position, remove_input, sync_inputs
from graphfuse.program import Program, TensorMeta

SHARD_SUFFIX = ".grad_shard"  # "bucket<b>.grad_shard": a bucket's averaged gradient shard, as an input


def _eligible(layout: BucketLayout, fqns: list[str | None], grads: list, elsewhere: set[str]) -> tuple[list, dict[str, torch.fx.Node]]:
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
    grads = list(out.args[0])
    if len(grads) != len(fqns):  # not the one-gradient-per-input form this rewrite knows
        return []
    buckets, grad_of = _eligible(layout, fqns, grads, set(elsewhere))
    order = position(graph)
    buckets.sort(key=lambda b: max(order[grad_of[f]] for f in b.fqns))
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


class ShardInputs:
    """reduce_scatter, except that the buckets `buckets` take their averaged gradient shard as an
    input ("bucket<b>.grad_shard", made by a compiled backward) instead of packing gradients."""

    NEEDS = reduce_scatter.NEEDS
    PROVIDES = reduce_scatter.PROVIDES

    def __init__(self, buckets: frozenset[int]) -> None:
        self.buckets = buckets
        self.NAME = "reduce_scatter"  # the same place in the pipeline; contracts name it so

    def applies(self, program: Program) -> bool:
        return True

    def requires(self, program: Program) -> None:
        reduce_scatter.requires(program)

    def run(self, program: Program) -> Program:
        program = reduce_scatter.run(program)
        shards = list(program.handoffs.grad_shards)
        for i, bucket in enumerate(program.layout.buckets):
            if bucket.index not in self.buckets:
                continue
            spec = sig.InputSpec(sig.GRAD, bucket.name + SHARD_SUFFIX)
            device = program.inputs_meta[bucket.name].device
            node = add_input(program, spec, TensorMeta((bucket.shard_size,), _shard_dtype(program, bucket), device))
            shards[i].replace_all_uses_with(node)
            _erase_upwards(shards[i])
            shards[i] = node
        # The per-parameter update still reads the gradients until sharded_update runs:
        # drop_unused_gradients removes them after the pipeline.
        return sync_inputs(program).handing_off(grad_shards=tuple(shards))

    def ensures(self, program: Program) -> None:
        names = {s.name for s in program.signature.inputs}
        missing = [b.name for b in program.layout.buckets if b.index in self.buckets and b.name + SHARD_SUFFIX not in names]
        if missing:
            raise PassContractError(f"pass {self.NAME} (shard inputs): no gradient shard input for {missing}")


def drop_unused_gradients(program: Program) -> Program:
    """The program without the gradient inputs nothing reads (those of buckets whose shards are inputs)."""
    for spec, node in list(input_nodes(program).items()):
        if spec.role == sig.GRAD and not node.users and not spec.name.endswith(SHARD_SUFFIX):
            remove_input(program, node)
    program.graph_module.recompile()
    return sync_inputs(program)


def _shard_dtype(program: Program, bucket) -> str:
    master = program.strategy.master_dtype
    return bucket.dtype if master is None else str(master).removeprefix("torch.")


def _erase_upwards(node: torch.fx.Node) -> None:
    """Erase `node` and every input left without users (the packing and the collective)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op == "placeholder":
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
