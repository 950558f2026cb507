"""`DistModel`: owns the buckets, shards and buffers across steps, feeds the program one
batch at a time, and writes its outputs back in place so every view stays valid."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from graphfuse import checkpoint
from graphfuse.capture.step import capture
from graphfuse.checkpoint.torch_form import load_torch_form
from graphfuse.compiler import cuda_graph
from graphfuse.compiler.in_place import compile_in_place
from graphfuse.compiler.workers import Workers, how_many, warm_pool
from graphfuse.errors import UnsupportedError
from graphfuse.frontends.habits import check_unowned, hook_model, route_optimizer
from graphfuse.ir.program import Program
from graphfuse.optim import Optimizers, as_one
from graphfuse.passes import run_pipeline, verify
from graphfuse.ranks import refuse_alone
from graphfuse.runtime.batches import batch_change, batch_key, check_batch, flatten_batch, program_batch_key
from graphfuse.runtime.bound import BoundFront, BoundProgram
from graphfuse.runtime.execute import arguments, backend_of, rebind_group
from graphfuse.runtime.guards import ProgramCache, Snapshot, agree_to_start
from graphfuse.runtime.metrics import StepMetrics, measure
from graphfuse.runtime.param_state import ParamState, gather_shards
from graphfuse.runtime.startup import Phases
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")


class DistModel(BoundFront):
    """A model, its optimizer and loss compiled into one fused, sharded training step.

    `dm(batch)` runs one step and returns the loss. The model's parameters are views into
    the buckets, so the model always shows the current weights; the learning rate (and
    AdamW's weight decay) are read from `optimizer.param_groups` at every step. After a step,
    `grad_norm` holds its global gradient norm (with Strategy.max_grad_norm) and `metrics` its
    `StepMetrics`. The user's optimizer speaks for the state held here (graphfuse/frontends/habits.py):
    its `state_dict()` gathers it, its `load_state_dict()` loads into it, its `step()` raises.
    The training state (program, tensors, steps, carried, group) is its BoundProgram's
    (graphfuse/runtime/bound.py), read through the attributes of the same names.
    """

    optimizer: torch.optim.Optimizer | Optimizers  # several optimizers as one
    loss_fn: Callable | None  # None in a loaded program's DistModel (from_program): it cannot trace again

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: Callable,
        example_batch,
        strategy: Strategy | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        one = as_one(optimizer)  # several optimizers (Muon and AdamW) step as one
        check_unowned(one, "gf.compile")
        refuse_alone(group, "gf.compile")  # WORLD_SIZE > 1 with no process group: not alone by accident
        self.model, self.optimizer, self.loss_fn = model, one, loss_fn
        self._bound = BoundProgram(group, "DistModel")
        device = next(model.parameters(), torch.empty(0)).device.type
        self.strategy = (strategy or Strategy()).for_backend(backend_of(self.group, device), device)
        self._prepare()
        key = batch_key(example_batch)
        program, error = None, None
        try:
            check_batch(key)
            program = self._build(example_batch)
        except Exception as e:  # told to the other ranks before they wait in the weights' broadcast
            error = e
        agree_to_start(self, program, error)
        assert program is not None  # agree_to_start raised unless this rank built its program
        self._start(program, key)
        # Where start-up time goes (the first step logs inductor's compile and its own run).
        log.info("graphfuse.compile: %s", self.startup.format(("capture", "passes", "verify", "bind")))

    @classmethod
    def from_program(
        cls,
        program: Program,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        group: dist.ProcessGroup | None = None,
    ) -> DistModel:
        """Run a saved `program` (see gf.load_program) without tracing the model again.

        `model` and `optimizer` are freshly built, as for gf.compile: the model's parameters
        become views into the program's buckets and the optimizer's param groups give the
        learning rate. Restore training state afterwards with gf.load or load_state_dict.
        """
        self = cls.__new__(cls)
        self.model, self.optimizer, self.loss_fn = model, as_one(optimizer), None
        self.strategy = program.strategy
        self._bound = BoundProgram(group, "DistModel")
        if (self.world_size, self.rank) != (program.world_size, program.rank):
            raise UnsupportedError(
                f"the program was built for rank {program.rank} of {program.world_size}, but this process is "
                f"rank {self.rank} of {self.world_size}; load the program saved by this rank, or rebuild with "
                f"gf.compile"
            )
        self._prepare()
        params = dict(model.named_parameters())
        for bucket in program.bucket_layout.buckets:
            for s in bucket.slots:
                p = params.get(s.fqn)
                if p is None or tuple(p.shape) != s.shape or str(p.dtype).removeprefix("torch.") != bucket.dtype:
                    raise UnsupportedError(
                        f"the program expects parameter {s.fqn} of shape {s.shape} and dtype {bucket.dtype}; "
                        f"the model has {None if p is None else (tuple(p.shape), p.dtype)}"
                    )
        if [g.params for g in program.optim.groups] != [
            tuple(n for p in grp["params"] for n, q in params.items() if q is p and q.requires_grad)
            for grp in self.optimizer.param_groups
        ]:
            raise UnsupportedError(
                "the optimizer's param groups do not hold the parameters the program was traced with"
            )
        if program.group_name != self.group_name:
            program = rebind_group(program, self.group_name)
        self._start(program, program_batch_key(program))
        return self

    def _prepare(self) -> None:
        """What both starts do before a program is built or bound: refuse what a CUDA graph
        cannot capture (Strategy.cuda_graphs), and start inductor's compile workers in the
        background, while the step is captured or the program is bound."""
        self.params, self.startup = ParamState(), Phases()
        self.cuda_graphs = cuda_graph.start(self.strategy, self.model, self.world_size, backend_of(self.group, "cuda"))
        s, device = self.strategy, next(self.model.parameters(), torch.empty(0)).device.type
        self.compile_workers = how_many(s.compile_workers, s.compile, device, self.world_size)
        if s.compile_workers == "auto" and s.compile == "inductor":
            log.info("graphfuse: compile_workers='auto': %d here (compile_workers.how_many)", self.compile_workers)
        if s.compile == "inductor":
            warm_pool(self.compile_workers)
        self._workers = Workers(self.compile_workers) if self.compile_workers else None

    def _start(self, program: Program, key: tuple) -> None:
        with self.startup.time("bind"):
            self._bind(program)
        route_optimizer(self.optimizer, self, "gf.compile")  # the user's optimizer speaks for the shards
        hook_model(self)
        self._snapshot = Snapshot(self.model, self.optimizer)  # checked at every step: changes are not ignored
        self.grad_norm: torch.Tensor | None = None
        self.metrics: StepMetrics | None = None
        self._last_call: float | None = None
        self._example_key = key
        # batch key -> (program, its executable; None until the first step compiles it)
        self._programs = ProgramCache(self.strategy.program_cache_size)
        self._programs[key] = (program, self._eager(program))
        self.params.start(program, self.model)

    # ---- building -------------------------------------------------------------------
    def _build(self, batch) -> Program:
        assert self.loss_fn is not None  # a loaded program's DistModel never builds: _program_for refuses first
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
        scalars_on = self.cuda_graphs.device if self.cuda_graphs else None
        self._bound.bind(program, params, buffers, scalar_device=scalars_on)

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
        log.warning(
            "graphfuse: the batch differs from every traced one (from the example: %s); re-capturing the step", change
        )
        try:
            program = self._build(batch)
        except Exception as e:
            e.add_note(
                f"graphfuse: raised while re-capturing the step for a batch that differs from the example ({change})"
            )
            raise
        if program.bucket_layout.fingerprint != self.layout.fingerprint:
            fix = (
                "cast the batch to the example's dtypes" if "dtype" in change else "pad batches to the example's shapes"
            )
            raise UnsupportedError(
                f"re-capturing the step for a batch that differs from the example ({change}) gave a different bucket "
                f"layout (its backward produces the gradients in another order), so it cannot share the buckets; {fix}"
            )
        self._programs[key] = entry = (program, self._eager(program))
        return entry

    def __call__(self, batch) -> torch.Tensor:
        called = time.perf_counter()
        self._snapshot.check()
        key, leaves = flatten_batch(batch)
        program, fn = self._program_for(batch, key)
        if fn is None:
            workers, self._workers = self._workers, None  # started with the DistModel: for the first compile
            with self.startup.time("inductor"):
                if workers is None and self.compile_workers:
                    workers = Workers(self.compile_workers)
                fn = compile_in_place(program, arguments(program, self.tensors, leaves), workers)
            if self.cuda_graphs:  # run un-captured now, captured at this batch key's next step
                fn = self.cuda_graphs.wrap(fn, program)
            self._programs[key] = (program, fn)
        first = "first step" not in self.startup
        with self.startup.time("first step") if first else contextlib.nullcontext():
            outs = self._bound.step(program, fn, self.optimizer.param_groups, leaves)
        if first:
            log.info("graphfuse: first step: %s", self.startup.format(("inductor", "first step")))
        self.params.stale = self.params.deferred  # other ranks' ranges of the buckets are a step old
        # the optimizer has stepped: LR schedulers check this flag, which torch.optim.Optimizer does not declare
        self.optimizer._opt_called = True  # type: ignore[union-attr]
        self.grad_norm = outs[1] if len(outs) > 1 else None  # the clip pass returns it after the loss
        self.metrics = measure(self.steps[0], called, self._last_call, leaves, self.grad_norm)
        self._last_call = called
        return outs[0]

    step = __call__

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self, mode: str | None = None) -> dict:
        """The training state in checkpoint `mode` (default: strategy.checkpoint_mode)."""
        self.sync()
        return checkpoint.state_dict(self, mode, whole_weights=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy `state_dict` into the live buffers, after validating all of it: one from
        `state_dict(mode)` of any mode, a plain {"model", "optim"} of full tensors, or the
        optimizer alone in torch.optim's form (by index or FQN; the weights stay as they are)."""
        if "state" in state_dict and "param_groups" in state_dict:
            load_torch_form(self, state_dict)
        else:
            checkpoint.load_state_dict(self, state_dict)
        self.loaded()

    def weights_loaded(self, fqns: set[str]) -> None:
        """The model's own load_state_dict wrote the weights of `fqns` into the buckets: the fp32
        master shards follow, or the next update would overwrite the loaded weights."""
        self._bound.refresh_masters(fqns)

    # ---- views ----------------------------------------------------------------------
    def named_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's `slice@<fqn>` views: the parameter's data in the bucket shard, and
        `slice@<fqn>.<state>` in every state shard (and `.master`), padding excluded. Current
        without `sync()` (a rank's own shard is always current), so no collective runs here."""
        return self._bound.named_slices()

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
