"""The torch.compile backend "graphfuse": forward and backward compiled by inductor through
AOTAutograd. When a `gf.shard_optimizer` owns the region's parameters, its backward graph packs
and reduce-scatters each bucket the region produces whole (graphfuse.backward_rewrite), and
hands the shards to that optimizer; the parameters' own gradients stay None."""

from __future__ import annotations

import functools
import logging

import torch

from graphfuse.backward_rewrite import rewrite_backward
from graphfuse.inductor import active_workarounds, compile_graph
from graphfuse.sharded_optimizer import OPTIMIZERS, ShardedOptimizer, shard_optimizer
from graphfuse.update_program import capture_update

__all__ = ["ShardedOptimizer", "capture_update", "graphfuse_backend", "shard_optimizer"]

log = logging.getLogger("graphfuse")


def _owner(example_inputs: list) -> tuple[ShardedOptimizer | None, list[str | None]]:
    """The newest sharded optimizer that owns parameters among the inputs, and every input's FQN."""
    for ref in reversed(OPTIMIZERS):
        opt = ref()
        if opt is None or not opt.reduce_in_backward:
            continue
        fqn = {id(p): n for n, p in opt.params.items()}
        names = [fqn.get(id(x)) for x in example_inputs]
        if any(n is not None for n in names):
            return opt, names
    return None, []


def _inductor(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    import torch._inductor.config as config
    from torch._inductor.compile_fx import compile_fx_inner

    with config.patch(active_workarounds()):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _backward(opt: ShardedOptimizer, region: int, fqns: list[str | None], gm: torch.fx.GraphModule, example_inputs):
    """Compile the backward with each whole bucket's reduce-scatter inside; the compiled
    function returns the gradients autograd expects (None for those buckets' parameters)
    and gives the shards to `opt`. Compiled at the first backward, when every region of the
    forward is known: a parameter another region also reads keeps its bucket out."""
    elsewhere = frozenset().union(*(r for i, r in enumerate(opt.regions) if i != region))
    strategy = opt.strategy
    buckets = rewrite_backward(gm, fqns, opt.layout, opt.group_name, strategy.max_inflight_collectives, strategy.master_dtype, elsewhere)
    opt.backward_graphs.append((gm, buckets))
    compiled = _inductor(gm, example_inputs, is_backward=True)
    log.debug("graphfuse backend: %d of %d buckets reduced in this backward", len(buckets), len(opt.layout.buckets))
    if not buckets:
        return compiled
    n = len(fqns)

    def run(args):
        outs = compiled(args)
        opt.receive_shards(buckets, outs[n:])
        return list(outs[:n])

    run._boxed_call = True
    return run


def graphfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """torch.compile backend "graphfuse": inductor for forward and backward; with a
    `gf.shard_optimizer(optimizer, model=model)` built before the first call, the backward
    reduce-scatters each bucket as soon as its last gradient exists."""
    opt, fqns = _owner(example_inputs)
    if opt is None:
        return compile_graph(gm, example_inputs)
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    opt.regions.append(frozenset(f for f in fqns if f is not None))
    return aot_autograd(
        fw_compiler=_inductor,
        bw_compiler=functools.partial(_backward, opt, len(opt.regions) - 1, fqns),
        decompositions=select_decomp_table(),
        partition_fn=min_cut_rematerialization_partition,
    )(gm, example_inputs)
