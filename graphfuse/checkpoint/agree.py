"""How the ranks agree around a save or load, outside the step: every rank reports its status
(done, or its error) through the process group's store, so a failure on one rank ends on all
ranks with the same CheckpointError, and a rank that never reports ends the wait after `timeout`."""

from __future__ import annotations

import collections
import errno
import itertools
import json
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from graphfuse.errors import CheckpointError, CheckpointMismatchError, GraphfuseError

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
        if self.world_size == 1:
            if error is not None:
                _raise(op, {0: (type(error).__name__, describe(error))}, error, 0, self.error)
            return [payload]
        seq = next(_sequence[self.prefix])
        key = f"{self.prefix}/{seq}/{{}}"
        status = {"payload": payload}
        if error is not None:
            status = {"error": [type(error).__name__, describe(error)], "origin": origin(error, self.rank)}
        self.store.set(key.format(self.rank), json.dumps(status))
        keys = [key.format(r) for r in range(self.world_size)]
        abandoned = f"{self.prefix}/{seq}/abandoned"
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # the store's timeout: say who never came, and warn latecomers
            self.store.set(abandoned, str(self.rank))
            missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])] or [self.rank]
            late = {
                r: ("CheckpointError", f"no report within {self.timeout:g} s (it failed or hangs)") for r in missing
            }
            _raise(op, late, error, self.rank, self.error)
        if self.store.check([abandoned]):
            gave_up = int(self.store.get(abandoned))
            _raise(op, {gave_up: ("CheckpointError", "gave up waiting for the other ranks")}, error, self.rank, self.error)
        statuses = [json.loads(self.store.get(k)) for k in keys]
        if seq >= 2:  # every rank has read exchange seq-2 before it reported at seq-1
            self.store.delete_key(f"{self.prefix}/{seq - 2}/{self.rank}")
        failures: dict[int, tuple[str, str]] = {}  # by the rank each failure began on
        for r, s in enumerate(statuses):
            if "error" in s:
                failures.setdefault(s.get("origin", r), tuple(s["error"]))
        if failures:
            _raise(op, failures, error, self.rank, self.error)
        return [s["payload"] for s in statuses]


def exchange(dm, timeout: float | None) -> Exchange:
    """The exchange among `dm`'s ranks."""
    return Exchange(dm.group, dm.rank, dm.world_size, getattr(dm, "group_name", ""), timeout)
