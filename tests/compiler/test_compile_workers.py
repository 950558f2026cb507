"""Strategy.compile_workers (graphfuse/compiler/workers.py): worker processes compile pieces of
the step into inductor's on-disk caches, and the main process finds them there. Real processes
and real inductor compiles, on a small MLP so that the CPU compiles stay short."""

from __future__ import annotations

import copyreg
import json
import logging
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from torch._dynamo.utils import counters

import graphfuse as gf
from graphfuse.compiler import settings as compile_settings
from graphfuse.compiler import workers as W
from graphfuse.compiler.in_place import in_place_graph
from graphfuse.compiler.inductor import compile_graph
from graphfuse.compiler.pieces import split
from graphfuse.runtime.batches import flatten_batch
from graphfuse.runtime.execute import arguments


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty inductor cache of this test's own, for this process and the workers it starts."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def test_pieces_a_worker_compiled_are_found_in_the_cache_here(tmp_path, cache):
    model, opt = _mlp()
    batch = _batches(1)[0]
    dm = gf.compile(model, opt, _loss, batch, gf.Strategy(compile="inductor"))
    args = arguments(dm.program, dm.tensors, flatten_batch(batch)[1])
    gm = in_place_graph(dm.program)
    pieces = split(gm, 2)
    assert len(pieces) == 2
    job = tmp_path / "job"
    job.mkdir()
    W.write_job(job, dm.program, len(pieces), args)
    worker = [sys.executable, "-c", "import sys; from graphfuse.compiler.worker import main; sys.exit(main())"]
    done = subprocess.run(worker, input=f"{job}\n", capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in job.glob("done-*")) == ["done-0", "done-1"]  # nobody else claimed
    # Its timeline, for the main process's log: the phases in order, the pieces from the last down.
    times = json.loads(next(job.glob("times-*")).read_text())
    assert times["imports_s"] <= times["pool_s"] <= times["job_s"] <= times["ready_s"], times
    assert [j for j, _, _ in times["compiled"]] == [1, 0] and all(s > 0 for _, s, _ in times["compiled"]), times
    # torch's phases of each piece's compile, which add up to no more than the piece's time
    assert all("GraphLowering.run" in spent and sum(spent.values()) <= s + 0.05 for _, s, spent in times["compiled"]), (
        times
    )
    assert (
        "piece 2 in" in W._timeline(times)
        and "GraphLowering.run" in W._timeline(times)
        and "pieces prepared" in W._timeline(times)
    )
    (tmp_path / "torn").write_text('{"imports_s": 1.0, "compiled": [[0')  # the log says so, and raises nothing
    assert W._report(tmp_path / "torn").startswith("unreadable report (JSONDecodeError")
    assert W._report(tmp_path / "absent").startswith("no report")
    prop = W.Propagator(gm, args)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    fns = [compile_graph(p.gm, prop.values(p.inputs)) for p in pieces]
    assert counters["aot_autograd"]["autograd_cache_hit"] - hits == 2
    assert len(fns) == 2 and all(callable(f) for f in fns)


def _train(workers: int, caplog=None):
    model, opt = _mlp()
    batches = _batches()
    dm = gf.compile(
        model, opt, _loss, batches[0], gf.Strategy(compile="inductor", compile_workers=workers, bucket_size_mb=0.0005)
    )
    losses = torch.stack([dm(b) for b in batches])
    return losses, [p.detach().clone() for p in model.parameters()], dm


def test_a_step_compiled_in_pieces_matches_the_step_compiled_whole(cache, caplog):
    ref_losses, ref_params, _ = _train(0)
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        losses, params, dm = _train(1)
    assert "piece 1 of 2 compiled here" in caplog.text, caplog.text  # claimed before the workers hear of the job
    assert "piece 2 of 2 compiled here" in caplog.text or "piece 2 compiled by worker" in caplog.text, caplog.text
    assert "not found in inductor's cache" not in caplog.text and "compiling it here" not in caplog.text, caplog.text
    assert dm._workers is None  # handed to the first compile, and closed by it
    assert "compile worker 0: " in caplog.text, caplog.text  # its timeline, or why there is none
    # The pieces are fused apart at their cut: not the same kernels, so not bitwise.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_workers_that_died_leave_the_compile_to_this_process(cache, caplog):
    ref_losses, _, _ = _train(0)
    model, opt = _mlp()
    batches = _batches()
    dm = gf.compile(model, opt, _loss, batches[0], gf.Strategy(compile="inductor", compile_workers=2))
    for p in dm._workers.procs:  # killed before the first step hands them the job
        p.kill()
        p.wait()
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        losses = torch.stack([dm(b) for b in batches])
    assert "compile worker 0 exited with -9" in caplog.text and "compile worker 1 exited with -9" in caplog.text
    assert "piece 2 of 2 compiled here" in caplog.text or "piece 2 of 3 compiled here" in caplog.text
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_compile_workers_is_checked():
    with pytest.raises(gf.UnsupportedError, match="compile='inductor'"):
        gf.Strategy(compile_workers=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(gf.UnsupportedError, match="compile_workers must be an int >= 0"):
            gf.Strategy(compile="inductor", compile_workers=bad)


def test_shard_optimizer_refuses_compile_workers():
    model, opt = _mlp()
    with pytest.raises(gf.UnsupportedError, match="set compile_workers=0"):
        gf.shard_optimizer(opt, model=model, strategy=gf.Strategy(compile="inductor", compile_workers=1))


def test_settings_reach_a_worker_as_they_are_here():
    before = compile_settings.settings()
    compile_settings.apply(before)
    after = compile_settings.settings()
    assert after["flags"] == before["flags"] and after["deterministic"] == before["deterministic"]
    assert after["cache_dir"] == before["cache_dir"]


def test_a_worker_takes_this_processs_thread_count(tmp_path):
    """torch's thread count is in the cache key of C++ kernels: a worker with its own default
    compiled pieces that a rank with one thread (launch.run_ranks) never found in the cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (tmp_path / "settings.pkl").write_bytes(pickle.dumps(compile_settings.settings()))
    finally:
        torch.set_num_threads(threads)
    code = (
        "import pickle, sys, torch; from graphfuse.compiler import settings as compile_settings; "
        "torch.set_num_threads(2); "
        "compile_settings.apply(pickle.load(open(sys.argv[1], 'rb'))); print(torch.get_num_threads())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "settings.pkl")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1"]


def test_a_worker_compiles_programs_with_this_processs_graphfuse_settings(tmp_path, monkeypatch):
    """graphfuse.compiler.inductor's FIRST_STEP and COMPILE_SPEED are in the cache key (they patch
    inductor's config): a worker with the module's defaults missed every piece of a process
    that had changed them (tools/bench_first_step.py's autotuned variant did)."""
    from graphfuse.compiler import inductor

    monkeypatch.setattr(inductor, "FIRST_STEP", {})
    (tmp_path / "settings.pkl").write_bytes(pickle.dumps(compile_settings.settings()))
    code = (
        "import pickle, sys; from graphfuse.compiler import inductor, settings as compile_settings; "
        "compile_settings.apply(pickle.load(open(sys.argv[1], 'rb'))); print(inductor.FIRST_STEP, "
        "len(inductor.COMPILE_SPEED))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "settings.pkl")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["{}", str(len(inductor.COMPILE_SPEED))]


def test_a_worker_that_never_finishes_its_piece_does_not_hang_the_step(cache, caplog, monkeypatch):
    monkeypatch.setattr(W, "WAIT_MIN_S", 1.0)
    monkeypatch.setattr(W, "WAIT_FACTOR", 0.0)
    ref_losses, _, _ = _train(0)
    model, opt = _mlp()
    batches = _batches()
    dm = gf.compile(
        model, opt, _loss, batches[0], gf.Strategy(compile="inductor", compile_workers=1, bucket_size_mb=0.0005)
    )
    workers = dm._workers
    workers.procs[0].kill()
    workers.procs[0].wait()
    # In its place, a process that holds piece 2 and never finishes it (a hung compile).
    workers.procs[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.PIPE)
    (workers.dir / "claim-1").touch()
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        losses = torch.stack([dm(b) for b in batches])
    assert "has not finished piece 2 in time; compiling it here" in caplog.text, caplog.text
    assert workers.procs[0].poll() is not None  # ended with the compile
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_settings_that_cannot_reach_a_worker_leave_every_piece_here(cache, caplog, monkeypatch):
    real = compile_settings.settings
    monkeypatch.setattr(
        compile_settings, "settings", lambda: {**real(), "inductor": lambda: None}
    )  # as a custom pass would be
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        losses, _, _ = _train(1)
    assert "cannot hand the compile to the workers (" in caplog.text and "can't pickle" in caplog.text.lower(), (
        caplog.text
    )
    assert "piece 2 of 2 compiled here" in caplog.text
    ref_losses, _, _ = _train(0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_a_dist_model_dropped_before_its_first_step_leaves_no_worker_behind():
    import gc

    model, opt = _mlp()
    dm = gf.compile(model, opt, _loss, _batches(1)[0], gf.Strategy(compile="inductor", compile_workers=2))
    procs, where = list(dm._workers.procs), dm._workers.dir
    assert where.is_dir() and all(p.poll() is None for p in procs)
    del dm
    gc.collect()
    assert all(p.poll() is not None for p in procs) and not where.exists()


def test_without_inductors_caches_the_step_is_compiled_whole_here(cache, caplog):
    import torch._inductor.config as config

    # config.patch, not monkeypatch: undoing a monkeypatch deletes the config entry.
    with config.patch(fx_graph_cache=False), caplog.at_level(logging.INFO, logger="graphfuse"):
        _train(1)
    assert "compiling the step in this process only (1 piece(s); inductor's caches off)" in caplog.text, caplog.text
    assert "piece 1 of 1 compiled here" in caplog.text


def test_the_kernel_compile_pools_share_inductors_compile_threads(monkeypatch):
    """Each process's kernel-compile pool gets compile_threads / (workers + 1): the main
    process's while it starts, and each worker's through its environment."""
    import torch._inductor.config as config

    import graphfuse.compiler.inductor

    with config.patch(compile_threads=8):
        assert [W.pool_share(n) for n in (0, 1, 3, 7, 9)] == [8, 4, 2, 1, 1]
        seen = []
        monkeypatch.setattr(graphfuse.compiler.inductor, "warm_workers", lambda: seen.append(config.compile_threads))
        W.warm_pool(3)
        W.warm_pool(0)
        assert seen == [2, 8] and config.compile_threads == 8  # restored once the pool has started
        workers = W.Workers(3)
        try:
            env = [_environ_after_exec(p.pid) for p in workers.procs]
        finally:
            workers.close()
        assert all(b"TORCHINDUCTOR_COMPILE_THREADS=2" in e for e in env), env


def _environ_after_exec(pid: int, timeout: float = 30.0) -> list[bytes]:
    """A worker's environment once it runs the worker's code: before its exec /proc shows the
    parent's environment, and during it an empty one (what a busy machine showed CI once)."""
    deadline = time.monotonic() + timeout
    while True:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        environ = open(f"/proc/{pid}/environ", "rb").read()
        if b"graphfuse.compiler.worker" in cmdline and environ or time.monotonic() > deadline:
            return environ.split(b"\0")
        time.sleep(0.05)


def _worker_on_rank(rank: int, world: int, where: str) -> dict:
    """On rank 0 of a Gloo group: a worker compiles both pieces of this rank's step (each
    holds a collective), and this process finds them in the cache."""
    from pathlib import Path

    from graphfuse.compiler.pieces import issues_collective

    model, opt = _mlp()
    batch = _batches(1)[0]
    dm = gf.compile(model, opt, _loss, batch, gf.Strategy(compile="inductor", bucket_size_mb=0.0005))
    if rank:
        return {}
    args = arguments(dm.program, dm.tensors, flatten_batch(batch)[1])
    gm = in_place_graph(dm.program)
    pieces = split(gm, 2)
    job = Path(where)
    W.write_job(job, dm.program, len(pieces), args)
    worker = [sys.executable, "-c", "import sys; from graphfuse.compiler.worker import main; sys.exit(main())"]
    done = subprocess.run(worker, input=f"{job}\n", capture_output=True, text=True, timeout=600, env=os.environ)
    prop = W.Propagator(gm, args)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    for p in pieces:
        compile_graph(p.gm, prop.values(p.inputs))
    return {
        "group": dm.program.group_name,
        "collectives": [sum(map(issues_collective, p.gm.graph.nodes)) for p in pieces],
        "rc": done.returncode,
        "stderr": done.stderr[-3000:],
        "markers": sorted(p.name for p in job.glob("done-*")) + sorted(p.name for p in job.glob("failed-*")),
        "failed": [(job / f"failed-{j}").read_text()[-2000:] for j in range(2) if (job / f"failed-{j}").exists()],
        "hits": counters["aot_autograd"]["autograd_cache_hit"] - hits,
    }


def test_a_worker_compiles_pieces_that_hold_collectives(tmp_path, cache):
    """Inductor resolves the graph's process group by name while it compiles; a worker, in no
    group, stands torch's fake group in under that name (compile_worker.stand_in_group)."""
    from graphfuse.testing.launch import run_ranks

    (tmp_path / "job").mkdir()
    out = run_ranks(_worker_on_rank, 2, str(tmp_path / "job"), timeout=900)[0]
    assert out["group"] and all(n > 0 for n in out["collectives"]), out  # both pieces hold a collective
    assert out["rc"] == 0, out["stderr"]
    assert out["markers"] == ["done-0", "done-1"], out["failed"]
    assert out["hits"] == 2, out  # both found in the cache here


_KEY_PROBE = """
import sys, types
if sys.argv[1] == "early":  # a module that holds torch, ahead of torch's own (as __mp_main__ is in a spawned rank)
    holder = types.ModuleType("holds_torch"); sys.modules["holds_torch"] = holder
import pickle, torch
if sys.argv[1] == "early":
    holder.torch = torch
from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key
from graphfuse.compiler.inductor import same_keys_in_every_process
meta = extract_tensor_metadata_for_cache_key(torch.empty(3))
plain = pickle.dumps(meta)
with same_keys_in_every_process():
    stable = FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).get_hash(meta)
print(plain.hex(), stable)
"""


def test_inductor_cache_keys_do_not_depend_on_which_modules_hold_torch():
    """A memory format pickles by the name "torch.contiguous_format", which pickle resolves by
    searching sys.modules: the same graph got one key in a rank started by multiprocessing's
    spawn and another in its compile worker. Under graphfuse.compiler.inductor.same_keys_in_every_process
    the key is the same in both kinds of process."""
    out = {}
    for how in ("plain", "early"):
        done = subprocess.run([sys.executable, "-c", _KEY_PROBE, how], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out[how] = done.stdout.split()
    assert out["plain"][0] != out["early"][0], (
        "memory formats now pickle alike everywhere: same_keys_in_every_process can go"
    )
    assert out["plain"][1] == out["early"][1]
    # What such a pickle loads as: the same format; a name that is not a format is refused.
    from graphfuse.compiler.inductor import memory_format, same_keys_in_every_process

    with same_keys_in_every_process():
        data = pickle.dumps([torch.channels_last, torch.contiguous_format])
    assert pickle.loads(data) == [torch.channels_last, torch.contiguous_format]
    assert torch.memory_format not in copyreg.dispatch_table  # only while compiling
    with pytest.raises(gf.ProgramFormatError, match="no memory format named 'zeros'"):
        memory_format("zeros")
