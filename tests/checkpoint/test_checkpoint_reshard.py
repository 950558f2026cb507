"""The resharding chain peers got wrong: three buckets with shards that cut parameters
unevenly, a bucket size changed at every hop, world size 2 -> 3 -> 4 -> 2, starting from an
unbalanced checkpoint converted offline; every hop bitwise, and the resumed run bitwise. The
same with a parameter frozen after training (its optimizer state carried) and one never stepped."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse.cli import ckpt as checkpoint_cli
from tests._common import run_ranks
from tests.checkpoint.test_checkpoint import assert_same_tensors, batch, compile_, loss_fn, make, read_all

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


# ---- a parameter frozen after training, and one never stepped, through the same chain ---------
class FrozenNet(nn.Module):
    """Net plus `late` (trained, then frozen: its optimizer state must survive) and `never`
    (in the optimizer but frozen from the start: never stepped, so no optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self.low_rank = nn.Linear(16, 16, bias=False)
        self.rank = nn.Linear(16, 8, bias=False)
        self.cube = nn.Parameter(torch.randn(3, 5, 16) * 0.1)
        self.late = nn.Parameter(torch.randn(16) * 0.1)
        self.never = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rank(torch.tanh(self.low_rank(x) + self.cube.mean(dim=(0, 1)) + self.late + self.never))


def frozen_net(rank: int, seed: int, late_trains: bool, bucket_mb: float, mode: str = "balanced", own_group=True):
    torch.manual_seed(seed)
    model = FrozenNet()
    model.never.requires_grad_(False)
    model.late.requires_grad_(late_trains)
    groups = [{"params": [model.low_rank.weight, model.rank.weight, model.cube, model.never]}]
    if own_group:  # its step stops while it is frozen, as torch.optim's per-parameter step does
        groups.append({"params": [model.late], "lr": 0.02})
    else:
        groups[0]["params"].append(model.late)
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, foreach=False)
    strategy = gf.Strategy(bucket_size_mb=bucket_mb, checkpoint_mode=mode)
    return gf.compile(model, opt, loss_fn, batch(rank, 0), strategy=strategy)


def frozen_first(rank: int, world: int, root: str) -> dict:
    """Train 3 steps with `late` trained (t2); freeze it, load t2 and train 3 more; save
    unbalanced (u2) and balanced (b2); then 3 more steps give the losses to resume."""
    dm = frozen_net(rank, 0, True, BUCKET_MB[2])
    for i in range(3):
        dm(batch(rank, i))
    gf.save(dm, os.path.join(root, "t2"))
    dm = frozen_net(rank, 1, False, BUCKET_MB[2])
    gf.load(dm, os.path.join(root, "t2"))
    for i in range(3, 6):
        dm(batch(rank, i))
    gf.save(dm, os.path.join(root, "u2"), mode="unbalanced")
    gf.save(dm, os.path.join(root, "b2"))
    return {"buckets": len(dm.layout.buckets), "losses": [dm(batch(rank, i)).item() for i in range(6, 9)]}


def frozen_hop(rank: int, world: int, root: str, src: str, dst: str) -> dict:
    dm = frozen_net(rank, world, False, BUCKET_MB[world])
    gf.load(dm, os.path.join(root, src))
    gf.save(dm, os.path.join(root, dst))
    return {"buckets": len(dm.layout.buckets), "steps": list(dm.steps)}


def frozen_last(rank: int, world: int, root: str) -> dict:
    """Back at 2 ranks: resume from b4 and from u2 (unbalanced, same layout) with `late` still
    frozen; then unfreeze it and load b4 again: it trains on from its carried state."""
    out = {}
    for name, mode in (("b4", "balanced"), ("u2", "unbalanced")):
        dm = frozen_net(rank, 9, False, BUCKET_MB[2], mode)
        gf.load(dm, os.path.join(root, name))
        out[name] = {"steps": list(dm.steps), "losses": [dm(batch(rank, i)).item() for i in range(6, 9)]}
    dm = frozen_net(rank, 9, True, BUCKET_MB[2])
    gf.load(dm, os.path.join(root, "b4"))
    out["unfrozen_steps"] = list(dm.steps)
    gf.save(dm, os.path.join(root, "f2"))
    out["unfrozen_loss"] = dm(batch(rank, 6)).item()
    return out


def test_frozen_after_training_and_never_stepped_parameters_reshard_2_3_4_2_bitwise(tmp_path):
    root = str(tmp_path)
    start = run_ranks(frozen_first, 2, root)
    checkpoint_cli.cli_convert(os.path.join(root, "u2"), os.path.join(root, "c2"), "balanced")
    b2, t2 = read_all(os.path.join(root, "b2")), read_all(os.path.join(root, "t2"))
    assert_same_tensors(b2, read_all(os.path.join(root, "c2")), "converted")
    three = run_ranks(frozen_hop, 3, root, "c2", "b3")
    four = run_ranks(frozen_hop, 4, root, "b3", "b4")
    counts = [start[0]["buckets"], three[0]["buckets"], four[0]["buckets"]]
    assert counts[0] >= 3 and counts[0] != counts[1] != counts[2], counts
    for name in ("b3", "b4"):
        assert_same_tensors(b2, read_all(os.path.join(root, name)), name)
    # late's optimizer state is carried unchanged from t2 through every hop; never has none
    late = [k for k in t2 if k.startswith("optim.state.late.")]
    assert sorted(late) == ["optim.state.late.exp_avg", "optim.state.late.exp_avg_sq", "optim.state.late.step"]
    assert all(torch.equal(t2[k], b2[k]) for k in late + ["model.late", "model.never"])
    assert not [k for k in b2 if k.startswith("optim.state.never.")]
    assert all(r["steps"] == [6, 3] for r in three + four)
    end = run_ranks(frozen_last, 2, root)
    for r, s in zip(end, start):
        assert r["b4"] == r["u2"] == {"steps": [6, 3], "losses": s["losses"]}
        assert r["unfrozen_steps"] == [6, 3] and isinstance(r["unfrozen_loss"], float)
    f2 = read_all(os.path.join(root, "f2"))  # unfrozen: late's state back in the buckets, bitwise
    assert all(torch.equal(t2[k], f2[k]) for k in late)


def test_a_parameter_frozen_in_a_group_that_trained_on_is_carried_then_refused_with_the_way_out(tmp_path):
    dm = frozen_net(0, 0, True, BUCKET_MB[2], own_group=False)
    for i in range(2):
        dm(batch(0, i))
    gf.save(dm, tmp_path / "t")
    saved = read_all(str(tmp_path / "t"))
    frozen = frozen_net(0, 1, False, BUCKET_MB[2], own_group=False)
    gf.load(frozen, tmp_path / "t")
    carried = frozen.state_dict()["optim"]["state"]["late"]  # in memory too
    assert all(torch.equal(carried[k], saved[f"optim.state.late.{k}"]) for k in ("exp_avg", "exp_avg_sq", "step"))
    frozen(batch(0, 2))  # the group's step moves on to 3; late's stays at 2
    gf.save(frozen, tmp_path / "u")
    again = frozen_net(0, 2, False, BUCKET_MB[2], own_group=False)
    again.load_state_dict(frozen.state_dict())  # frozen again: loads, and carries the state on
    assert torch.equal(again.state_dict()["optim"]["state"]["late"]["exp_avg"], saved["optim.state.late.exp_avg"])
    unfrozen = frozen_net(0, 3, True, BUCKET_MB[2], own_group=False)
    with pytest.raises(gf.CheckpointError, match=r"\[2\.0, 3\.0\].*param group of its own"):
        gf.load(unfrozen, tmp_path / "u")
