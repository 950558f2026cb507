"""The resharding chain peers got wrong: three buckets with shards that cut parameters
unevenly, a bucket size changed at every hop, world size 2 -> 3 -> 4 -> 2, starting from an
unbalanced checkpoint converted offline; every hop bitwise, and the resumed run bitwise."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_ranks
from test_checkpoint import assert_same_tensors, batch, compile_, make, read_all

import graphfuse as gf
from graphfuse import checkpoint_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BUCKET_MB = {2: 0.001, 3: 0.0015, 4: 0.003}  # ~3, 2 and 1 buckets of the 624-parameter Net
RESUME = range(3, 6)


def first(rank: int, world: int, root: str) -> dict:
    """Train 3 steps at world size 2, save unbalanced and balanced, go on for 3 steps."""
    model, opt, _ = make(0)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32, BUCKET_MB[2])
    for i in range(3):
        dm(batch(rank, i))
    gf.save(dm, os.path.join(root, "u2"))
    gf.save(dm, os.path.join(root, "b2"), mode="balanced")
    return {"buckets": len(dm.layout.buckets), "losses": [dm(batch(rank, i)).item() for i in RESUME]}


def hop(rank: int, world: int, root: str, src: str, dst: str) -> dict:
    """Load `src` at this world size and bucket size, and save it again as `dst`."""
    model, opt, _ = make(world)
    dm = compile_(rank, model, opt, "balanced", torch.float32, BUCKET_MB[world])
    gf.load(dm, os.path.join(root, src))
    gf.save(dm, os.path.join(root, dst))
    return {"buckets": len(dm.layout.buckets), "steps": list(dm.steps)}


def last(rank: int, world: int, root: str) -> dict:
    model, opt, _ = make(9)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32, BUCKET_MB[2])
    gf.load(dm, os.path.join(root, "b4"))
    return {"steps": list(dm.steps), "losses": [dm(batch(rank, i)).item() for i in RESUME]}


def test_balanced_chain_2_3_4_2_with_changed_buckets_is_bitwise(tmp_path):
    root = str(tmp_path)
    start = run_ranks(first, 2, root)
    checkpoint_cli.cli_convert(os.path.join(root, "u2"), os.path.join(root, "c2"), "balanced")
    assert_same_tensors(read_all(os.path.join(root, "b2")), read_all(os.path.join(root, "c2")), "converted")
    three = run_ranks(hop, 3, root, "c2", "b3")
    four = run_ranks(hop, 4, root, "b3", "b4")
    counts = [start[0]["buckets"], three[0]["buckets"], four[0]["buckets"]]
    assert counts[0] >= 3 and counts[0] != counts[1] != counts[2], counts  # another layout at every hop
    assert all(r["steps"] == [3] for r in three + four)
    for name in ("b3", "b4"):
        assert_same_tensors(read_all(os.path.join(root, "b2")), read_all(os.path.join(root, name)), name)
    end = run_ranks(last, 2, root)
    for r, s in zip(end, start):
        assert r["steps"] == [3] and r["losses"] == s["losses"]
