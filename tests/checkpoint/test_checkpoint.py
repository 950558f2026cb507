"""Checkpoints in both modes on real Gloo ranks: resume bitwise (Paddle's test, strengthened),
resharding, plain PyTorch interoperability, aliasing after load, and faults.

Spawning a group costs seconds, so each group runs many scenarios and returns plain results
that the tests below assert on; the groups run in dependency order through fixtures."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import graphfuse as gf
from graphfuse.checkpoint import record
from graphfuse.checkpoint.storage import Chunks, file_records
from graphfuse.cli import ckpt as checkpoint
from graphfuse.testing.launch import RankFailure
from tests._common import run_ranks

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


def record_metadata(path: str, drop: bool = False) -> None:
    """Record .metadata's size and CRC-32 afresh in graphfuse.json (or drop the record, as
    a checkpoint without one has), so that a test reaches the checks behind that one."""
    f = os.path.join(path, "graphfuse.json")
    meta = json.load(open(f))
    if drop:
        meta["files"].pop(".metadata", None)
    else:
        meta["files"].update(file_records(Path(path), 0))
    rec = record.from_dict(meta, f)  # sealed afresh: its own CRC-32 covers the edited records
    open(f, "w").write(rec.to_json())


BALANCED = [name for name, (mode, _) in CONFIGS.items() if mode == "balanced"]


def balanced_differences(dm, full: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The keys of dm.state_dict(mode="balanced") this rank holds, and those of them whose
    tensor or any chunk is not bitwise (values and dtype) the checkpoint's whole tensor."""
    sd = dm.state_dict(mode="balanced")
    held = {f"model.{k}": v for k, v in sd["model"].items()}
    for fqn, states in sd["optim"]["state"].items():
        held.update({f"optim.state.{fqn}.{s}": v for s, v in states.items()})
    differ = []
    for key, value in held.items():
        want = full.get(key)
        if isinstance(value, Chunks):
            pieces = [(view, tuple(slice(o, o + n) for o, n in zip(off, sz))) for off, sz, view in value.chunks]
        else:
            pieces = [(value, ())]
        if want is None or tuple(value.size()) != tuple(want.shape):
            differ.append(key)
            continue
        if not all(view.dtype == want.dtype and torch.equal(view, want[box]) for view, box in pieces):
            differ.append(key)
    return sorted(held), differ


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
        record_metadata(os.path.join(faults, "missing_key"))  # a consistent index that lacks the key
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


def four_rank_group(rank: int, world: int, root: str) -> dict:
    """Balanced 1 -> 4: load each balanced checkpoint saved at world size 1, compare what
    every rank holds with the checkpoint's tensors, and save it again at 4 ranks."""
    out = {}
    for name in BALANCED:
        mode, dtype = CONFIGS[name]
        model, opt, _ = make(4, dtype)
        dm = compile_(rank, model, opt, mode, dtype)
        src = os.path.join(root, f"{name}1")
        extra = gf.load(dm, src)
        held, differ = balanced_differences(dm, read_all(src))
        out[name] = {"held": held, "differ": differ, "steps": list(dm.steps), "extra": sorted(extra)}
        gf.save(dm, os.path.join(root, f"{name}1to4"))
    return out


def read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this process with plain DCP."""
    md = dcp.FileSystemReader(path).read_metadata()
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd


def assert_same_tensors(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], what: str) -> None:
    assert first.keys() == second.keys(), what
    for k in first:
        assert first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]), (what, k)


def trained_world1(seed: int = 6, steps: int = 2):
    """A world-size-1 balanced DistModel a few steps into training (its state is not zero)."""
    model, opt, _ = make(seed)
    dm = compile_(0, model, opt, "balanced", torch.float32)
    for i in range(steps):
        dm(batch(0, i))
    return dm


# ---- fixtures: the groups, in dependency order ------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def killed(root):
    with pytest.raises(RankFailure, match="rank 1 died with exit code 3|rank 0 failed"):
        run_ranks(killed_save_group, 2, root, timeout=120)
    return root


@pytest.fixture(scope="module")
def two(killed):
    return run_ranks(two_rank_group, 2, killed)


@pytest.fixture(scope="module")
def three(two, root):
    return run_ranks(three_rank_group, 3, root)


@pytest.fixture(scope="module")
def one(root):
    """Balanced checkpoints saved at world size 1 (in this process) after step 2."""
    for name in BALANCED:
        mode, dtype = CONFIGS[name]
        train(0, mode, dtype, seed=2, save=os.path.join(root, f"{name}1"))
    return root


@pytest.fixture(scope="module")
def four(one):
    return run_ranks(four_rank_group, 4, one)


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


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_reshards_3_to_1_bitwise(three, root, name):
    src = os.path.join(root, f"{name}3")
    saved = read_all(src)
    mode, dtype = CONFIGS[name]
    model, opt, _ = make(5, dtype)
    dm = compile_(0, model, opt, mode, dtype)
    assert "scheduler" in gf.load(dm, src)
    assert dm.steps == [SAVE_AT + 1]
    held, differ = balanced_differences(dm, saved)
    assert held == sorted(saved) and not differ, differ
    again = os.path.join(root, f"{name}3to1")
    gf.save(dm, again)
    assert_same_tensors(saved, read_all(again), again)


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_reshards_1_to_4_bitwise(four, root, name):
    saved = read_all(os.path.join(root, f"{name}1"))
    if name.endswith("master"):
        assert any(k.endswith(".master") for k in saved)
    assert sorted(set().union(*(r[name]["held"] for r in four))) == sorted(saved)
    assert len({tuple(r[name]["held"]) for r in four}) > 1  # the ranks really hold different parts
    for rank, r in enumerate(four):
        assert not r[name]["differ"], (rank, r[name]["differ"])
        assert r[name]["steps"] == [SAVE_AT + 1] and r[name]["extra"] == ["scheduler"]
    again = os.path.join(root, f"{name}1to4")
    assert json.load(open(os.path.join(again, "graphfuse.json")))["world_size"] == 4
    assert_same_tensors(saved, read_all(again), again)


def test_load_falls_back_to_old_between_the_two_renames(one, root):
    """gf.save moves <path> to <path>.old, then <path>.saving to <path>: a crash between the
    two leaves no <path>; gf.load loads the previous checkpoint from <path>.old."""
    prev = os.path.join(root, "balanced1")
    path = os.path.join(root, "window")
    shutil.copytree(prev, path)  # the previous checkpoint, in place
    dm = trained_world1()
    gf.save(dm, os.path.join(root, "newer"))
    os.rename(os.path.join(root, "newer"), path + ".saving")  # the new one, complete, not yet renamed
    os.rename(path, path + ".old")  # the first rename; the process dies here
    assert not os.path.exists(path)

    assert "scheduler" in gf.load(dm, path)
    saved = read_all(prev)
    held, differ = balanced_differences(dm, saved)
    assert held == sorted(saved) and not differ, differ
    assert dm.steps == [SAVE_AT + 1]

    gf.save(dm, path)  # the next save completes the interrupted one's clean-up
    assert os.path.isdir(path) and not os.path.exists(path + ".old") and not os.path.exists(path + ".saving")
    assert_same_tensors(saved, read_all(path), path)

    # A crash after the second rename, before .old is removed: <path> is the newer one.
    shutil.copytree(prev, path + ".old")  # stale: a save removes it
    newer = trained_world1(seed=8, steps=1)
    gf.save(newer, path)
    shutil.copytree(os.path.join(root, "balanced1"), path + ".old")
    gf.load(dm, path)
    assert not balanced_differences(dm, read_all(path))[1]
    assert dm.steps == [1]


@pytest.mark.parametrize(
    "damage, recorded",
    # A well-formed index with altered offsets is found only by the CRC-32 graphfuse.json records.
    [(d, r) for d in ("truncated", "empty", "garbage", "altered") for r in (True, False) if r or d != "altered"],
)
def test_damaged_dcp_metadata_raises_naming_it_and_changes_nothing(one, root, damage, recorded):
    """.metadata truncated, emptied, overwritten with garbage, or re-pickled with altered
    chunk offsets: gf.CheckpointError names the file, model and optimizer stay bitwise as
    they were; with and without the size and CRC-32 that graphfuse.json records of it."""
    path = os.path.join(root, f"metadata_{damage}_{recorded}")
    shutil.copytree(os.path.join(root, "balanced1"), path)
    f = os.path.join(path, ".metadata")
    data = open(f, "rb").read()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = b""
    elif damage == "garbage":
        data = torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        data = data.numpy().tobytes()
    else:
        md = pickle.loads(data)
        md.storage_data = {i: dataclasses.replace(s, offset=s.offset + 1) for i, s in md.storage_data.items()}
        data = pickle.dumps(md)
    open(f, "wb").write(data)
    if not recorded:
        record_metadata(path, drop=True)
    dm = trained_world1()
    msg = expect_error(dm, path, gf.CheckpointError)
    assert f in msg and "damaged" in msg, msg


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
