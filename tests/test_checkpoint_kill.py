"""SIGKILL at random points of a save loop, sync or async (bounded, seeded trials, one process): the last
complete checkpoint always loads, and bitwise equals the state after the step it records."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_checkpoint import batch, compile_, make

import graphfuse as gf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
HERE = os.path.dirname(os.path.abspath(__file__))


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
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_checkpoint_kill as t; t.child({str(path)!r}, {mode!r}, {async_!r})"
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
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
