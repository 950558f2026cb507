"""`ShardedOptimizer` (`gf.shard_optimizer`): a torch.optim.Optimizer whose `step()` is a fused,
sharded ZeRO-1 program built by the same passes as gf.compile, for a backward computed outside
graphfuse (eager or torch.compile); it owns the buckets, so it saves and loads the training state."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from graphfuse import checkpoint
from graphfuse.capture.update import capture_update
from graphfuse.checkpoint.torch_form import TORCH_MODE, load_torch_form, torch_form
from graphfuse.compiler.in_place import compile_in_place
from graphfuse.errors import UnsupportedError
from graphfuse.frontends.habits import check_unowned, refuse_add_param_group, route_optimizer
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.optim import Optimizers, ShardedState, as_one
from graphfuse.passes import PIPELINE, reduce_scatter, run_pipeline, verify
from graphfuse.passes.shard_inputs import SHARD_SUFFIX, ShardInputs, drop_unused_gradients
from graphfuse.ranks import refuse_alone, refuse_ddp_model
from graphfuse.runtime.bound import BoundFront, BoundProgram
from graphfuse.runtime.execute import arguments, backend_of
from graphfuse.runtime.grad_shards import clip_shards, reduce_scatter_grads
from graphfuse.runtime.guards import Snapshot
from graphfuse.strategy import Strategy

OPTIMIZERS: list[weakref.ref] = []  # ShardedOptimizers built, oldest first, for the "graphfuse" backend


class _Params(torch.nn.Module):
    """Stands in for the model when none is given: its parameters named param0, param1, ..."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name, p)


def named_params(
    optimizer: torch.optim.Optimizer | Optimizers, model: torch.nn.Module | None
) -> dict[str, torch.nn.Parameter]:
    """The optimizer's parameters by FQN (from `model`; param0, param1, ... without one)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is None:
        return {f"param{i}": p for i, p in enumerate(params)}
    fqn: dict[int, str] = {}
    for name, p in model.named_parameters():  # a tied parameter keeps its first name
        fqn.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in fqn]
    if missing:
        p = params[missing[0]]
        raise UnsupportedError(
            f"the optimizer's parameter #{missing[0]} (shape {tuple(p.shape)}) is not a parameter of the model "
            "given to gf.shard_optimizer(model=...); pass the model that owns every optimized parameter"
        )
    return {fqn[id(p)]: p for p in params}


def _checked(strategy: Strategy) -> Strategy:
    """`strategy`, refused where it asks for what only gf.compile's whole traced step can do."""
    if strategy.grad_accumulation != 1:
        raise UnsupportedError(
            "gf.shard_optimizer: Strategy.grad_accumulation must be 1; accumulate by calling backward() "
            "several times before step() (gradients add up in .grad and are reduced once, in step())"
        )
    if strategy.compile_workers not in (0, "auto"):  # "auto": none here
        raise UnsupportedError(
            "gf.shard_optimizer: Strategy.compile_workers cuts a whole step that gf.compile traced into pieces "
            "compiled in several processes; the update alone compiles in this one: set compile_workers=0 (or 'auto')"
        )
    if strategy.cuda_graphs:
        raise UnsupportedError(
            "gf.shard_optimizer: Strategy.cuda_graphs replays a whole step that gf.compile traced (forward, backward "
            "and update) and is not supported here; use gf.compile, or set cuda_graphs=False"
        )
    return strategy


class ShardedOptimizer(BoundFront, torch.optim.Optimizer):
    """ZeRO-1 over fused buckets for a backward computed outside graphfuse.

    `step()` reads each parameter's `.grad` (summed over any number of backward calls since
    `zero_grad`), reduce-scatters the packed gradients once per bucket (averaged over ranks,
    as DDP), clips by the global norm if `strategy.max_grad_norm`, updates this rank's shard
    with one fused update and all-gathers the buckets. `param_groups` is the wrapped
    optimizer's own list, so LR schedulers (on either object) drive it live. The model's
    parameters become views into the buckets, so the model always shows the current weights.
    The training state (program, tensors, steps, carried, group) is its BoundProgram's
    (graphfuse/runtime/bound.py), read through the attributes of the same names.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        strategy: Strategy | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        model: torch.nn.Module | None = None,
        reduce_in_backward: bool = True,
    ) -> None:
        one = as_one(optimizer)  # several optimizers (Muon and AdamW) step as one
        check_unowned(one, "gf.shard_optimizer")
        refuse_alone(group, "gf.shard_optimizer")  # WORLD_SIZE > 1 with no process group: not alone by accident
        refuse_ddp_model(model, "gf.shard_optimizer")  # DDP would reduce every gradient a second time
        strategy = _checked(strategy or Strategy())
        self.params = named_params(one, model)
        super().__init__(list(self.params.values()), dict(one.defaults))
        self.optimizer = one
        self.param_groups = one.param_groups  # shared: schedulers on either object act on both
        # stands for torch.optim's defaultdict of states, which no rank holds whole
        self.state = ShardedState(  # type: ignore[assignment]
            [p for p in self.params.values() if p.requires_grad], self
        )
        self.model = model if model is not None else _Params(self.params)
        self._bound = BoundProgram(group, "ShardedOptimizer")
        device = self.param_groups[0]["params"][0].device.type
        self.strategy = strategy = strategy.for_backend(backend_of(self.group, device), device)
        program = capture_update(self.params, one, strategy)
        # Without a backward graph, assume gradients arrive in reverse registration order.
        reversed_grads = dict(reversed(list(program.signature.grads.items())))
        program = program.with_(
            signature=program.signature.with_(grads=reversed_grads),
            world_size=self.world_size,
            rank=self.rank,
            group_name=self.group_name,
        )
        self._captured = copy.deepcopy(program)  # the passes edit a program in place
        self._bound.bind(verify(run_pipeline(program)), self.params, {})
        fn = self.program.graph_module if strategy.compile == "eager" else None
        # buckets whose shards a compiled backward made -> (program, executable or None)
        self._variants: dict[frozenset[int], tuple[Program, Callable | None]] = {frozenset(): (self.program, fn)}
        self._shards: dict[int, torch.Tensor] = {}  # bucket index -> shard from this step's backward(s)
        self._received: dict[int, int] = {}  # bucket index -> shards received this step
        self.reduce_in_backward = reduce_in_backward
        self.regions: list[frozenset[str]] = []  # the FQNs each region compiled by the backend reads
        self.backward_graphs: list = []  # (backward GraphModule, buckets it reduces), for inspection
        self.last_reductions: dict[str, int] = {}  # bucket -> reductions in the last step
        OPTIMIZERS[:] = [r for r in OPTIMIZERS if r() is not None] + [weakref.ref(self)]
        route_optimizer(one, self, "gf.shard_optimizer")  # the wrapped optimizer's own calls reach these shards
        self._snapshot = Snapshot(self.model, one, "gf.shard_optimizer")  # a moved or copied parameter is refused

    def receive_shards(self, buckets: list[int], shards: list[torch.Tensor]) -> None:
        """Called by a compiled backward: the averaged gradient shards of `buckets`; several
        backward calls before one step add up (the average of sums is the sum of averages)."""
        for b, shard in zip(buckets, shards):
            self._shards[b] = shard if b not in self._shards else self._shards[b] + shard
            self._received[b] = self._received.get(b, 0) + 1

    def _variant(self, reduced: frozenset[int]) -> tuple[Program, Callable | None]:
        """The program whose buckets `reduced` take gradient shards instead of gradients."""
        if reduced not in self._variants:
            pipeline = [ShardInputs(reduced) if p is reduce_scatter else p for p in PIPELINE]
            program = verify(drop_unused_gradients(run_pipeline(copy.deepcopy(self._captured), pipeline=pipeline)))
            fn = program.graph_module if self.strategy.compile == "eager" else None
            self._variants[reduced] = (program, fn)
        return self._variants[reduced]

    def _per_call(self, program: Program, reduced: frozenset[int]) -> list[torch.Tensor]:
        """The gradients and gradient shards `program` reads, in its input order."""
        out = []
        for b in self.layout.buckets:
            if b.index in reduced:
                late = [f for f in b.fqns if self.params[f].grad is not None]
                if late:
                    raise UnsupportedError(
                        f"parameter {late[0]} has a .grad although a compiled backward already reduce-scattered its "
                        "bucket: it gets gradient outside that compiled region too; build the optimizer with "
                        "reduce_in_backward=False (every bucket then reduced in step())"
                    )
        for spec in program.signature.inputs:
            if spec.role != sig.GRAD:
                continue
            if spec.name.endswith(SHARD_SUFFIX):
                out.append(self._shards[int(spec.name.removesuffix(SHARD_SUFFIX).removeprefix("bucket"))])
                continue
            fqn = spec.name.removesuffix(".grad")
            p = self.params[fqn]
            if p.grad is None:
                raise UnsupportedError(
                    f"parameter {fqn} (shape {tuple(p.shape)}) has no gradient at step(); every optimized "
                    "parameter must get one (or leave it out of the optimizer)"
                )
            out.append(p.grad)
        return out

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One fused, sharded update from the gradients (and the shards a compiled backward
        made); returns `closure()`'s loss."""
        self._snapshot.check()
        if getattr(self, "found_inf", None) is not None:  # torch.amp.GradScaler drives it (see below)
            # GradScaler deletes these after a step that returns; gone here too, a later plain step() runs
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise UnsupportedError(
                f"torch.amp.GradScaler with gf.shard_optimizer at {self.world_size} ranks is not supported: each rank "
                "finds overflows in its own gradients, before the reduction, so one rank would skip a step the others "
                "take (and wait for it in the step's collectives). Train in bfloat16 (torch.autocast(dtype="
                "torch.bfloat16) needs no loss scaling), or at one rank"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reduced = frozenset(self._shards)
        program, fn = self._variant(reduced)
        per_call = self._per_call(program, reduced)
        if fn is None:  # inductor compiles for the gradients' devices and strides
            fn = compile_in_place(program, arguments(program, self.tensors, per_call))
            self._variants[reduced] = (program, fn)
        self._bound.step(program, fn, self.param_groups, per_call)
        self.last_reductions = {
            b.name: self._received.get(b.index, 0) + (b.index not in reduced) for b in self.layout.buckets
        }
        self._shards, self._received = {}, {}
        # the wrapped optimizer has stepped: its LR schedulers check this flag, which Optimizer does not declare
        self.optimizer._opt_called = True  # type: ignore[union-attr]
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by torch.amp.GradScaler.step: when true it calls step() on every rank, with
        `found_inf` set, instead of skipping step() on a rank whose own gradients overflowed
        (which left the other ranks waiting in the step's collectives). At several ranks, so that
        every rank refuses it alike; at one rank GradScaler unscales and skips as for any optimizer."""
        return self.world_size > 1

    def add_param_group(self, param_group: dict) -> None:
        if "_bound" in self.__dict__:  # torch.optim's __init__ adds the groups it was given (before _bound)
            refuse_add_param_group("gf.shard_optimizer")(self, param_group)
        super().add_param_group(param_group)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the coming `step()` by their global norm across every rank
        (FSDP's `clip_grad_norm_` convention) and return that norm (a 0-d fp32 tensor, on every
        rank). Call it between the backward and `step()`, on every rank (a collective): it
        reduce-scatters the gradients now, as step() would (each parameter's `.grad` is None
        after it; the averaged shards wait for step()), and scales the shards by
        min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does."""
        pending = [b for b in self.layout.buckets if b.index not in self._shards]
        grads = {}
        for b in pending:
            for fqn in b.fqns:
                g = self.params[fqn].grad
                if g is None:
                    raise UnsupportedError(
                        f"clip_grad_norm_: parameter {fqn} (shape {tuple(self.params[fqn].shape)}) has no gradient; "
                        "call it after the backward, before step()"
                    )
                grads[fqn] = g
        dtype = self.strategy.master_dtype
        shards = reduce_scatter_grads(self.layout, grads, pending, dtype, self.group, self.group_name)
        self.receive_shards([b.index for b in pending], shards)
        for fqn in grads:
            self.params[fqn].grad = None
        return clip_shards(list(self._shards.values()), max_norm, norm_type, self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._shards, self._received = {}, {}
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self, mode: str | None = None) -> dict:
        """With no `mode`, what torch.optim's `state_dict()` returns: {"state", "param_groups"}
        keyed by parameter index, the state gathered whole (what DCP's get_state_dict,
        accelerate and torch.save habits read). With mode="torch", the same keyed by FQN, the
        form get_optimizer_state_dict(..., full_state_dict=True) returns. Both are collectives:
        call them on every rank. With "balanced" or "unbalanced", the whole training state (the
        weights live in this optimizer's buckets) in that checkpoint mode, as views of this
        rank's shards (see gf.DistModel.state_dict): the in-memory form of gf.save."""
        if mode is None:
            return torch_form(self, by_index=True)
        if mode == TORCH_MODE:
            return torch_form(self)
        return checkpoint.state_dict(self, mode, whole_weights=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy `state_dict` into the live buffers after validating all of it: one from
        `state_dict(mode)` of any mode, a plain {"model", "optim"}, or a torch.optim form
        (keyed by FQN, or by index as a plain torch optimizer's state_dict())."""
        if "state" in state_dict and "param_groups" in state_dict:
            load_torch_form(self, state_dict)
            return
        checkpoint.load_state_dict(self, state_dict)


def shard_optimizer(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    strategy: Strategy | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    model: torch.nn.Module | None = None,
    reduce_in_backward: bool = True,
) -> ShardedOptimizer:
    """The optimizer for a backward computed outside graphfuse (eager, or
    `torch.compile(model, backend="graphfuse")`): a fused, sharded ZeRO-1 step over `group`.

    Args:
        optimizer: a fresh torch.optim optimizer (docs/models.md); afterwards its own step()
            raises and its state_dict()/load_state_dict() reach the shards (docs/habits.md); or
            a list of them over disjoint parameters (torch.optim.Muon and AdamW), stepped as one.
        strategy: the configuration (gf.Strategy()); None: the defaults.
        group: the process group; None: the default group if initialised, else world size 1.
        model: names the parameters by FQN in the layout and checkpoints (param0, param1, ...
            without it); needed by the graphfuse backend.
        reduce_in_backward: a model compiled with backend="graphfuse" reduce-scatters each
            bucket inside its backward (False: every bucket in step(), as for an eager model).

    Returns:
        A ShardedOptimizer (a torch.optim.Optimizer): step(), zero_grad(), clip_grad_norm_(),
        state_dict() and load_state_dict().

    Raises:
        UnsupportedError: the optimizer or strategy is not supported, naming the way out.
    """
    return ShardedOptimizer(optimizer, strategy, group, model=model, reduce_in_backward=reduce_in_backward)
