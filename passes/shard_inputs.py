"""ShardInputs: the reduce_scatter pass of the optimizer's program (gf.shard_optimizer) for the
buckets whose averaged gradient shards come from a compiled backward (frontends/backward.py)
instead of being packed and reduce-scattered in the update's own graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from graphfuse.errors import PassContractError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta

from . import reduce_scatter
from ._contract import always
from .graph import add_input, input_nodes, remove_input, sync_inputs

SHARD_SUFFIX = ".grad_shard"  # "bucket<b>.grad_shard": a bucket's averaged gradient shard, as an input


@dataclass(frozen=True)
class ShardInputs:
    """A `Pass` (passes/_contract.py): reduce_scatter, except that the buckets `buckets` take their
    averaged gradient shard as an input ("bucket<b>.grad_shard", made by a compiled backward)
    instead of packing gradients."""

    buckets: frozenset[int]
    NAME: str = field(default="reduce_scatter", init=False)  # the same place in the pipeline; contracts name it so
    NEEDS = reduce_scatter.NEEDS
    PROVIDES = reduce_scatter.PROVIDES

    applies = staticmethod(always)  # every program

    def requires(self, program: Program) -> None:
        reduce_scatter.requires(program)

    def run(self, program: Program) -> Program:
        program = reduce_scatter.run(program)
        handed = program.handoffs.grad_shards
        assert handed is not None  # reduce_scatter.run just set them
        shards = list(handed)
        for i, bucket in enumerate(program.bucket_layout.buckets):
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
        missing = [
            b.name
            for b in program.bucket_layout.buckets
            if b.index in self.buckets and b.name + SHARD_SUFFIX not in names
        ]
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
