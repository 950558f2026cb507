"""Checkpoints in both modes on real Gloo ranks: resume bitwise (Paddle's test, strengthened),
resharding, plain PyTorch interoperability, aliasing after load, and faults.

Spawning a group costs seconds, so each group runs many scenarios and returns plain results
that the tests below assert on; the groups run in dependency order through fixtures."""

from __future__ import annotations

import os
import pickle
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from distributed import run_ranks
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import graphfuse as gf
from graphfuse import checkpoint

# graphfuse steps the optimizer inside its program, so torch's order check cannot see it.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")

STEPS, SAVE_AT = 10, 2
CONFIGS = {  # name -> (mode, dtype)
    "unbalanced": ("unbalanced", torch.float32),
    "balanced": ("balanced", torch.float32),
    "unbalanced_bf16_master": ("unbalanced", torch.bfloat16),
    "balanced_bf16_master": ("balanced", torch.bfloat16),
}


class Net(nn.Module):
    """Paddle's DPDemoNet (bias-free 16x16 and 16x8) plus a 3-d parameter; FQNs contain
    "rank" and "_rank", which Paddle's split("_rank") mangles."""

    def __init__(self, out: int = 8) -> None:
        super().__init__()
        self.low_rank = nn.Linear(16, 16, bias=False)
        self.rank = nn.Linear(16, out, bias=False)
        self.cube = nn.Parameter(torch.randn(3, 5, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rank(torch.tanh(self.low_rank(x) + self.cube.mean(dim=(0, 1))))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x)[:, : y.shape[1]] - y).square().mean()


def batch(rank: int, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 16, generator=g).to(dtype), torch.randn(4, 8, generator=g).to(dtype)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def make(seed: int, dtype=torch.float32, out: int = 8):
    import warnings

    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
    torch.manual_seed(seed)
    model = Net(out).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def compile_(rank, model, opt, mode, dtype, bucket_mb=0.002):
    master = torch.float32 if dtype == torch.bfloat16 else None
    strategy = gf.Strategy(bucket_size_mb=bucket_mb, checkpoint_mode=mode, master_dtype=master)
    return gf.compile(model, opt, loss_fn, batch(rank, 0, dtype), strategy=strategy)


def train(rank, mode, dtype, seed, save=None, load=None, bucket_mb=0.002):
    """Steps 0..9; after step 2 save to `save` or load from `load` (scheduler in `extra`)."""
    model, opt, sched = make(seed, dtype)
    dm = compile_(rank, model, opt, mode, dtype, bucket_mb)
    losses, ptrs = [], None
    for i in range(STEPS):
        losses.append(dm(batch(rank, i, dtype)).item())
        sched.step()
        if i == SAVE_AT and save:
            gf.save(dm, save, extra={"scheduler": sched.state_dict()})
        if i == SAVE_AT and load:
            ptrs = {k: v.data_ptr() for k, v in dm.tensors.items()}
            sched.load_state_dict(gf.load(dm, load)["scheduler"])
            ptrs = ptrs == {k: v.data_ptr() for k, v in dm.tensors.items()}
    return dm, losses, ptrs


def snapshot(dm) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in dm.tensors.items()},
        "steps": list(dm.steps),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in dm.optimizer.param_groups],
    }


def unchanged(dm, snap) -> bool:
    now = snapshot(dm)
    return (
        now["steps"] == snap["steps"]
        and now["groups"] == snap["groups"]
        and all(torch.equal(now["tensors"][k], v) for k, v in snap["tensors"].items())
    )


def expect_error(dm, path, cls) -> str:
    snap = snapshot(dm)
    try:
        gf.load(dm, path)
    except cls as e:
        assert unchanged(dm, snap), f"loading {path} changed the state"
        return str(e)
    raise AssertionError(f"loading {path} did not raise {cls.__name__}")


# ---- groups ---------------------------------------------------------------------------
def killed_save_group(rank: int, world: int, root: str) -> None:
    """Save after step 2, then rank 1 dies in the middle of a second save at step 5."""
    path = os.path.join(root, "killed")
    model, opt, sched = make(0)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32)
    for i in range(6):
        dm(batch(rank, i))
        sched.step()
        if i == SAVE_AT:
            gf.save(dm, path, extra={"scheduler": sched.state_dict()})
    if rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        def die(*args, **kwargs):
            os._exit(3)  # a rank killed while writing its data file

        fs._write_item = die
    gf.save(dm, path, extra={"scheduler": sched.state_dict()})


def eager_reference(rank: int, world: int, root: str) -> tuple[list[float], dict]:
    """Plain PyTorch data parallelism (all_reduce AVG); saves a plain DCP checkpoint of
    get_state_dict after step 2. Returns the losses and the state after step 2."""
    model, opt, sched = make(0)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    losses, state = [], None
    for i in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, batch(rank, i))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if i == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "plain"))
            torch.save(sched.state_dict(), os.path.join(root, f"plain_sched{rank}.pt"))
            state = {
                "model": {k: v.clone() for k, v in msd.items()},
                "optim": {f: {k: v.clone() for k, v in s.items()} for f, s in osd["state"].items()},
            }
    return losses, state


def two_rank_group(rank: int, world: int, root: str) -> dict:
    out: dict = {"resume": {}}
    for name, (mode, dtype) in CONFIGS.items():
        path = os.path.join(root, f"{name}{world}")
        _, ref, _ = train(rank, mode, dtype, seed=0, save=path)
        dm, resumed, ptrs = train(rank, mode, dtype, seed=1, load=path)
        out["resume"][name] = (ref, resumed, ptrs)
    ref_unbalanced = out["resume"]["unbalanced"][0]

    # Aliasing after load: the model's parameters and slice@ views still share the buffers.
    fqn = "low_rank.weight"
    bucket = dm.layout.bucket_of(fqn)
    slot = bucket.slot(fqn)
    flat = dm.tensors[bucket.name]
    with torch.no_grad():
        dm.model.low_rank.weight[0, 0] = 123.0
        seen_in_bucket = flat[slot.offset].item() == 123.0
        flat[slot.offset + 1] = -7.0
        seen_in_param = dm.model.low_rank.weight[0, 1].item() == -7.0
        slices = dict(dm.named_slices())
        key = next(k for k in slices if k.endswith(".exp_avg"))
        slices[key][0] = 42.0
        state = dm.tensors[
            next(
                n
                for n in dm.tensors
                if n.endswith(".exp_avg")
                and slices[key].untyped_storage().data_ptr() == dm.tensors[n].untyped_storage().data_ptr()
            )
        ]
        seen_in_shard = bool((state == 42.0).any())
    out["aliasing"] = (seen_in_bucket, seen_in_param, seen_in_shard)

    # Resume from a plain PyTorch DCP checkpoint; and from the checkpoint whose re-save was killed.
    eager_losses, eager_state = eager_reference(rank, world, root)
    torch.save(eager_state, os.path.join(root, f"eager_state{rank}.pt"))  # tensors do not cross the queue
    out["eager"] = eager_losses
    model, opt, sched = make(1)
    dm = compile_(rank, model, opt, "balanced", torch.float32)
    plain = []
    for i in range(STEPS):
        plain.append(dm(batch(rank, i)).item())
        sched.step()
        if i == SAVE_AT:
            assert gf.load(dm, os.path.join(root, "plain")) is None
            sched.load_state_dict(torch.load(os.path.join(root, f"plain_sched{rank}.pt")))
    out["plain_resume"] = plain
    _, killed, _ = train(rank, "unbalanced", torch.float32, seed=1, load=os.path.join(root, "killed"))
    out["killed_resume"] = (ref_unbalanced, killed)

    # Faults: every one raises before anything changes.
    faults = os.path.join(root, "faults")
    src = os.path.join(root, f"unbalanced{world}")
    data = sorted(f for f in os.listdir(src) if f.endswith(".distcp"))[-1]
    if rank == 0:
        for kind in ("truncated", "missing_key", "corrupt"):
            shutil.copytree(src, os.path.join(faults, kind))
        f = os.path.join(faults, "truncated", data)
        os.truncate(f, os.path.getsize(f) // 2)
        f = os.path.join(faults, "missing_key", ".metadata")
        md = pickle.load(open(f, "rb"))
        del md.state_dict_metadata[f"slice@{fqn}.exp_avg_sq@rank1"]
        pickle.dump(md, open(f, "wb"))
        f = os.path.join(faults, "corrupt", data)
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) - 100)
            fh.write(b"\xff" * 8)
    model, opt, _ = make(0, out=12)  # a model whose `rank` layer has another shape
    wide = compile_(rank, model, opt, "balanced", torch.float32)
    gf.save(wide, os.path.join(faults, "shape"))
    dist.barrier()
    model, opt, _ = make(1)
    dm = compile_(rank, model, opt, "unbalanced", torch.float32)
    for i in range(3):
        dm(batch(rank, i))
    out["faults"] = {
        "truncated": (data, expect_error(dm, os.path.join(faults, "truncated"), gf.CheckpointError)),
        "missing_key": expect_error(dm, os.path.join(faults, "missing_key"), gf.CheckpointError),
        "corrupt": (data, expect_error(dm, os.path.join(faults, "corrupt"), gf.CheckpointError)),
        "shape": expect_error(dm, os.path.join(faults, "shape"), gf.CheckpointMismatchError),
        "no_dir": expect_error(dm, os.path.join(faults, "nothing"), gf.CheckpointError),
    }
    model, opt, _ = make(1)
    other = compile_(rank, model, opt, "unbalanced", torch.float32, bucket_mb=0.004)
    out["faults"]["bucket_size"] = expect_error(other, src, gf.CheckpointMismatchError)
    return out


def three_rank_group(rank: int, world: int, root: str) -> dict:
    out: dict = {"resume": {}}
    for name, (mode, dtype) in CONFIGS.items():
        path = os.path.join(root, f"{name}{world}")
        _, ref, _ = train(rank, mode, dtype, seed=0, save=path)
        _, resumed, ptrs = train(rank, mode, dtype, seed=1, load=path)
        out["resume"][name] = (ref, resumed, ptrs)
    model, opt, sched = make(1)
    dm = compile_(rank, model, opt, "balanced", torch.float32)
    gf.load(dm, os.path.join(root, "balanced2"))
    gf.save(dm, os.path.join(root, "resaved3"))
    out["world_size"] = expect_error(dm, os.path.join(root, "unbalanced2"), gf.CheckpointMismatchError)
    return out


def read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this process with plain DCP."""
    md = dcp.FileSystemReader(path).read_metadata()
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(sd, checkpoint_id=path)
    return sd


# ---- fixtures: the groups, in dependency order ------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def killed(root):
    with pytest.raises(AssertionError, match="rank 1 died with exit code 3|rank 0 failed"):
        run_ranks(killed_save_group, 2, root, timeout=120)
    return root


@pytest.fixture(scope="module")
def two(killed):
    return run_ranks(two_rank_group, 2, killed)


@pytest.fixture(scope="module")
def three(two, root):
    return run_ranks(three_rank_group, 3, root)


# ---- tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_after_step_2_is_bitwise_at_2_ranks(two, name):
    for r in two:
        ref, resumed, _ = r["resume"][name]
        assert resumed[SAVE_AT + 1 :] == ref[SAVE_AT + 1 :]
        assert resumed[0] != ref[0]  # the fresh run really started from other weights


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_after_step_2_is_bitwise_at_3_ranks(three, name):
    for r in three:
        ref, resumed, _ = r["resume"][name]
        assert resumed[SAVE_AT + 1 :] == ref[SAVE_AT + 1 :]


def test_load_keeps_buffers_and_aliases(two, three):
    for r in two + three:
        assert all(ptrs for _, _, ptrs in r["resume"].values()), "a buffer was reallocated by load"
    for r in two:
        assert r["aliasing"] == (True, True, True)


def test_graphfuse_resumes_from_plain_pytorch_dcp_checkpoint(two):
    for r in two:
        eager_losses = r["eager"]
        assert r["plain_resume"][SAVE_AT + 1 :] == eager_losses[SAVE_AT + 1 :]


def test_killed_save_leaves_previous_checkpoint_loadable(two, root):
    assert os.path.isdir(os.path.join(root, "killed")) and os.path.exists(os.path.join(root, "killed.saving"))
    for r in two:
        ref, resumed = r["killed_resume"]
        assert resumed[SAVE_AT + 1 :] == ref[SAVE_AT + 1 :]


def test_faults_raise_naming_file_and_key_and_change_nothing(two):
    f = two[0]["faults"]
    data, msg = f["truncated"]
    assert data in msg and "truncated" in msg and "key" in msg
    assert "slice@low_rank.weight.exp_avg_sq@rank1" in f["missing_key"]
    data, msg = f["corrupt"]
    assert data in msg and "CRC" in msg
    assert "model.rank.weight" in f["shape"] and "(12, 16)" in f["shape"]
    assert "no checkpoint" in f["no_dir"]
    assert "bucket size" in f["bucket_size"] and "balanced" in f["bucket_size"]


def test_unbalanced_refuses_another_world_size(three):
    msg = three[0]["world_size"]
    assert "world size 2 (this run: 3)" in msg and "graphfuse ckpt convert" in msg


def test_balanced_reshards_2_to_3_and_2_to_1_bitwise(three, root):
    model, opt, _ = make(5)
    dm = compile_(0, model, opt, "balanced", torch.float32)  # world size 1: no process group here
    gf.load(dm, os.path.join(root, "balanced2"))
    gf.save(dm, os.path.join(root, "resaved1"))
    first = read_all(os.path.join(root, "balanced2"))
    assert any(k.endswith("exp_avg_sq") for k in first)
    for again in ("resaved3", "resaved1"):
        second = read_all(os.path.join(root, again))
        assert first.keys() == second.keys()
        for k in first:
            assert torch.equal(first[k], second[k]), (again, k)


def test_plain_adamw_loads_balanced_checkpoint_bitwise_equal_to_eager(two, root):
    eager = torch.load(os.path.join(root, "eager_state0.pt"))
    model, opt, _ = make(7)
    model(batch(0, 0)[0]).sum().backward()
    opt.step()  # so the optimizer has state tensors for DCP to fill
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "balanced2"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, eager["model"][k]), k
    msd, osd = get_state_dict(model, opt)
    for fqn, state in eager["optim"].items():
        for k, v in state.items():
            assert torch.equal(osd["state"][fqn][k], v), (fqn, k)


def test_convert_unbalanced_to_balanced_offline(two, root, capsys):
    dst = os.path.join(root, "converted")
    assert checkpoint.cli_convert(os.path.join(root, "unbalanced2"), dst, "balanced") == 0
    assert checkpoint.cli_info(dst) == 0
    assert "balanced" in capsys.readouterr().out
    converted, balanced = read_all(dst), read_all(os.path.join(root, "balanced2"))
    assert converted.keys() == balanced.keys()
    for k in balanced:
        assert torch.equal(converted[k], balanced[k]), k
    model, opt, _ = make(3)
    dm = compile_(0, model, opt, "balanced", torch.float32)
    assert "scheduler" in gf.load(dm, dst)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
