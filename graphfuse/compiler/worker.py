"""A compile worker process (Strategy.compile_workers; the main process's side:
graphfuse/compiler/workers.py). It starts with the DistModel, imports torch and inductor and
starts its kernel-build pool while the main process captures the step, then waits on stdin for
the job's directory. It cuts the job's program into the same pieces as the main process and
compiles, from the last piece down, every piece it can claim, into inductor's on-disk caches.
Its timeline (seconds since it was spawned) goes to the job's directory for the main
process's log."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse.compiler import settings as compile_settings
from graphfuse.compiler.in_place import in_place_graph
from graphfuse.compiler.inductor import compile_graph, phase_seconds, phases_since, warm_workers
from graphfuse.compiler.jobs import claim, mark, write_whole
from graphfuse.compiler.pieces import split
from graphfuse.compiler.workers import SPAWNED, Propagator
from graphfuse.program_files import load_program


def fake_from_meta(mode, m: dict) -> torch.Tensor:
    """A fake tensor of `strided_meta` m (graphfuse/compiler/jobs.py): a view of a larger one only
    for a storage offset."""
    dtype = getattr(torch, m["dtype"])
    with mode:
        if not m["offset"]:
            return torch.empty_strided(m["shape"], m["stride"], dtype=dtype, device=m["device"])
        need = m["offset"] + 1 + sum((s - 1) * st for s, st in zip(m["shape"], m["stride"]))
        base = torch.empty(need if all(m["shape"]) else m["offset"], dtype=dtype, device=m["device"])
        return base.as_strided(m["shape"], m["stride"], m["offset"])


def stand_in_group(world_size: int, rank: int, name: str) -> None:
    """Inductor looks the graph's process group up by its name while it compiles (its size, for
    the collectives' layouts and its debug artifacts), and a worker has none: torch's fake
    process group, of the main process's size and rank, stands in under the same name. A
    worker runs no collective; the compiled code looks the group up by name when it runs, in
    the main process, where the name is the real group's."""
    # only a worker whose program names a group: torch's test-only fake backend, registered on import
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.distributed_c10d import GroupName, _register_process_group

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    world = dist.group.WORLD
    assert world is not None, "init_process_group set no world group"  # torch types it optional
    if world.group_name != name:
        _register_process_group(GroupName(name), world)


def work(job: Path, started: float, times: dict) -> None:
    """A worker's job: the same pieces as the main process, compiled from the last one down.
    `times` (this worker's seconds since it was spawned) gains when the job came, when its
    pieces were prepared, and each piece's compile with torch's phases in it (`main` writes it
    for the main process's log); each piece's marker carries who compiled it and how long it took."""
    times["job_s"] = time.time() - started
    spec = json.loads((job / "job.json").read_text())
    if all((job / f"claim-{j}").exists() for j in range(spec["pieces"])):
        return  # the main process took every piece (their compiles were in the cache)
    compile_settings.apply(pickle.loads((job / "settings.pkl").read_bytes()))
    devices = {m["device"] for m in spec["inputs"] if m["device"].startswith("cuda")}
    if devices:
        torch.cuda.set_device(torch.device(sorted(devices)[0]))
    program = load_program(job / "program")
    if program.group_name:
        stand_in_group(program.world_size, program.rank, program.group_name)
    gm = in_place_graph(program)
    pieces = split(gm, spec["pieces"])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    prop = Propagator(gm, [fake_from_meta(mode, m) for m in spec["inputs"]])
    times["ready_s"] = time.time() - started
    times["compiled"] = []
    for j in reversed(range(len(pieces))):
        if claim(job, j):
            t, before = time.perf_counter(), phase_seconds()
            try:
                compile_graph(pieces[j].gm, prop.values(pieces[j].inputs))
                took = time.perf_counter() - t
                times["compiled"].append((j, took, phases_since(before)))
                mark(job, j, "done", json.dumps({"compile_s": took, "pid": os.getpid()}))
            except Exception:
                times.setdefault("failed", []).append(j)
                mark(job, j, "failed", traceback.format_exc())


def main() -> int:
    started = float(os.environ.get(SPAWNED) or time.time())  # wall clock: counted from the spawn
    import torch._inductor.compile_fx  # noqa: F401  (here, timed: the imports, while the main process captures)

    times = {"imports_s": time.time() - started}
    warm_workers()  # this process's own pool of kernel-compile workers, started while it waits
    times["pool_s"] = time.time() - started
    if torch.cuda.is_available():
        torch.cuda.init()  # the CUDA runtime too (the device is chosen when the job comes)
        times["cuda_s"] = time.time() - started
    line = sys.stdin.readline().strip()
    if not line:  # the DistModel never compiled, or compiled without workers
        return 0
    try:
        work(Path(line), started, times)
    finally:  # for the main process's log (Workers.close)
        write_whole(Path(line) / f"times-{os.getpid()}", json.dumps(times).encode())
    return 0
