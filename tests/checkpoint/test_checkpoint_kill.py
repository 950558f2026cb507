"""SIGKILL at random points of a save loop, sync or async (bounded, seeded trials, one process), and of
either rank of two Gloo ranks saving, saving in the background or loading: the last complete
checkpoint always loads, and bitwise equals the state after the step it records."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import graphfuse as gf
from tests._common import ROOT, run_ranks
from tests.checkpoint.test_checkpoint import batch, compile_, make

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HERE = str(ROOT)  # on sys.path of the child, which imports this module as tests.checkpoint.test_checkpoint_kill


def trained(steps: int, seed: int = 3):
    model, opt, _ = make(seed)
    dm = compile_(0, model, opt, "unbalanced", torch.float32)
    for i in range(steps):
        dm(batch(0, i))
    return dm


def child(path: str, mode: str, async_: bool) -> None:
    """Train and save after every step, forever (async: the next step runs while the save
    is written); say "ready" once a checkpoint exists."""
    dm = trained(1)
    gf.save(dm, path, mode=mode, extra={"steps": 1})
    print("ready", flush=True)
    i = 1
    while True:
        handle = gf.save(dm, path, mode=mode, extra={"steps": i}, async_=async_)
        dm(batch(0, i))
        i += 1
        if handle is not None:
            handle.wait()


@pytest.mark.parametrize("mode, async_", [("unbalanced", False), ("balanced", False), ("unbalanced", True)])
def test_sigkill_during_saves_always_leaves_a_checkpoint_that_loads_bitwise(tmp_path, mode, async_):
    rng = random.Random(f"kill-{mode}-{async_}")
    path = tmp_path / "ckpt"
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); import tests.checkpoint.test_checkpoint_kill as t; "
        f"t.child({str(path)!r}, {mode!r}, {async_!r})"
    )
    for trial in range(3):
        with open(tmp_path / f"child{trial}.err", "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True)
        ready = proc.stdout.readline().strip()
        assert ready == "ready", (
            f"trial {trial}: the child ended before saving: {(tmp_path / f'child{trial}.err').read_text()[-3000:]}"
        )
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        dm = trained(0, seed=9)
        steps = gf.load(dm, path)["steps"]
        assert dm.steps == [steps]
        again = trained(steps)
        for name in again.tensors:
            if name.startswith("bucket"):
                assert torch.equal(dm.tensors[name], again.tensors[name]), (steps, name)


# ---- two Gloo ranks: SIGKILL one rank at a random point of a save, an async save, or a load ----
def _digest(dm) -> str:
    """SHA-256 of this rank's checkpointed buffers (buckets and their state shards)."""
    h = hashlib.sha256()
    for name in sorted(dm.tensors):
        if name.startswith("bucket"):
            h.update(name.encode() + dm.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _remember(root: str, rank: int, step: int, dm) -> None:
    """The digest of the state after `step`, written before any save of that state starts."""
    with open(os.path.join(root, f"digest{rank}_{step}"), "w") as f:
        f.write(_digest(dm))


def ranks_loop(rank: int, world: int, root: str, kind: str) -> None:
    """Train 1 step and save; say "ready"; then save after every step (kind "sync" or "async")
    or load that checkpoint again and again (kind "load"), until killed."""
    with open(os.path.join(root, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    path = os.path.join(root, "ckpt")
    model, opt, _ = make(3)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32)
    dm(batch(rank, 0))
    _remember(root, rank, 1, dm)
    gf.save(dm, path, extra={"steps": 1})
    if rank == 0:
        print("ready", flush=True)
    i = 1
    while True:
        if kind == "load":
            gf.load(dm, path)
            continue
        handle = gf.save(dm, path, extra={"steps": i}, async_=kind == "async")
        dm(batch(rank, i))
        i += 1
        _remember(root, rank, i, dm)
        if handle is not None:
            handle.wait()


def check_loads(rank: int, world: int, roots: list[str]) -> list[tuple[int, bool]]:
    """Load each trial's checkpoint into a fresh DistModel: (its step, whether this rank's state
    is bitwise the one recorded after that step)."""
    model, opt, _ = make(9)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32)
    out = []
    for root in roots:
        steps = gf.load(dm, os.path.join(root, "ckpt"))["steps"]
        with open(os.path.join(root, f"digest{rank}_{steps}")) as f:
            out.append((steps, dm.steps == [steps] and _digest(dm) == f.read()))
    return out


def kill_a_rank(root: str, kind: str, victim: int, rng: random.Random) -> None:
    """Run `ranks_loop` on 2 ranks, SIGKILL rank `victim` at a random moment, let the other run
    a little longer, then kill what is left."""
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); import tests.checkpoint.test_checkpoint_kill as t; "
        f"t.launch({root!r}, {kind!r})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: the ranks are killed with it
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.0))
        with open(os.path.join(root, f"pid{victim}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.5))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(root: str, kind: str) -> None:
    run_ranks(ranks_loop, 2, root, kind, timeout=600)


@pytest.mark.parametrize("kind", ["sync", "async", "load"])
def test_sigkill_of_either_rank_during_two_rank_saves_or_loads_keeps_a_checkpoint_that_loads_bitwise(tmp_path, kind):
    rng = random.Random(f"kill-ranks-{kind}")
    roots = []
    for trial, victim in enumerate([0, 1]):
        root = tmp_path / f"trial{trial}"
        root.mkdir()
        kill_a_rank(str(root), kind, victim, rng)
        roots.append(str(root))
    results = run_ranks(check_loads, 2, roots, timeout=120)
    assert all(ok for per_rank in results for _, ok in per_rank), results
    assert results[0] == results[1]
    if kind == "load":
        assert all(steps == 1 for steps, _ in results[0])  # loads never change the checkpoint
