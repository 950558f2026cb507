"""Start real process groups on one host (Gloo on CPU, NCCL with one GPU per rank): for the
demo, the benchmarks and the multi-rank tests. On Linux the ranks fork from a server that imported
torch and graphfuse once (see `_context`), elsewhere they are spawned. Ranks meet through a file store (no port to
race for), a failure is reported from the rank that caused it, not a peer that lost it, and the
ranks die with the launcher (Linux), however it is killed."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import queue as queue_module
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphfuse.errors import GraphfuseError

# What a rank sees when a *peer* failed: its connections close or time out. Such an error is
# a consequence, never the root cause, when another rank failed on its own.
PEER_ERROR = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|ECONNRESET|EPIPE|Connection refused|"
    r"gloo/transport|Gloo connectFullMesh|Timed out waiting|NCCL communicator was aborted|"
    r"DistNetworkError|ProcessGroupGloo.*(Read|Write) error",
    re.IGNORECASE,
)
GRACE_S = 10.0  # after the first failure, how long the other ranks may take to report theirs


def free_port() -> int:
    """A port free at the moment of the call. Racy when other jobs share the machine (another
    process may take it before the caller binds it); run_ranks does not use it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_peer_error(text: str) -> bool:
    """Whether an exception's text is a lost connection to a peer (a consequence of another
    rank's failure) rather than a failure of its own."""
    return bool(PEER_ERROR.search(text))


@dataclass(frozen=True)
class Outcome:
    """What one rank reported (or what its exit code says, if it died without a word)."""

    rank: int
    ok: bool
    value: object  # the function's result, or the traceback text
    at: float  # time.time() when the rank finished or its death was seen
    peer: bool = False  # a lost connection to a peer, not a failure of this rank's own
    exit_code: int | None = None  # set when the rank died without reporting

    def describe(self) -> str:
        if self.exit_code is not None:
            return f"rank {self.rank} died with exit code {self.exit_code}"
        return f"rank {self.rank} failed:\n{self.value}"


class RankFailure(GraphfuseError):
    """A rank failed, died, hung past the timeout or did not exit cleanly. `rank` and `traceback`
    are the root cause's: the earliest failure that is not a lost connection; `others` describes
    every other rank that failed. Not an AssertionError: it also reports a rank's crash or hang."""

    def __init__(self, cause: Outcome, others: list[Outcome], silent: Sequence[int] = ()) -> None:
        self.rank, self.traceback, self.others = cause.rank, str(cause.value), others
        lines = [cause.describe()]
        if others:
            lines.append(
                "other ranks failed after it: "
                + "; ".join(f"rank {o.rank}" + (" (lost its peer)" if o.peer else "") for o in others)
            )
        if silent:
            lines.append(f"ranks {list(silent)} had not finished {GRACE_S:.0f}s later and were killed")
        super().__init__("\n".join(lines))


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (on Linux a zombie, dead but not yet reaped, counts as ended)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal-0 probe (a zombie counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _die_with_parent(parent: int) -> None:
    """Have this rank end when the launcher dies, even by SIGKILL (a launcher killed by SIGTERM or
    by a job scheduler otherwise left its ranks running, holding memory and the GPU). Linux: the
    kernel's parent-death signal, for spawned ranks whose parent is the launcher. Everywhere: a
    daemon thread that checks the launcher twice a second, for ranks forked by the forkserver (their
    parent is the server, which itself lives as long as any rank does)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while _alive(parent):
            time.sleep(0.5)
        os._exit(1)

    if not _alive(parent):  # the launcher died before this rank started watching
        os._exit(1)
    threading.Thread(target=watch, name="graphfuse-launcher-watch", daemon=True).start()


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    threads: int,
    fn: Callable,
    args: tuple,
    queue,
    parent: int,
    forked: bool,
) -> None:
    _die_with_parent(parent)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"file://{store_path}")
    try:
        queue.put((rank, True, fn(rank, world_size, *args), time.time(), False))
    except BaseException as e:
        text = traceback.format_exc()
        queue.put((rank, False, text, time.time(), is_peer_error(f"{type(e).__name__}: {e}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if forked:
        # A forked rank ends with os._exit, which skips the interpreter's exit: run its atexit
        # handlers here (graphfuse's group clean-up among them), after the result is sent, so
        # that a rank whose exit would fail fails here too (_check_clean_exits). C++ teardown,
        # where Gloo aborts, runs only in a spawned rank or under torchrun (tests/checkpoint/test_clean_exit.py).
        queue.close()
        queue.join_thread()
        atexit._run_exitfuncs()


_forkserver_env: list[dict[str, str]] = []  # the environment the forkserver started with (once per process)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _context():
    """Linux: "forkserver", whose server imports torch and graphfuse once, so a rank starts in a
    fraction of a second instead of importing them again (torch was most of a multi-rank test's
    time on 2 cores; graphfuse, with torch.distributed.checkpoint, another 0.6 s a rank). Its
    ranks inherit the server's environment, not the caller's: when that changed since the server
    started (a test that sets a variable a rank reads), the server is restarted with the caller's.
    Elsewhere "spawn"."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    server = getattr(forkserver, "_forkserver", None)
    if _forkserver_env and _environment() != _forkserver_env[0]:
        if server is None or not hasattr(server, "_stop"):  # no way to restart it: spawn afresh
            return mp.get_context("spawn")
        server._stop()  # the next start runs a new server in this environment
        _forkserver_env.clear()
    ctx = mp.get_context("forkserver")
    if not _forkserver_env:
        ctx.set_forkserver_preload(["torch", "torch.distributed", "graphfuse"])
        _forkserver_env.append(_environment())
    return ctx


def root_cause(failures: list[Outcome]) -> tuple[Outcome, list[Outcome]]:
    """The earliest failure that is not a lost peer (else the earliest of all), and the rest."""
    ordered = sorted(failures, key=lambda o: (o.peer, o.at))
    return ordered[0], ordered[1:]


def run_ranks(
    fn: Callable, world_size: int, *args, backend: str = "gloo", threads: int = 1, timeout: float = 300.0
) -> list:
    """Run `fn(rank, world_size, *args)` (a module-level function) on `world_size` spawned
    ranks of a `backend` process group; return each rank's result (picklable), or raise
    `RankFailure` naming the rank whose failure came first, with its traceback."""
    ctx = _context()
    forked = ctx.get_start_method() == "forkserver"
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="graphfuse-rdzv-")
    store_path = os.path.join(store_dir, "store")  # a fresh file per run: nothing stale to meet
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, store_path, backend, threads, fn, args, queue, os.getpid(), forked),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    try:
        _collect(procs, queue, timeout, outcomes)
    finally:
        done = len(outcomes) == world_size and all(o.ok for o in outcomes.values())
        for r, p in enumerate(procs):
            # A rank that never reported had its timeout (or the grace period after a failure): it
            # hangs. One that reported exits now; after a failure, peers may hang in a collective.
            p.join(timeout=0 if r not in outcomes else 30 if done else 5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    failures = [o for o in outcomes.values() if not o.ok]
    if failures:
        raise RankFailure(*root_cause(failures), silent=[r for r in range(world_size) if r not in outcomes])
    _check_clean_exits(procs)
    return [outcomes[r].value for r in range(world_size)]


def _check_clean_exits(procs: list) -> None:
    """A rank that returned its result must then exit with code 0: a scheduler or torchrun marks a
    job failed by its exit code. An abort at exit (-6) is what Gloo's threads do when a process
    group outlives destroy_process_group() (issue 30); a rank still running 30 s on hung at exit."""
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            why = (
                "killed after 30 s: it hung at exit"
                if p.exitcode == -signal.SIGKILL
                else "an abort at exit if -6 (SIGABRT)"
            )
            text = f"returned its result, then exited with code {p.exitcode} ({why})"
            raise RankFailure(Outcome(r, False, text, time.time()), [])


def _collect(procs: list, queue, timeout: float, outcomes: dict[int, Outcome]) -> None:
    """Fill `outcomes` with every rank's; after the first failure, wait at most GRACE_S for the
    others, so the rank that failed first on its own is found even if a peer's error came sooner."""
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value, at, peer = queue.get(timeout=0.2)
            outcomes[rank] = Outcome(rank, ok, value, at, peer)
        except queue_module.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in outcomes or p.exitcode in (None, 0):
                    continue
                # died without a word (a signal, os._exit): a failure of its own, once its last
                # message (if any) has had time to arrive
                if now - dead_since.setdefault(r, now) > 1.0:
                    at = time.time() - (now - dead_since[r])
                    outcomes[r] = Outcome(r, False, f"died with exit code {p.exitcode}", at, exit_code=p.exitcode)
        if any(not o.ok for o in outcomes.values()) and deadline > time.monotonic() + GRACE_S:
            deadline = time.monotonic() + GRACE_S
    if len(outcomes) < len(procs) and all(o.ok for o in outcomes.values()):
        hung = [r for r in range(len(procs)) if r not in outcomes]
        text = f"still running after the {timeout}s timeout; finished: {sorted(outcomes)}, still running: {hung}"
        raise RankFailure(Outcome(hung[0], False, text, time.time()), [])
