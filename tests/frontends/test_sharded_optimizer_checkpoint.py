"""gf.save / gf.load of a ShardedOptimizer: saved at step 10 in both modes, resumed in a fresh
process group (balanced also at another world size, and into plain PyTorch through DCP), steps
11-20 equal to the uninterrupted run."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import graphfuse as gf
from tests._common import run_ranks
from tests.frontends.test_sharded_optimizer import adamw, batches, ddp_step, model_, sharded, sharded_step, warmup

SAVE_AT, STEPS = 10, 20


def _train(rank, world, model, opt, sched, start: int, root: str | None = None) -> list[torch.Tensor]:
    data, losses = batches(rank, STEPS), []
    for step in range(start, STEPS):
        if step == SAVE_AT and root is not None:
            for mode in ("unbalanced", "balanced"):
                gf.save(opt, os.path.join(root, mode), mode=mode, extra={"sched": sched.state_dict()})
        losses.append(sharded_step(model, opt, [data[step]]))
        sched.step()
    return losses


def _plain(tensors) -> list:
    """Exact Python floats: tensors do not survive the trip back from an exited rank."""
    return [t.tolist() for t in tensors]


def _fresh():
    model = model_()
    opt = sharded(model)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def _uninterrupted(rank, world, root):
    model, opt, sched = _fresh()
    losses = _train(rank, world, model, opt, sched, 0, root)
    return _plain(losses[SAVE_AT:]), _plain(model.parameters()), sorted(os.listdir(root))


def _resumed(rank, world, root):
    out = {}
    for mode in ("unbalanced", "balanced"):
        model, opt, sched = _fresh()
        sched.load_state_dict(gf.load(opt, os.path.join(root, mode))["sched"])
        losses = _train(rank, world, model, opt, sched, SAVE_AT)
        out[mode] = (_plain(losses), _plain(model.parameters()))
    return out


def _resumed_elsewhere(rank, world, root):
    """Balanced at another world size, next to plain PyTorch (DDP-style + AdamW) loaded through DCP."""
    path = os.path.join(root, "balanced")
    model, opt, sched = _fresh()
    sched.load_state_dict(gf.load(opt, path)["sched"])
    losses = _train(rank, world, model, opt, sched, SAVE_AT)
    plain = model_()
    plain_opt = adamw(plain.parameters())
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, warmup)  # before the load, which restores lr
    msd, osd = get_state_dict(plain, plain_opt)  # initialises AdamW's states for DCP to fill
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=msd, optim_state_dict=osd)
    plain_sched.load_state_dict(torch.load(os.path.join(path, "extra.pt"))["sched"])
    data, plain_losses = batches(rank, STEPS), []
    for step in range(SAVE_AT, STEPS):
        plain_losses.append(ddp_step(plain, plain_opt, [data[step]], world, layout=opt.layout))
        plain_sched.step()
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, plain_losses)),
        "params_equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())),
        "steps": len(losses),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharded_ckpt"))


@pytest.fixture(scope="module")
def uninterrupted(root):
    return run_ranks(_uninterrupted, 2, root)


def test_resume_from_step_10_in_both_modes_equals_uninterrupted(root, uninterrupted):
    assert {"balanced", "unbalanced"} <= set(uninterrupted[0][2])
    resumed = run_ranks(_resumed, 2, root)  # a fresh process group
    for (losses, params, _), r in zip(uninterrupted, resumed):
        for mode in ("unbalanced", "balanced"):
            got_losses, got_params = r[mode]
            assert len(got_losses) == STEPS - SAVE_AT
            assert losses == got_losses and params == got_params, mode


def test_balanced_resumes_at_3_ranks_like_plain_pytorch_loaded_through_dcp(root, uninterrupted):
    for r in run_ranks(_resumed_elsewhere, 3, root):
        # bitwise: the plain reference reduces whole buckets as the sharded step does (at 3
        # ranks a per-parameter all-reduce sums in another order: test_sharded_optimizer.py)
        assert r["steps"] == STEPS - SAVE_AT and r["losses_equal"] and r["params_equal"], r


def test_unbalanced_checkpoint_refuses_another_world_size(root, uninterrupted):
    model, opt, _ = _fresh()
    with pytest.raises(gf.CheckpointMismatchError, match="world size 2"):
        gf.load(opt, os.path.join(root, "unbalanced"))


def test_in_memory_state_dict_round_trip_in_both_modes():
    model, opt, sched = _fresh()
    _train(0, 1, model, opt, sched, SAVE_AT)
    for mode in ("unbalanced", "balanced"):
        sd = opt.state_dict(mode)
        saved = opt.state_dict(mode="torch")
        other_model, other, _ = _fresh()
        other.load_state_dict(sd)
        assert other.steps == opt.steps
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters())), mode
        loaded = other.state_dict(mode="torch")
        for fqn, states in saved["state"].items():
            for k, v in states.items():
                assert torch.equal(loaded["state"][fqn][k], v), (mode, fqn, k)
