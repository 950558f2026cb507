"""Compile a step cut into pieces (graphfuse/compiler/pieces.py) in several processes at once
(Strategy.compile_workers), through inductor's on-disk caches.

The worker processes (graphfuse/compiler/worker.py) start with the DistModel (`Workers(n)`),
so their imports overlap the capture. At the first step this process writes a job into their
directory: the program file, the inputs' shapes, strides and dtypes, and inductor's and
torch's compile settings. Every
process (this one first, the workers from the last piece down) claims pieces one at a time with
an exclusive file create and compiles them with `compile_graph`, which stores the result in
inductor's FX graph and AOTAutograd caches. This process then compiles the workers' pieces
again: they come from the cache. A piece a worker failed on, or left when it died, is compiled
here; a piece that misses the cache here is compiled again, with a warning (the settings that
reach a worker: graphfuse/compiler/settings.py; a setting outside them changes the cache key).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse.compiler import inductor  # its functions looked up at each call: tests replace warm_workers
from graphfuse.compiler import settings as compile_settings
from graphfuse.compiler.inductor import compile_graph, phase_seconds, phases_since, phases_text
from graphfuse.compiler.jobs import claim, strided_meta, write_whole
from graphfuse.compiler.pieces import PieceRunner, split
from graphfuse.passes.graph import placeholders
from graphfuse.program_files import save_program

log = logging.getLogger("graphfuse")

POLL_S = 0.05
# How long the main process waits, once its own pieces are compiled, for the workers' pieces:
# at least WAIT_MIN_S, and WAIT_FACTOR times its own slowest piece.
WAIT_MIN_S, WAIT_FACTOR = 300.0, 5.0
SPAWNED = "GRAPHFUSE_COMPILE_WORKER_SPAWNED"
# Strategy(compile_workers="auto"): one compile process (this one included) per CORES_PER_PROCESS
# cores of this rank's share of the host, at most MOST_WORKERS workers. Measured on one H200
# host of 16 cores, GPT-2 small in bf16 autocast, 1, 2 or 4 starts at once (docs/benchmarks.md,
# "How many compile workers"): with 16 cores a start, 3 workers were fastest (1 and 0 slower);
# with 8, 1 (3 and 0 slower); with 4, none (1 slower). 7 were no faster than 3 with 16 cores.
CORES_PER_PROCESS, MOST_WORKERS = 4, 3


class Workers:
    """Processes waiting for one compile job (their stdin gives the job's directory)."""

    def __init__(self, n: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="graphfuse-compile-"))
        threads = pool_share(n)  # inductor's kernel-compile pool, per process
        # The spawn time (wall clock) is what a worker's timeline counts from (`main`).
        self.spawned = time.time()
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(threads), SPAWNED: repr(self.spawned)}
        # This graphfuse, also from a source tree; last on the path, so it shadows nothing.
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds graphfuse/
        code = f"import sys; sys.path.append({root!r}); from graphfuse.compiler.worker import main; sys.exit(main())"
        self.procs = []
        for i in range(n):
            with open(self.dir / f"worker-{i}.log", "wb") as err:
                cmd = [sys.executable, "-c", code]
                self.procs.append(
                    subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env)
                )
        # A DistModel dropped before its first step (or a failed start) leaves no process or directory behind.
        self._end = weakref.finalize(self, _end, self.procs, self.dir)

    def send(self, job: Path) -> None:
        for p in self.procs:
            assert p.stdin is not None  # started with stdin=PIPE
            try:
                p.stdin.write(f"{job}\n".encode())
                p.stdin.close()
            except (BrokenPipeError, OSError):  # a worker that died is seen as dead when waited for
                pass

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def close(self) -> None:
        """End the workers and remove their directory, logging what a worker that failed wrote
        to stderr. Called when every piece is compiled (a worker's, or here in its place): a
        worker still running has nothing left to give, so it is killed rather than waited for."""
        for i, p in enumerate(self.procs):
            if p.poll() is not None and p.returncode:
                tail = (self.dir / f"worker-{i}.log").read_text(errors="replace")[-2000:]
                log.warning("graphfuse: compile worker %d exited with %s:\n%s", i, p.returncode, tail)
            log.info("graphfuse: compile worker %d: %s (pid %d)", i, _report(self.dir / f"times-{p.pid}"), p.pid)
        self._end()


def how_many(setting: int | str, compile: str, device_type: str, world_size: int) -> int:
    """The compile workers Strategy.compile_workers asks for in this process: an int as it is;
    "auto": none unless inductor compiles for CUDA (on the CPU the step's kernels run on the
    cores the workers would take, and no CPU host was measured), else one process per
    CORES_PER_PROCESS cores of this rank's share of the host, less this one, at most MOST_WORKERS."""
    if setting != "auto":
        return int(setting)
    if compile != "inductor" or device_type != "cuda":
        return 0
    cores, bound = host_cores()
    share = cores if bound else cores // local_ranks(world_size)
    return max(0, min(MOST_WORKERS, share // CORES_PER_PROCESS - 1))


def host_cores() -> tuple[int, bool]:
    """The cores this process may run on, and whether that is fewer than the host has (a
    launcher that binds each rank to cores of its own: then they are already its share)."""
    total = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return allowed, allowed < total


def local_ranks(world_size: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else one per GPU up to the world size."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, min(world_size, torch.cuda.device_count()))


def pool_share(n: int) -> int:
    """Processes in each kernel-compile pool when n workers and this process compile at once:
    inductor's compile_threads (its default: the cores, up to 32) shared among them. On one
    H200's 16 cores, pieces compiled faster with every pool at 4 than with this process's at
    16 (two runs on two machines: suggestive, not a measured ratio; docs/data/benchmarks-history.md)."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._inductor.config as config

    return max(1, (config.compile_threads or os.cpu_count() or 1) // (n + 1))


def warm_pool(n: int) -> None:
    """Start this process's kernel-compile pool now (graphfuse.compiler.inductor.warm_workers), sized
    to its `pool_share` when n compile workers share the machine. compile_threads is not in
    inductor's cache keys, and is restored once the pool has started."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._inductor.config as config

    if not n:
        return inductor.warm_workers()
    with config.patch(compile_threads=pool_share(n)):
        inductor.warm_workers()


def _end(procs: list[subprocess.Popen], where: Path) -> None:
    for p in procs:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(where, ignore_errors=True)


def _report(path: Path) -> str:
    """A worker's timeline for the log; a report that is missing or unreadable is said so (the
    log never fails the compile)."""
    if not path.exists():
        return "no report (it was killed while starting or preparing its pieces, once every piece was compiled)"
    try:
        return _timeline(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable report ({type(e).__name__}: {e})"


def _timeline(t: dict) -> str:
    """A worker's seconds since it was spawned, as `work` reports them."""
    names = (
        ("imports_s", "imports"),
        ("pool_s", "kernel-build pool"),
        ("cuda_s", "CUDA runtime"),
        ("job_s", "job came"),
        ("ready_s", "pieces prepared"),
    )
    marks = ", ".join(f"{label} {t[k]:.2f}" for k, label in names if k in t)
    pieces = [f"piece {j + 1} in {s:.2f} ({phases_text(spent)})" for j, s, spent in t.get("compiled", [])]
    pieces += [f"piece {j + 1} failed" for j in t.get("failed", [])]
    return f"seconds since it was spawned: {marks}; {', '.join(pieces) or 'no piece claimed'}"


class Propagator:
    """The step graph's values on fake tensors, computed in graph order as far as asked."""

    def __init__(self, gm: torch.fx.GraphModule, examples: list[torch.Tensor]) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.interp = torch.fx.Interpreter(gm)
        self.interp.env = {
            n: self.mode.from_tensor(x, static_shapes=True) for n, x in zip(placeholders(gm.graph), examples)
        }
        self.rest = iter([n for n in gm.graph.nodes if n.op not in ("placeholder", "output")])

    def values(self, nodes: list[torch.fx.Node]) -> list[torch.Tensor]:
        env = self.interp.env
        with self.mode:
            for n in nodes:
                while n not in env:
                    nxt = next(self.rest)
                    env[nxt] = self.interp.run_node(nxt)
        return [env[n] for n in nodes]


def write_job(job: Path, program, n_pieces: int, example_inputs: list[torch.Tensor]) -> None:
    """What a worker needs to cut and compile the same pieces: the program file, the number of
    pieces, the inputs' shapes, strides and dtypes (job.json, written last), and `compile_settings.settings()`."""
    save_program(program, job / "program")
    write_whole(job / "settings.pkl", pickle.dumps(compile_settings.settings()))
    spec = {"pieces": n_pieces, "inputs": [strided_meta(x) for x in example_inputs]}
    write_whole(job / "job.json", json.dumps(spec).encode())


def compile_pieces(program, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], workers: Workers):
    """The step `gm` cut into len(workers.procs) + 1 pieces and compiled by this process and
    the workers; returns a PieceRunner. Closes `workers`."""
    try:
        # Without inductor's caches no worker's compile reaches this process: the step is compiled whole here.
        cached = compile_settings.caches_on()
        pieces = split(gm, len(workers.procs) + 1 if cached else 1)
        job = workers.dir
        first = claim(job, 0)  # before any worker hears of the job: this process starts at once
        if len(pieces) > 1:
            try:
                write_job(job, program, len(pieces), example_inputs)
                workers.send(job)
                log.info(
                    "graphfuse: compile job for %d pieces sent to the workers %.2f s after they were spawned",
                    len(pieces),
                    time.time() - workers.spawned,
                )
            except Exception as e:  # e.g. an inductor setting that cannot be pickled: the pieces are compiled here
                log.warning(
                    "graphfuse: cannot hand the compile to the workers (%s: %s); compiling every piece here",
                    type(e).__name__,
                    e,
                )
        else:
            log.info(
                "graphfuse: compiling the step in this process only (%d piece(s); inductor's caches %s)",
                len(pieces),
                "on" if cached else "off",
            )
        prop = Propagator(gm, example_inputs)
        fns: list = [None] * len(pieces)
        longest = 0.0
        for j, piece in enumerate(pieces):
            if first if j == 0 else claim(job, j):
                t, before = time.perf_counter(), phase_seconds()
                fns[j] = compile_graph(piece.gm, prop.values(piece.inputs))
                took = time.perf_counter() - t
                longest = max(longest, took)
                log.info(
                    "graphfuse: piece %d of %d compiled here in %.2f s (%s)",
                    j + 1,
                    len(pieces),
                    took,
                    phases_text(phases_since(before)),
                )
        # A worker that is alive but never finishes must not hang the step: past this, its piece is compiled here.
        deadline = time.monotonic() + max(WAIT_MIN_S, WAIT_FACTOR * longest)
        for j, piece in enumerate(pieces):
            if fns[j] is None:
                fns[j] = _from_worker(job, j, piece, prop, workers, deadline)
        return PieceRunner(gm, pieces, fns)
    finally:
        workers.close()


def _from_worker(job: Path, j: int, piece, prop: Propagator, workers: Workers, deadline: float):
    """Piece j, compiled by a worker: loaded from the cache once the worker is done (compiled
    here if it failed, died, is past `deadline`, or its result is not found in the cache)."""
    # on first use: torch._dynamo comes with inductor, which `import graphfuse` never needs
    from torch._dynamo.utils import counters

    t = time.perf_counter()
    while not (job / f"done-{j}").exists() and not (job / f"failed-{j}").exists() and workers.alive():
        if time.monotonic() > deadline:
            log.warning("graphfuse: a compile worker has not finished piece %d in time; compiling it here", j + 1)
            break
        time.sleep(POLL_S)
    waited, done = time.perf_counter() - t, (job / f"done-{j}").exists()
    if (job / f"failed-{j}").exists():
        log.warning(
            "graphfuse: a compile worker failed on piece %d; compiling it here:\n%s",
            j + 1,
            (job / f"failed-{j}").read_text()[-2000:],
        )
    elif not done:
        log.warning("graphfuse: the compile workers ended without piece %d; compiling it here", j + 1)
    t = time.perf_counter()
    examples = prop.values(piece.inputs)
    t, fakes_s = time.perf_counter(), time.perf_counter() - t
    hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    fn = compile_graph(piece.gm, examples)
    if done:
        w = json.loads((job / f"done-{j}").read_text())
        log.info(
            "graphfuse: piece %d compiled by worker %s in %.2f s (its timeline: below); waited %.2f s, its inputs' "
            "fake values took %.2f s, loaded here in %.2f s",
            j + 1,
            w["pid"],
            w["compile_s"],
            waited,
            fakes_s,
            time.perf_counter() - t,
        )
        if counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"] == hits:
            log.warning(
                "graphfuse: piece %d, compiled by a worker, was not found in inductor's cache and was compiled again "
                "here (a compile setting this process has and the worker lacked?)",
                j + 1,
            )
    return fn
