"""The torch.compile backend "graphfuse": forward and backward compiled by inductor through
AOTAutograd. When a `gf.shard_optimizer` owns the region's parameters, its backward graph packs
and reduce-scatters each bucket the region produces whole (graphfuse.frontends.backward), and
hands the shards to that optimizer; the parameters' own gradients stay None."""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Callable

import torch
from torch._guards import CompileContext, TracingContext, compile_context, detect_fake_mode, tracing

from graphfuse.capture.update import capture_update
from graphfuse.compiler.inductor import active_workarounds, compile_graph
from graphfuse.errors import UnsupportedError
from graphfuse.frontends.backward import rewrite_backward
from graphfuse.frontends.sharded_optimizer import OPTIMIZERS, ShardedOptimizer, shard_optimizer
from graphfuse.ranks import refuse_ddp

__all__ = ["ShardedOptimizer", "capture_update", "graphfuse_backend", "shard_optimizer"]

log = logging.getLogger("graphfuse")


_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (its params, {id: FQN})


def _fqn_by_id(opt: ShardedOptimizer) -> dict[int, str]:
    """`opt`'s parameters by identity, built once per optimizer: the dispatch looks owners up
    at call time, once per call in a graph reused for several blocks."""
    cached = _IDS.get(opt)
    if cached is None or cached[0] is not opt.params:
        cached = _IDS[opt] = (opt.params, {id(p): n for n, p in opt.params.items()})
    return cached[1]


def _owner(inputs) -> tuple[ShardedOptimizer | None, list[str | None]]:
    """The newest sharded optimizer that owns parameters among the inputs, and every input's FQN."""
    for ref in reversed(OPTIMIZERS):
        opt = ref()
        if opt is None or not opt.reduce_in_backward:
            continue
        fqn = _fqn_by_id(opt)
        names = [fqn.get(id(x)) for x in inputs]
        if any(n is not None for n in names):
            return opt, names
    return None, []


def _inductor(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._inductor.config as config
    from torch._inductor.compile_fx import compile_fx_inner

    with config.patch(active_workarounds()):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _partition(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partitioner: its joint-graph passes (random ops such as dropout are rewritten
    there), then the min-cut split into forward and backward."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return partition_fn(gm, joint_inputs, **kwargs)


def _inference(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """AOTAutograd's compiler for a graph without backward (a call under no_grad): no partitioner
    runs, so inductor's joint-graph passes run here first, as backend="inductor" runs them for
    such a graph; random ops (dropout in a validation pass without eval()) are rewritten there,
    and inductor cannot lower them otherwise ("should have been handled in replace_random.py")."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        gm = _recursive_joint_graph_passes(gm)
    return _inductor(gm, example_inputs, **kwargs)


class _Owner:
    """What one region does for the parameters of one optimizer (None: parameters no sharded
    optimizer owns, e.g. an evaluation copy): the inputs' FQNs, whether the region was called
    with other parameters of that optimizer (a graph compiled once for a module class and
    reused for each block), and the backward compiled for it. Holds the optimizer and its
    parameters weakly, so a model and optimizer dropped in a notebook are freed."""

    def __init__(self, opt: ShardedOptimizer | None, inputs, fqns: list[str | None]) -> None:
        self.fqns = fqns
        self.opt = weakref.ref(opt) if opt is not None else None
        self.params = [(i, weakref.ref(x)) for i, (x, f) in enumerate(zip(inputs, fqns)) if f is not None]
        self.reused = self.rewritten = False
        self.backward = None  # compiled at this owner's first backward call
        # A region under no_grad never runs a backward: it must not keep buckets out of the others.
        self.index = -1
        if opt is not None and torch.is_grad_enabled():
            self.index = len(opt.regions)
            opt.regions.append(frozenset(f for f in fqns if f is not None))

    def optimizer(self) -> ShardedOptimizer | None:
        return self.opt() if self.opt is not None else None

    def alive(self) -> bool:
        return self.opt is None or self.opt() is not None

    def matches(self, args) -> bool:
        """Called with exactly the parameters this owner was first called with."""
        return bool(self.params) and all(args[i] is p() for i, p in self.params)

    def check(self, args) -> None:
        """At every forward call with this optimizer's parameters: the parameters the backward
        rewrite was decided for."""
        if self.opt is None or self.matches(args):
            return
        if self.rewritten:
            i = next(i for i, p in self.params if args[i] is not p())
            now = _fqn_by_id(self.opt()).get(id(args[i]), "a tensor it does not own")
            raise UnsupportedError(
                f"a region compiled by the graphfuse backend is called with other parameters of the same "
                f"gf.shard_optimizer than when its backward was compiled ({now} where it had {self.fqns[i]}): "
                f"one graph "
                "reused for several modules of one model, e.g. a graph break inside a loop over blocks, so its "
                "gradient shards would be credited to the wrong buckets; move the graph break out of the loop, or "
                "build the optimizer with gf.shard_optimizer(..., reduce_in_backward=False)"
            )
        self.reused = True  # seen before the backward is compiled: it keeps the plain gradients

    def compile_backward(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        """Compile the backward with each whole bucket's reduce-scatter inside; the compiled
        function returns the gradients autograd expects (None for those buckets' parameters)
        and gives the shards to the optimizer. Compiled at this owner's first backward, when
        every region of its forward is known: a parameter another region also reads keeps its
        bucket out."""
        opt = self.optimizer()
        buckets = []
        # Staged collectives (Gloo over CUDA tensors) stay in step(), where the passes stage them.
        if opt is not None and not self.reused and not opt.strategy.stage_collectives_on_host:
            strategy = opt.strategy
            elsewhere = frozenset().union(*(r for i, r in enumerate(opt.regions) if i != self.index))
            args = (opt.layout, opt.group_name, strategy.max_inflight_collectives, strategy.master_dtype, elsewhere)
            buckets = rewrite_backward(gm, self.fqns, *args)
        self.rewritten = bool(buckets)
        if opt is not None:
            opt.backward_graphs.append((gm, buckets))
        compiled = _inductor(gm, example_inputs, is_backward=True)
        if opt is not None:
            log.debug(
                "graphfuse backend: %d of %d buckets reduced in this backward", len(buckets), len(opt.layout.buckets)
            )
        if not buckets:
            return compiled
        n, ref = len(self.fqns), self.opt

        def run(args):
            outs = compiled(args)
            owner = ref()
            if owner is not None:  # dropped since: nobody will step with these shards
                owner.receive_shards(buckets, outs[n:])
            return list(outs[:n])

        run._boxed_call = True
        return run


_BACKWARD = threading.local()  # .owner: (region, _Owner) of the backward about to run on this thread


class _Region:
    """One graph dynamo compiled, for every model that runs it: dynamo reuses a graph for a second
    instance of a module class (a second model in a notebook, an evaluation copy, a restart in
    the same process), calling it with that instance's parameters. The forward is compiled once
    (it does not depend on who owns the parameters); the backward is compiled once per owner,
    each rewritten for its own optimizer's buckets. Each forward call finds its owner from the
    parameters passed, and tags its autograd node, so that the backward of that call runs the
    owner's variant."""

    def __init__(
        self, gm: torch.fx.GraphModule, example_inputs: list, opt: ShardedOptimizer, fqns: list[str | None]
    ) -> None:
        # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        self.owners = [_Owner(opt, example_inputs, fqns)]
        self.last = self.owners[0]
        self.graph = self.graph_inputs = self.contexts = None  # the backward, kept at its first compile
        _load_inductor_lowering()
        self.compiled = aot_autograd(
            fw_compiler=_inductor,
            bw_compiler=self.backward,
            inference_compiler=_inference,
            decompositions=select_decomp_table(),
            partition_fn=_partition,
        )(gm, example_inputs)

    def __call__(self, *args):
        owner = self.owner_of(args)
        owner.check(args)
        outs = self.compiled(*args)
        if torch.is_grad_enabled():
            self.tag(outs, args, owner)
        return outs

    def owner_of(self, args) -> _Owner:
        """The owner of the parameters `args` holds (fast: the last call's owner, by identity);
        a new optimizer (or none) gets its own owner entry."""
        if self.last.matches(args):
            return self.last
        opt, fqns = _owner(args)
        for owner in self.owners:
            if owner.alive() and owner.optimizer() is opt:
                self.last = owner
                return owner
        self.owners = [o for o in self.owners if o.alive()]
        self.last = _Owner(opt, args, fqns)
        self.owners.append(self.last)
        return self.last

    def tag(self, outs, args, owner: _Owner) -> None:
        """Mark this call's autograd node (AOTAutograd's CompiledFunctionBackward) so that its
        backward runs `owner`'s variant: a prehook runs on the thread that then runs the node."""

        def hook(grad_outputs):
            _BACKWARD.owner = (self, owner)

        for node in _compiled_nodes(outs, args):
            node.register_prehook(hook)

    def backward(self, gm: torch.fx.GraphModule, example_inputs):
        """AOTAutograd's backward compiler, called once: keep the backward graph (each owner's
        variant is compiled from a copy of it, in the context AOTAutograd compiles it in) and
        return the function that runs the variant of the owner whose node is running."""
        self.graph, self.graph_inputs = copy.deepcopy(gm), example_inputs
        self.contexts = (TracingContext.try_get(), CompileContext.try_get())

        def run(args):
            return self.variant(self.running())(args)

        run._boxed_call = True
        return run

    def running(self) -> _Owner:
        """The owner whose backward is running now, from the tag its forward call left."""
        region, owner = getattr(_BACKWARD, "owner", (None, None))
        _BACKWARD.owner = (None, None)
        if region is self:
            return owner
        live = [o for o in self.owners if o.alive()]
        if len(live) == 1:
            return live[0]
        raise UnsupportedError(
            "the graphfuse backend cannot tell which model a backward of a region belongs to (no output of its "
            "forward call carried AOTAutograd's node) while the region serves several models; build the optimizers "
            "with gf.shard_optimizer(..., reduce_in_backward=False), and please report the model in an issue"
        )

    def variant(self, owner: _Owner) -> Callable:
        """`owner`'s compiled backward, compiled at its first call from a copy of the graph."""
        if owner.backward is None:
            tracing_context, compile_ctx = self.contexts
            with tracing(tracing_context), compile_context(compile_ctx):
                owner.backward = owner.compile_backward(copy.deepcopy(self.graph), self.graph_inputs)
        return owner.backward


def _compiled_nodes(outs, args) -> set:
    """The CompiledFunctionBackward node a compiled call created: the grad_fn of its outputs, or
    one step behind an output AOTAutograd rebuilt as a view; never an input's own node (an
    output aliasing an input leads there)."""
    upstream = {a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    nodes = set()
    for out in outs if isinstance(outs, (list, tuple)) else (outs,):
        fn = getattr(out, "grad_fn", None) if isinstance(out, torch.Tensor) else None
        if fn is None:
            continue
        behind = [] if fn.name() == "CompiledFunctionBackward" else [n for n, _ in fn.next_functions if n is not None]
        nodes.update(n for n in (fn, *behind) if n.name() == "CompiledFunctionBackward" and n not in upstream)
    return nodes


def _load_inductor_lowering() -> None:
    """Import inductor's lowering module before AOTAutograd traces with inductor's decomposition
    table: some of its decompositions look a lowering up as `torch._inductor.lowering.<name>`
    (max_pool2d's asks `should_fallback_max_pool_with_indices`) without importing it. Under
    backend="inductor" it is always loaded, since `torch._inductor.compile_fx` imports it (through
    `.graph`) before the table is used; here nothing else would, and any model with a max pool
    failed with "module 'torch._inductor' has no attribute 'lowering'"."""
    import torch._inductor.lowering  # noqa: F401  (lazy for the reason above: loads inductor)


def graphfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """torch.compile backend "graphfuse": inductor for forward and backward; with a
    `gf.shard_optimizer(optimizer, model=model)` built before the first call, the backward
    reduce-scatters each bucket as soon as its last gradient exists."""
    refuse_ddp(lambda params: _owner(params)[0] is not None)  # DDP around the model: refused, not ignored
    opt, fqns = _owner(example_inputs)
    if opt is None:
        return compile_graph(gm, example_inputs)
    region = _Region(gm, example_inputs, opt, fqns)

    def run(*args):
        return region(*args)

    return run
