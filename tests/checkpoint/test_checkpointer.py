"""gf.Checkpointer (issue 30): numbered checkpoints, the newest `keep` kept and older ones removed only
after a newer one is complete, the newest complete one found by reading the directory (never a
half-written one), and a resume that is bitwise, with the LR scheduler, each rank's data position,
random generators and extra; at 1 rank in this process and at 2 and 3 real Gloo ranks. The elastic
test runs tools/elastic_resume.py: torchrun --max-restarts 1 and a rank that SIGKILLs itself."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import graphfuse as gf
from graphfuse.atomic_dir import MARKER
from graphfuse.checkpoint import Checkpointer
from graphfuse.checkpoint.manager import complete_steps
from graphfuse.testing.models import SeededLoader
from tests._common import ROOT, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")


def build(rank: int, seed: int, mode: str = "unbalanced"):
    """A small model, AdamW, a step LR schedule and its loader, compiled (two buckets)."""
    torch.manual_seed(seed)
    random.seed(seed + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = SeededLoader(rank)
    strategy = gf.Strategy(checkpoint_mode=mode, bucket_size_mb=0.0005)
    dm = gf.compile(model, opt, lambda m, b: (m(b[0]) - b[1]).square().mean(), loader.next(), strategy=strategy)
    loader.pos = 0
    return dm, sched, loader


def run(dm, sched, loader, ckpt, first: int, last: int) -> None:
    for step in range(first, last + 1):
        dm(loader.next())
        sched.step()
        if ckpt is not None:
            ckpt.maybe_save(step, extra={"rank": dm.rank, "step": step})


def state(dm) -> dict[str, torch.Tensor]:
    dm.sync()
    return {k: v.clone() for k, v in dm.tensors.items() if k.startswith("bucket")}


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- one process ----------------------------------------------------------------------------
def test_keeps_the_newest_k_and_removes_older_ones_only_after_a_newer_one_is_complete(tmp_path):
    dm, sched, loader = build(0, seed=1)
    ckpt = Checkpointer(tmp_path, dm, sched, every=2, keep=2, data=loader)
    saved = [step for step in range(1, 8) if (dm(loader.next()), sched.step(), ckpt.maybe_save(step))[2]]
    assert saved == [2, 4, 6] and complete_steps(tmp_path) == [4, 6]
    assert sorted(os.listdir(tmp_path)) == ["step-000004", "step-000006"]  # nothing else left behind

    asyncs = Checkpointer(tmp_path, dm, sched, every=2, keep=2, async_=True, data=loader)
    asyncs.save(8)
    assert {4, 6} <= set(complete_steps(tmp_path))  # 4 stays while 8 may still be writing
    asyncs.wait()
    assert complete_steps(tmp_path) == [6, 8]
    asyncs.save(10)
    asyncs.save(12)  # joins 10, prunes to {8, 10}, then writes 12
    asyncs.wait()
    assert complete_steps(tmp_path) == [10, 12] and sorted(os.listdir(tmp_path)) == ["step-000010", "step-000012"]


def test_load_latest_skips_half_written_directories_and_resumes_bitwise(tmp_path):
    dm, sched, loader = build(0, seed=1)
    ckpt = Checkpointer(tmp_path, dm, sched, every=3, keep=3, data=loader)
    run(dm, sched, loader, ckpt, 1, 6)
    rng_after_6 = torch.get_rng_state(), random.getstate()
    run(dm, sched, loader, None, 7, 9)
    expected = state(dm)
    good = tmp_path / "step-000006"
    data = sorted(p.name for p in good.iterdir() if p.name.endswith(".distcp"))
    half = {  # what a killed save, a copy in progress or damage leaves, each newer than step 6
        "step-000009.saving": lambda d: (d / MARKER).write_text("{}"),  # a save's staging directory
        "step-000012": lambda d: (d / "graphfuse.json").unlink(),  # no record: not published by gf.save
        "step-000015": lambda d: (d / data[0]).write_bytes(b"x"),  # a file shorter than recorded
        "step-000018": lambda d: (d / MARKER).write_text("{}"),  # a staging marker: not finished
        "step-000021": lambda d: (d / "graphfuse.json").write_text("{"),  # a record cut short
    }
    for name, damage in half.items():
        shutil.copytree(good, tmp_path / name)
        damage(tmp_path / name)
    assert complete_steps(tmp_path) == [3, 6]

    torch.manual_seed(123)
    random.seed(123)
    dm2, sched2, loader2 = build(0, seed=2)
    resumed = Checkpointer(tmp_path, dm2, sched2, every=3, keep=3, data=loader2)
    assert resumed.load_latest() == 6
    assert resumed.extra == {"rank": 0, "step": 6} and loader2.pos == 6 and sched2.last_epoch == 6
    assert torch.equal(torch.get_rng_state(), rng_after_6[0]) and random.getstate() == rng_after_6[1]
    run(dm2, sched2, loader2, None, 7, 9)
    assert bitwise(state(dm2), expected)


def test_refusals_name_the_directory_and_the_way_out(tmp_path):
    dm, sched, loader = build(0, seed=1)
    assert Checkpointer(tmp_path / "none", dm, sched).load_latest() is None  # nothing there: nothing changes
    with pytest.raises(gf.CheckpointError, match="keep must be a whole number >= 1"):
        Checkpointer(tmp_path, dm, keep=0)
    with pytest.raises(gf.CheckpointError, match="data must have state_dict"):
        Checkpointer(tmp_path, dm, data=object())
    ckpt = Checkpointer(tmp_path, dm, sched, every=1, keep=2)
    run(dm, sched, loader, ckpt, 1, 4)
    with pytest.raises(gf.CheckpointError, match=r"step-000004: is newer than step 2.*load_latest\(\)"):
        Checkpointer(tmp_path, dm, sched).save(2)
    gf.save(dm, tmp_path / "step-000005")  # a plain gf.save in the Checkpointer's directory
    with pytest.raises(gf.CheckpointError, match=r"step-000005: its extra.pt is not a Checkpointer's.*gf.load"):
        Checkpointer(tmp_path, dm, sched).load_latest()


# ---- 2 and 3 Gloo ranks ---------------------------------------------------------------------
def _ranks_resume(rank: int, world: int, root: str, mode: str, async_: bool) -> dict:
    """Train 8 steps saving every 2 (keep 2); a fresh job loads the newest complete one (rank 0
    having left a half-written step 8) and trains steps 7, 8 again: bitwise, on every rank."""
    dm, sched, loader = build(rank, seed=1, mode=mode)
    ckpt = Checkpointer(root, dm, sched, every=2, keep=2, async_=async_, data=loader)
    run(dm, sched, loader, ckpt, 1, 6)
    ckpt.wait()
    rng_after_6 = torch.get_rng_state()
    run(dm, sched, loader, None, 7, 8)
    expected = state(dm)
    if rank == 0:
        shutil.copytree(Path(root) / "step-000006", Path(root) / "step-000008.saving")
        (Path(root) / "step-000008.saving" / MARKER).write_text("{}")
    dist.barrier()
    torch.manual_seed(99 + rank)
    dm2, sched2, loader2 = build(rank, seed=2, mode=mode)
    resumed = Checkpointer(root, dm2, sched2, every=2, keep=2, async_=async_, data=loader2)
    step = resumed.load_latest()
    restored = {
        "step": step,
        "extra": resumed.extra,
        "pos": loader2.pos,
        "epoch": sched2.last_epoch,
        "rng": torch.equal(torch.get_rng_state(), rng_after_6),
    }
    run(dm2, sched2, loader2, resumed, 7, 8)
    resumed.wait()  # rank 0 then removes what `keep` leaves out
    dist.barrier()
    return {**restored, "bitwise": bitwise(state(dm2), expected), "kept": complete_steps(root)}


@pytest.mark.parametrize("world, mode, async_", [(2, "balanced", True), (3, "unbalanced", False)])
def test_resume_is_bitwise_with_each_ranks_data_position_and_generators(tmp_path, world, mode, async_):
    results = run_ranks(_ranks_resume, world, str(tmp_path), mode, async_)
    for rank, r in enumerate(results):
        assert r == {
            "step": 6,
            "extra": {"rank": rank, "step": 6},
            "pos": 6,
            "epoch": 6,
            "rng": True,
            "bitwise": True,
            "kept": [6, 8],
        }, (rank, r)


# ---- torchrun --max-restarts 1, a rank SIGKILLed --------------------------------------------
@pytest.mark.parametrize(
    "kill, seed", [("between", 1), ("during", 12)]
)  # rank 1 at step 5; rank 0 before publishing an async save
def test_a_job_killed_between_or_during_saves_restarts_and_ends_bitwise(kill, seed):
    """Four cases in one torchrun job (unbalanced and balanced, sync and async saves); a rank kills
    itself at a random step between two saves, or at a random point of a save; the job restarts and
    each case resumes from its newest complete checkpoint and ends bitwise as with no kill."""
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "elastic_resume.py"),
        "--kill",
        kill,
        "--seed",
        str(seed),
        "--timeout",
        "240",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["all_bitwise"], proc.stdout[-6000:]
    (trial,) = summary["trials"]
    assert set(trial["resumed_from"]) == {"unbalanced-sync", "unbalanced-async", "balanced-sync", "balanced-async"}
