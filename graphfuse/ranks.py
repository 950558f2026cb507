"""A process group's ranks (`group_info`, `backend_of`); a run refused that would be silently wrong
(`refuse_alone`, `refuse_ddp`, `refuse_ddp_model`); how graphfuse holds a group: weakly, so that torch's
`destroy_process_group()` destroys it (`HeldGroup`), and destroys at exit one left alive
(`destroy_left_at_exit`); and how the ranks agree outside the step (`Exchange`): every rank
reports its status (done, or its error) through the group's store, so a failure on one rank ends
on all ranks with the same error, and a rank that never reports ends the wait after `timeout`
(gf.compile's start, checkpoint saves and loads, the torch form of optimizer.state_dict())."""

from __future__ import annotations

import atexit
import collections
import errno
import itertools
import json
import logging
import os
import sys
import types
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel

from graphfuse.errors import CheckpointError, CheckpointMismatchError, GraphfuseError, UnsupportedError

log = logging.getLogger("graphfuse")
_bound = [False]  # whether graphfuse bound a process group in this process (see destroy_left_at_exit)


def group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int, str]:
    """(group, world size, rank, group name); world size 1 with no process group."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0, ""
        group = dist.group.WORLD
        # torch types WORLD as optional; it is set whenever is_initialized() is true
        assert group is not None, "torch.distributed is initialised without a world group"
    return group, dist.get_world_size(group), dist.get_rank(group), group.group_name


def refuse_alone(group: dist.ProcessGroup | None, how: str) -> None:
    """Refuse world size 1 (no group given, none initialised) in a job whose environment says it
    has several ranks (torchrun's WORLD_SIZE): each rank would train alone, silently."""
    world = os.environ.get("WORLD_SIZE", "")
    if group is None and world.isdigit() and int(world) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedError(
            f"{how}: WORLD_SIZE={world} in the environment (torchrun?) but no process group is initialised, so this "
            "rank would train alone at world size 1; call torch.distributed.init_process_group() first (with Hugging "
            "Face: build TrainingArguments or the Accelerator first, which do)"
        )


def refuse_ddp(owns: Callable[[list], bool]) -> None:
    """Refuse a region dynamo compiles inside DistributedDataParallel's forward when a
    gf.shard_optimizer owns the DDP module's parameters (`owns(parameters)`): graphfuse's optimizer
    averages the gradients itself, and dynamo's DDPOptimizer splits the graph at DDP's buckets."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is not None and owns(list(ddp.parameters())):
        raise UnsupportedError(
            "a model wrapped in DistributedDataParallel is compiled with backend='graphfuse' while a "
            f"gf.shard_optimizer owns its parameters: {_DDP_TWICE}, and dynamo compiles DDP's regions apart. {_NO_DDP}"
        )


def refuse_ddp_model(model: object, where: str) -> None:
    """Refuse `model` wrapped in DistributedDataParallel where graphfuse averages the gradients."""
    if isinstance(model, DistributedDataParallel):
        raise UnsupportedError(
            f"{where}(model=DistributedDataParallel(...)): {_DDP_TWICE} (twice the traffic, and from 3 ranks on "
            f"the sums in another order). {_NO_DDP}: pass the module DDP wraps (ddp.module) and build the "
            "optimizer on its parameters"
        )


_DDP_TWICE = "DDP would all-reduce every gradient that graphfuse's optimizer reduce-scatters itself"
_NO_DDP = (
    "graphfuse's optimizer is the data parallelism (what DDP with torch's ZeroRedundancyOptimizer does): train "
    "the model without DDP (Hugging Face: graphfuse.integrations.transformers.GraphfuseTrainer, "
    "graphfuse.integrations.accelerate.prepare)"
)


def backend_of(group: dist.ProcessGroup | None, device_type: str) -> str | None:
    """The backend that runs `group`'s collectives on `device_type` tensors (None: no group)."""
    if group is None:
        return None
    backend = str(dist.get_backend(group))
    if ":" in backend:  # a group of several backends, "cpu:gloo,cuda:nccl"
        return dict(b.split(":", 1) for b in backend.split(",")).get(device_type)
    return backend


def _no_group() -> None:
    """The handle of "no process group" (world size 1): reads None, and never raises."""
    return None


def hold(group: dist.ProcessGroup | None) -> Callable[[], dist.ProcessGroup | None]:
    """A weak handle on `group`: calling it gives the group while torch (or the user) keeps it,
    None after. A group kept alive past `destroy_process_group()` keeps Gloo's worker threads
    too, and one of them, dropping its last collective while the interpreter shuts down, needs
    the GIL and aborts the process (`terminate called without an active exception`, exit -6)."""
    if group is None:
        return _no_group
    _bound[0] = True
    return weakref.ref(group)


class HeldGroup:
    """The `group` attribute of an object that runs collectives (runtime/bound.py's BoundProgram):
    assigned as usual, held weakly (`hold`), and read back as the group, or None without one.
    Read after torch destroyed the group, it raises naming the way out: graphfuse never runs
    a collective on a destroyed group, nor keeps one alive to do so."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}_held"

    def __get__(self, obj, owner: type | None = None):
        if obj is None:
            return self
        try:
            handle = obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(self.name) from None
        group = handle()
        if group is None and handle is not _no_group:
            held_for = getattr(obj, "held_for", type(obj).__name__)  # a BoundProgram names its frontend
            raise UnsupportedError(
                f"the process group of this {held_for} was destroyed (torch.distributed."
                "destroy_process_group()); graphfuse runs no collective after it: initialise a new group, build a new "
                f"{held_for} (gf.compile or gf.shard_optimizer) and gf.load the last checkpoint"
            )
        return group

    def __set__(self, obj, group: dist.ProcessGroup | None) -> None:
        obj.__dict__[self.slot] = hold(group)


def destroy_left_at_exit() -> None:
    """Registered with `atexit`, where torch's own shutdown hooks run (before the interpreter
    finalises), so that Gloo's threads end while they can still take the GIL: a program that bound
    a group through graphfuse and never called `destroy_process_group()` has it destroyed here, and
    torch's own references to destroyed groups are dropped (`unpin_destroyed_groups`). Saves in the
    background are joined before (they are non-daemon threads)."""
    if _bound[0] and dist.is_available() and dist.is_initialized():
        log.info(
            "graphfuse: destroying the process group left at exit (call dist.destroy_process_group() to do it yourself)"
        )
        try:
            dist.destroy_process_group()
        except Exception as e:  # at exit, a failure to clean up is only worth a line
            log.warning("graphfuse: destroying the process group at exit failed: %s: %s", type(e).__name__, e)
    unpin_destroyed_groups()


def unpin_destroyed_groups() -> int:
    """Drop the destroyed process groups that torch's own functions hold as default arguments;
    returns how many functions held one. torch.distributed.nn.functional (which
    torch.distributed.checkpoint, and so graphfuse, imports) writes `group=group.WORLD` into its
    signatures when it is imported: imported after init_process_group(), it keeps that group past
    destroy_process_group() to the end of the interpreter. Only groups torch no longer knows."""
    if not dist.is_available():
        return 0
    live = set(dist.distributed_c10d._world.pg_map)
    dead = lambda v: issubclass(type(v), dist.ProcessGroup) and v not in live  # noqa: E731 (type(): no attribute read)
    found = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for fn in list(vars(module).values()):
            if type(fn) is not types.FunctionType:  # type(): isinstance would warn on torch.distributed.reduce_op
                continue
            if fn.__defaults__ and any(map(dead, fn.__defaults__)):
                fn.__defaults__ = tuple(None if dead(v) else v for v in fn.__defaults__)
                found += 1
            if fn.__kwdefaults__ and any(map(dead, fn.__kwdefaults__.values())):
                fn.__kwdefaults__ = {k: None if dead(v) else v for k, v in fn.__kwdefaults__.items()}
                found += 1
    return found


atexit.register(destroy_left_at_exit)


FAILURES = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException
DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others at one exchange of a save or load

_OS_CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system"}
# Exchanges numbered per group: the ranks of one group run the same exchanges in the same
# order, whatever other groups (with other ranks) did before.
_sequence: dict[str, itertools.count] = collections.defaultdict(itertools.count)


def describe(e: BaseException) -> str:
    """One line for an error, whatever raised it: DCP's CheckpointException (a BaseException
    carrying each rank's error) is unwrapped, and a full disk says so."""
    if isinstance(e, CheckpointException):
        rank, (inner, _) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        return f"inside torch.distributed.checkpoint on rank {rank}: {describe(inner)}"
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, OSError) and e.errno is not None:
        cause = _OS_CAUSES.get(e.errno, e.strerror or type(e).__name__)
        return f"{cause} ({e.filename}: {e.strerror})" if e.filename else f"{cause} ({e})"
    return f"{type(e).__name__}: {e}"


def origin(e: BaseException | None, rank: int) -> int:
    """The rank where `e` began: inside DCP every rank raises a CheckpointException that names
    the failing rank (also when a graphfuse error wraps it); otherwise this rank."""
    while e is not None:
        if isinstance(e, CheckpointException) and e.failures:
            return min(e.failures)
        e = e.__cause__ or e.__context__
    return rank


def _raise(
    op: str, failures: dict[int, tuple[str, str]], local: BaseException | None, rank: int, base: type = CheckpointError
) -> None:
    first = min(failures)
    cls_name, msg = failures[first]
    cls = CheckpointMismatchError if cls_name == "CheckpointMismatchError" and base is CheckpointError else base
    others = sorted(set(failures) - {first})
    also = f" (ranks {others} failed too)" if others else ""
    text = f"{op} failed on rank {first}: {msg}{also}"
    if first != rank:
        text += f"; rank {rank} stops too, with its state unchanged"
    raise cls(text) from (local if isinstance(local, Exception) else None)


class Exchange:
    """All ranks of `group` meet at each call with their status; any error raises on all, as
    `error` (CheckpointError for saves and loads)."""

    def __init__(
        self, group, rank: int, world_size: int, group_name: str, timeout: float | None, error: type = CheckpointError
    ) -> None:
        self.rank, self.world_size, self.error = rank, world_size, error
        if not issubclass(error, GraphfuseError):
            raise TypeError(f"error must be a GraphfuseError class, got {error!r}")
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise CheckpointError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.prefix = f"graphfuse/checkpoint/{group_name or 'world'}"
        # The default store reaches every rank without a collective, so a rank that failed
        # (or never comes) cannot leave the others blocked inside one until the group's timeout.
        self.store = dist.distributed_c10d._get_default_store() if world_size > 1 else None

    def __call__(self, op: str, error: BaseException | None, payload=None) -> list:
        """Every rank's `payload`, once all ranks reported success for `op`; else raises on
        every rank the first failing rank's error (or a timeout naming the missing ranks)."""
        store = self.store  # None exactly at world size 1
        if store is None:
            if error is not None:
                _raise(op, {0: (type(error).__name__, describe(error))}, error, 0, self.error)
            return [payload]
        seq = next(_sequence[self.prefix])
        key = f"{self.prefix}/{seq}/{{}}"
        status = {"payload": payload}
        if error is not None:
            status = {"error": [type(error).__name__, describe(error)], "origin": origin(error, self.rank)}
        store.set(key.format(self.rank), json.dumps(status))
        keys = [key.format(r) for r in range(self.world_size)]
        abandoned = f"{self.prefix}/{seq}/abandoned"
        try:
            store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # the store's timeout: say who never came, and warn latecomers
            store.set(abandoned, str(self.rank))
            missing = [r for r in range(self.world_size) if not store.check([keys[r]])] or [self.rank]
            late = {
                r: ("CheckpointError", f"no report within {self.timeout:g} s (it failed or hangs)") for r in missing
            }
            _raise(op, late, error, self.rank, self.error)
        if store.check([abandoned]):
            gave_up = int(store.get(abandoned))
            _raise(
                op, {gave_up: ("CheckpointError", "gave up waiting for the other ranks")}, error, self.rank, self.error
            )
        statuses = [json.loads(store.get(k)) for k in keys]
        if seq >= 2:  # every rank has read exchange seq-2 before it reported at seq-1
            store.delete_key(f"{self.prefix}/{seq - 2}/{self.rank}")
        failures: dict[int, tuple[str, str]] = {}  # by the rank each failure began on
        for r, s in enumerate(statuses):
            if "error" in s:
                failures.setdefault(s.get("origin", r), tuple(s["error"]))
        if failures:
            _raise(op, failures, error, self.rank, self.error)
        return [s["payload"] for s in statuses]


def all_gather_flat(whole: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's `shard`, in rank order, into the flat `whole`: torch's `all_gather_single`
    where it exists (2.13 on; it deprecates `all_gather_into_tensor`), else the older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(whole, shard, group=group)
