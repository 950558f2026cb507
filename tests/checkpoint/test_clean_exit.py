"""A finished job exits cleanly (issue 30): graphfuse holds no process group past the user's
destroy_process_group() (a group kept alive keeps Gloo's threads, and some exits then abort:
`terminate called without an active exception`, exit -6; 5 of 120 runs in the issue), and a group
the program never destroyed is destroyed at exit, where torch's own shutdown hooks run. The repeat runs
tools/exit_soak.py: torchrun at 1, 2 and 3 ranks, two jobs at a time (the load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
import weakref

import pytest
import torch
import torch.distributed as dist

import graphfuse as gf
from graphfuse import ranks
from graphfuse.testing.launch import RankFailure, run_ranks
from tests._common import ROOT


def _soak(*args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "exit_soak.py"), *args, "--timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def world_of_one():
    """A real one-rank Gloo group in this process, destroyed afterwards whatever happened."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{os.path.join(tmp, 'store')}")
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_destroy_process_group_frees_the_group_and_graphfuse_says_so_after(world_of_one, tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    dm = gf.compile(model, opt, lambda m, b: m(b).square().mean(), torch.randn(3, 4))
    dm(torch.randn(3, 4))
    gf.save(dm, tmp_path / "ckpt", async_=True).wait()
    held = [weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map]
    assert dm.group is dist.group.WORLD
    dist.destroy_process_group()
    assert [r() for r in held] == [None] * len(held)  # nothing of graphfuse's keeps one alive
    # the group is its BoundProgram's (graphfuse/runtime/bound.py); the message names the DistModel
    with pytest.raises(
        gf.UnsupportedError, match="this DistModel was destroyed.*initialise a new group, build a new DistModel"
    ):
        gf.save(dm, tmp_path / "after")  # runs no collective on a destroyed group, says what to do


def test_a_group_the_program_left_alive_is_destroyed_at_exit(world_of_one):
    model = torch.nn.Linear(4, 2)
    gf.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), torch.randn(3, 4))
    ranks.destroy_left_at_exit()  # what atexit runs
    assert not dist.is_initialized()


def test_torchs_default_arguments_keep_no_destroyed_group_past_exit(world_of_one, monkeypatch):
    """torch.distributed.nn.functional, imported after init_process_group(), holds group.WORLD as a
    default argument; destroyed, the group is dropped from there at exit (modelled by a module)."""
    pinned = types.ModuleType("torch.distributed._pinned_by_import")
    exec("import torch.distributed as dist\ndef broadcast(t, src, group=dist.group.WORLD): pass", pinned.__dict__)
    monkeypatch.setitem(sys.modules, pinned.__name__, pinned)
    world = weakref.ref(dist.group.WORLD)
    assert ranks.unpin_destroyed_groups() == 0  # a live group is left alone
    dist.destroy_process_group()
    assert world() is not None  # the import's default argument holds it
    ranks.destroy_left_at_exit()  # what atexit runs
    assert world() is None and pinned.broadcast.__defaults__ == (None,)


def _abort_at_exit(rank: int, world: int) -> str:
    import atexit

    atexit.register(os.abort)  # as Gloo's threads do when a group outlives the interpreter
    return "trained"


def test_run_ranks_refuses_a_rank_that_reports_its_result_and_then_aborts_at_exit():
    """Every multi-rank test (graphfuse.testing.launch.run_ranks) requires a clean exit too."""
    with pytest.raises(RankFailure, match=r"rank 0 failed:\nreturned its result, then exited with code -6"):
        run_ranks(_abort_at_exit, 1)


def test_a_finished_job_exits_cleanly_at_1_2_and_3_ranks():
    """One torchrun job per world size, two at a time; the repeat is every multi-rank test of the
    suite (run_ranks fails a rank that exits non-zero) and tools/exit_soak.py's 100 runs."""
    result = _soak("--runs", "1", "--ranks", "1,2,3", "--parallel", "2", "--save")
    assert result["all_clean"], result["failures"]
    assert [(r["ranks"], r["clean"]) for r in result["rows"]] == [(1, 1), (2, 1), (3, 1)]


def test_a_job_that_never_destroys_its_group_and_imports_graphfuse_late_exits_cleanly():
    result = _soak("--runs", "1", "--ranks", "2", "--no-destroy", "--late-import")
    assert result["all_clean"], result["failures"]
