"""`DistModel`: owns the buckets, shards and buffers across steps, feeds the program one
batch at a time, and writes its outputs back in place so every view stays valid."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.capture import batch_key, capture, flatten_batch, program_batch_key
from graphfuse.errors import UnsupportedError
from graphfuse.guards import ProgramCache, Snapshot, batch_change, check_batch
from graphfuse.inductor import compile_graph
from graphfuse.layout import BucketLayout
from graphfuse.param_state import ParamState, destination, gather_shards
from graphfuse.passes import run_pipeline, verify
from graphfuse.passes._graph import is_collective
from graphfuse.passes.sharded_update import MASTER
from graphfuse.program import Program
from graphfuse.startup import Phases
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")


def group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int, str]:
    """(group, world size, rank, group name); world size 1 with no process group."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0, ""
        group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group), group.group_name


def backend_of(group: dist.ProcessGroup | None, device_type: str) -> str | None:
    """The backend that runs `group`'s collectives on `device_type` tensors (None: no group)."""
    if group is None:
        return None
    backend = str(dist.get_backend(group))
    if ":" in backend:  # a group of several backends, "cpu:gloo,cuda:nccl"
        return dict(b.split(":", 1) for b in backend.split(",")).get(device_type)
    return backend


def rebind_group(program: Program, group_name: str) -> Program:
    """The same program with its collectives on the process group named `group_name` (a
    restarted job's group may be named differently from the one the program was built on)."""
    gm = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
    for node in gm.graph.nodes:
        if is_collective(node):
            node.args = tuple(group_name if a == program.group_name else a for a in node.args)
    gm.recompile()
    return program.with_(graph_module=gm, group_name=group_name)


def bind_tensors(
    program: Program,
    params: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """Allocate the program's buckets and shards, fill them from `params`, and point every
    parameter at its view in its bucket. Returns every persistent input by name."""
    layout, tensors = program.layout, {}
    buckets = {b.name: b for b in layout.buckets}
    with torch.no_grad():
        for bucket in layout.buckets:
            device = params[bucket.slots[0].fqn].device
            flat = torch.zeros(bucket.size, dtype=getattr(torch, bucket.dtype), device=device)
            for s in bucket.slots:
                flat[slice(*s.data_range)].copy_(params[s.fqn].detach().reshape(-1))
            if layout.world_size > 1:  # every rank starts from rank 0's weights, as DDP does
                dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
            for s in bucket.slots:
                params[s.fqn].data = flat[slice(*s.data_range)].view(s.shape)
            tensors[bucket.name] = flat
        for spec in program.signature.inputs:
            m = program.inputs_meta[spec.name]
            dtype = getattr(torch, m.dtype)
            if spec.role == sig.SHARD:
                bucket_name, what = spec.name.split(".", 1)
                flat = tensors[bucket_name]
                if what == MASTER:
                    lo, hi = buckets[bucket_name].shard_range(program.rank)
                    tensors[spec.name] = flat[lo:hi].to(dtype, copy=True)
                else:
                    tensors[spec.name] = torch.zeros(m.shape, dtype=dtype, device=flat.device)
            elif spec.role == sig.FROZEN:
                tensors[spec.name] = params[spec.name].detach()
            elif spec.role == sig.BUFFER:
                tensors[spec.name] = buffers[spec.name]
            elif spec.role == sig.SCALAR:
                tensors[spec.name] = torch.zeros((), dtype=dtype)  # host scalars stay on the CPU
    return tensors


def arguments(program: Program, tensors: dict[str, torch.Tensor], per_call: list[torch.Tensor]) -> list[torch.Tensor]:
    """The program's inputs in order: persistent tensors by name, and the per-call tensors
    (batch leaves, or gradients for an update-only program) in their order."""
    it = iter(per_call)
    return [next(it) if spec.role in (sig.BATCH, sig.GRAD) else tensors[spec.name] for spec in program.signature.inputs]


def run_step(
    program: Program,
    fn: Callable,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    steps: list[int],
    per_call: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Fill the host scalars of step `steps`, run the program, and copy every output into the
    input it replaces. All outputs exist before any state is written: a failed step changes nothing."""
    for g, (spec, group) in enumerate(zip(program.optim.groups, param_groups)):
        gopt.check_group_unchanged(spec, group, g)  # all groups first: a refused step writes nothing
    for g, (spec, group) in enumerate(zip(program.optim.groups, param_groups)):
        values = spec.host_scalars(float(group["lr"]), float(group.get("weight_decay", 0.0)), steps[g])
        for name, value in values.items():
            tensors[f"group{g}.{name}"].fill_(value)
    # Grad mode on, as the step was traced: some kernels differ with it off (oneDNN's LSTM,
    # mkldnn_rnn_layer, returns no workspace for its backward). No input requires grad, so
    # autograd records nothing.
    with torch.enable_grad():
        outs = fn(*arguments(program, tensors, per_call))
    with torch.no_grad():
        if not getattr(fn, "writes_in_place", False):
            for spec, out in zip(program.signature.outputs, outs):
                if spec.target is not None:
                    destination(program, tensors, spec).copy_(out)
    return outs


def compile_in_place(program: Program, example_inputs: list[torch.Tensor]) -> Callable:
    """Compile the program with inductor after appending `copy_` of every output into the input
    it replaces, so inductor writes new buckets and shards straight into their storage (one
    read and one write per element) instead of returning new tensors the runtime must copy."""
    gm = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
    graph = gm.graph
    inputs = {s.name: n for s, n in zip(program.signature.inputs, (n for n in graph.nodes if n.op == "placeholder"))}
    out = graph.output_node()
    results = list(out.args[0])
    with graph.inserting_before(out):
        for spec, node in zip(program.signature.outputs, results):
            if spec.role == sig.NEW_BUCKET_SHARD:
                bucket = next(b for b in program.layout.buckets if b.name == spec.target)
                into = graph.call_function(torch.ops.aten.slice.Tensor, (inputs[spec.target], 0, *bucket.shard_range(program.rank)))
                graph.call_function(torch.ops.aten.copy_.default, (into, node))
            elif spec.target is not None:
                graph.call_function(torch.ops.aten.copy_.default, (inputs[spec.target], node))
    out.args = (tuple(r for s, r in zip(program.signature.outputs, results) if s.target is None),)
    gm.recompile()
    compiled = compile_graph(gm, example_inputs)

    def run(*args):
        return compiled(*args)

    run.writes_in_place = True
    return run


class DistModel:
    """A model, its optimizer and loss compiled into one fused, sharded training step.

    `dm(batch)` runs one step and returns the loss. The model's parameters are views into
    the buckets, so the model always shows the current weights; the learning rate (and
    AdamW's weight decay) are read from `optimizer.param_groups` at every step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        example_batch,
        strategy: Strategy | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.group, self.world_size, self.rank, self.group_name = group_info(group)
        device = next(model.parameters(), torch.empty(0)).device.type
        self.strategy = (strategy or Strategy()).for_backend(backend_of(self.group, device), device)
        self.params, self.startup = ParamState(), Phases()
        key = batch_key(example_batch)
        check_batch(key)
        self._start(self._build(example_batch), key)

    @classmethod
    def from_program(
        cls,
        program: Program,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
    ) -> DistModel:
        """Run a saved `program` (see gf.load_program) without tracing the model again.

        `model` and `optimizer` are freshly built, as for gf.compile: the model's parameters
        become views into the program's buckets and the optimizer's param groups give the
        learning rate. Restore training state afterwards with gf.load or load_state_dict.
        """
        self = cls.__new__(cls)
        self.model, self.optimizer, self.loss_fn = model, optimizer, None
        self.strategy = program.strategy
        self.params, self.startup = ParamState(), Phases()
        self.group, self.world_size, self.rank, self.group_name = group_info(group)
        if (self.world_size, self.rank) != (program.world_size, program.rank):
            raise UnsupportedError(
                f"the program was built for rank {program.rank} of {program.world_size}, but this process is "
                f"rank {self.rank} of {self.world_size}; load the program saved by this rank, or rebuild with gf.compile"
            )
        params = dict(model.named_parameters())
        for bucket in program.layout.buckets:
            for s in bucket.slots:
                p = params.get(s.fqn)
                if p is None or tuple(p.shape) != s.shape or str(p.dtype).removeprefix("torch.") != bucket.dtype:
                    raise UnsupportedError(
                        f"the program expects parameter {s.fqn} of shape {s.shape} and dtype {bucket.dtype}; "
                        f"the model has {None if p is None else (tuple(p.shape), p.dtype)}"
                    )
        if [g.params for g in program.optim.groups] != [
            tuple(n for p in grp["params"] for n, q in params.items() if q is p and q.requires_grad) for grp in optimizer.param_groups
        ]:
            raise UnsupportedError("the optimizer's param groups do not hold the parameters the program was traced with")
        if program.group_name != self.group_name:
            program = rebind_group(program, self.group_name)
        self._start(program, program_batch_key(program))
        return self

    def _start(self, program: Program, key: tuple) -> None:
        with self.startup.time("bind"):
            self._bind(program)
        self._snapshot = Snapshot(self.model, self.optimizer)  # checked at every step: changes are not ignored
        self.steps = [0] * len(program.optim.groups)
        self.program = program
        self._example_key = key
        # batch key -> (program, its executable; None until the first step compiles it)
        self._programs = ProgramCache(self.strategy.program_cache_size)
        self._programs[key] = (program, self._eager(program))
        self.params.start(program, self.model)

    @property
    def layout(self) -> BucketLayout:
        return self.program.layout

    # ---- building -------------------------------------------------------------------
    def _build(self, batch) -> Program:
        with self.params.tracing(), self.startup.time("capture"):
            program = capture(self.model, self.optimizer, self.loss_fn, batch, self.strategy)
        program = program.with_(world_size=self.world_size, rank=self.rank, group_name=self.group_name)
        with self.startup.time("passes"):
            program = run_pipeline(program)
        with self.startup.time("verify"):
            return verify(program)


    def _eager(self, program: Program) -> Callable | None:
        """The program's executable if it runs eagerly; None if inductor compiles it at the
        first step, for that batch's devices and strides."""
        return program.graph_module if self.strategy.compile == "eager" else None

    def _bind(self, program: Program) -> None:
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        self.tensors: dict[str, torch.Tensor] = bind_tensors(program, params, buffers, self.group)

    # ---- running --------------------------------------------------------------------
    def _program_for(self, batch, key: tuple) -> tuple[Program, Callable | None]:
        entry = self._programs.get(key)
        if entry is not None:
            return entry
        check_batch(key)
        change = batch_change(self._example_key, key)
        if self.loss_fn is None:
            raise UnsupportedError(
                f"this DistModel runs a loaded program traced for one batch shape; this batch differs ({change}), "
                "and without the model's loss_fn it cannot be traced again: feed batches like the traced one"
            )
        log.warning("graphfuse: the batch differs from every traced one (from the example: %s); re-capturing the step", change)
        try:
            program = self._build(batch)
        except Exception as e:
            e.add_note(f"graphfuse: raised while re-capturing the step for a batch that differs from the example ({change})")
            raise
        if program.layout.fingerprint != self.layout.fingerprint:
            fix = "cast the batch to the example's dtypes" if "dtype" in change else "pad batches to the example's shapes"
            raise UnsupportedError(
                f"re-capturing the step for a batch that differs from the example ({change}) gave a different bucket "
                f"layout (its backward produces the gradients in another order), so it cannot share the buckets; {fix}"
            )
        self._programs[key] = entry = (program, self._eager(program))
        return entry

    def __call__(self, batch) -> torch.Tensor:
        self._snapshot.check()
        key, leaves = flatten_batch(batch)
        program, fn = self._program_for(batch, key)
        if fn is None:
            with self.startup.time("inductor"):
                fn = compile_in_place(program, arguments(program, self.tensors, leaves))
            self._programs[key] = (program, fn)
        steps = [s + 1 for s in self.steps]
        first = "first step" not in self.startup
        with self.startup.time("first step") if first else contextlib.nullcontext():
            outs = run_step(program, fn, self.tensors, self.optimizer.param_groups, steps, leaves)
        if first:
            log.info("graphfuse: first step: %s", self.startup.format(("inductor", "first step")))
        self.steps = steps
        self.params.stale = self.params.deferred  # other ranks' ranges of the buckets are a step old
        self.optimizer._opt_called = True  # the optimizer has stepped: LR schedulers check this
        return outs[0]

    step = __call__

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self, mode: str | None = None) -> dict:
        """The training state in checkpoint `mode` (default: strategy.checkpoint_mode)."""
        from graphfuse import checkpoint

        self.sync()
        return checkpoint.state_dict(self, mode)

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy `state_dict` into the live buffers, after validating all of it."""
        from graphfuse import checkpoint

        checkpoint.load_state_dict(self, state_dict)
        self.loaded()

    # ---- views ----------------------------------------------------------------------
    def named_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's `slice@<fqn>` views: the parameter's data in the bucket shard, and
        `slice@<fqn>.<state>` in every state shard (and `.master`), padding excluded. Current
        without `sync()` (a rank's own shard is always current), so no collective runs here."""
        for bucket in self.layout.buckets:
            shards = [n for n in self.tensors if n.startswith(bucket.name + ".")]
            for s in bucket.slices(self.rank):
                yield f"slice@{s.fqn}", self.tensors[bucket.name][slice(*bucket.bucket_range(self.rank, s))]
                for name in shards:
                    yield f"slice@{s.fqn}.{name.split('.', 1)[1]}", self.tensors[name][slice(*s.shard_range)]

    # ---- deferred parameter all-gather (Strategy.overlap_param_gather) ----------------
    def sync(self) -> None:
        """Make the model's parameters current. A step with `Strategy.overlap_param_gather` ends
        with only this rank's shard of each bucket updated (the next step gathers them at its
        head); this all-gathers them into the buckets now. A collective: call it on every rank.
        Returns at once when nothing is stale (every step without deferral, or called twice)."""
        if self.params.stale:
            gather_shards(self.program, self.tensors, self.group, host=self.strategy.stage_collectives_on_host is True)
            self.params.stale = False

    def loaded(self) -> None:
        """Training state was copied in (load_state_dict, gf.load): this rank's shards are
        current; other ranks' ranges are gathered by the next sync or step."""
        self.params.stale = self.params.deferred
