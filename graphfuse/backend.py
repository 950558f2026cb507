"""The torch.compile backend "graphfuse": forward and backward compiled by inductor through
AOTAutograd. When a `gf.shard_optimizer` owns the region's parameters, its backward graph packs
and reduce-scatters each bucket the region produces whole (graphfuse.backward_rewrite), and
hands the shards to that optimizer; the parameters' own gradients stay None."""

from __future__ import annotations

import importlib.metadata
import logging
import pathlib
import sys

import torch

from graphfuse.backward_rewrite import rewrite_backward
from graphfuse.errors import UnsupportedError
from graphfuse.inductor import active_workarounds, compile_graph
from graphfuse.sharded_optimizer import OPTIMIZERS, ShardedOptimizer, shard_optimizer
from graphfuse.update_program import capture_update

__all__ = ["ShardedOptimizer", "capture_update", "graphfuse_backend", "register", "shard_optimizer"]

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


def _partition(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partitioner: its joint-graph passes (random ops such as dropout are rewritten
    there), then the min-cut split into forward and backward."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return partition_fn(gm, joint_inputs, **kwargs)


class _Region:
    """One compiled region: its inputs' FQNs, and whether it was called with other parameters
    (a graph compiled once for a module class and reused for each instance)."""

    def __init__(self, opt: ShardedOptimizer, example_inputs: list, fqns: list[str | None]) -> None:
        self.opt, self.fqns = opt, fqns
        self.params = [(i, x) for i, (x, f) in enumerate(zip(example_inputs, fqns)) if f is not None]
        self.index = len(opt.regions)
        self.reused = self.rewritten = False
        opt.regions.append(frozenset(f for f in fqns if f is not None))

    def check(self, args) -> None:
        """At every forward call: the parameters the backward rewrite was decided for."""
        if all(args[i] is p for i, p in self.params):
            return
        if self.rewritten:
            raise UnsupportedError(
                "a region compiled by the graphfuse backend is called with other parameters than when its backward "
                "was compiled (one graph reused for several modules, e.g. a graph break inside a loop over blocks), "
                "so its gradient shards would be credited to the wrong buckets; move the graph break out of the loop, "
                "or build the optimizer with gf.shard_optimizer(..., reduce_in_backward=False)"
            )
        self.reused = True  # seen before the backward is compiled: it keeps the plain gradients

    def backward(self, gm: torch.fx.GraphModule, example_inputs):
        """Compile the backward with each whole bucket's reduce-scatter inside; the compiled
        function returns the gradients autograd expects (None for those buckets' parameters)
        and gives the shards to the optimizer. Compiled at the first backward, when every
        region of the forward is known: a parameter another region also reads keeps its
        bucket out."""
        opt, strategy = self.opt, self.opt.strategy
        buckets = []
        # Staged collectives (Gloo over CUDA tensors) stay in step(), where the passes stage them.
        if not self.reused and not strategy.stage_collectives_on_host:
            elsewhere = frozenset().union(*(r for i, r in enumerate(opt.regions) if i != self.index))
            args = (opt.layout, opt.group_name, strategy.max_inflight_collectives, strategy.master_dtype, elsewhere)
            buckets = rewrite_backward(gm, self.fqns, *args)
        self.rewritten = bool(buckets)
        opt.backward_graphs.append((gm, buckets))
        compiled = _inductor(gm, example_inputs, is_backward=True)
        log.debug("graphfuse backend: %d of %d buckets reduced in this backward", len(buckets), len(opt.layout.buckets))
        if not buckets:
            return compiled
        n = len(self.fqns)

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
    from torch._inductor.decomposition import select_decomp_table

    region = _Region(opt, example_inputs, fqns)
    compiled = aot_autograd(
        fw_compiler=_inductor,
        bw_compiler=region.backward,
        decompositions=select_decomp_table(),
        partition_fn=_partition,
    )(gm, example_inputs)

    def run(*args):
        region.check(args)
        return compiled(*args)

    return run


ENTRY_POINT = "[torch_dynamo_backends]\ngraphfuse = graphfuse.backend:graphfuse_backend\n"


class _SourceTreeDistribution(importlib.metadata.Distribution):
    """What `pip install` would declare for graphfuse, for a graphfuse imported from a source
    tree (PYTHONPATH): its name, version and torch_dynamo_backends entry point."""

    def read_text(self, filename: str) -> str | None:
        if filename == "entry_points.txt":
            return ENTRY_POINT
        if filename == "METADATA":
            from graphfuse import __version__

            return f"Metadata-Version: 2.1\nName: graphfuse\nVersion: {__version__}\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent.parent / path


class _SourceTreeFinder:
    """A sys.meta_path entry that finds no module, only graphfuse's distribution metadata."""

    @staticmethod
    def find_spec(*args, **kwargs) -> None:
        return None

    @staticmethod
    def find_distributions(context=None):
        if getattr(context, "name", None) in (None, "graphfuse"):
            yield _SourceTreeDistribution()


def register() -> None:
    """Make backend="graphfuse" known to torch.compile when graphfuse is not pip-installed.
    Installed, its entry point does it (and a second registration would make dynamo raise
    "duplicate name"). Not installed, graphfuse declares the same entry point through a
    metadata finder, which dynamo reads when it first looks a backend name up, so importing
    graphfuse does not import torch._dynamo (0.4 s); if dynamo has already read the entry
    points, the backend is registered directly."""
    if "graphfuse" in importlib.metadata.entry_points(group="torch_dynamo_backends").names:
        return
    sys.meta_path.append(_SourceTreeFinder())
    registry = sys.modules.get("torch._dynamo.backends.registry")
    if registry is not None and "graphfuse" not in registry._COMPILER_FNS:
        registry.register_backend(graphfuse_backend, name="graphfuse")
