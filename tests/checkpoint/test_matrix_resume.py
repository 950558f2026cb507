"""Checkpoints of a step with two optimizers, one whose update reads each parameter whole and
AdamW: torch.optim.Muon for the matrices and AdamW for the biases; or torch.optim.Adafactor
for the matrices and two biases (a row and a column factor per matrix, a whole second moment
per bias, each in its own shape) and AdamW for the last bias. The whole-update parameters' owners
change with the world size. Both modes saved at 2 ranks resume bitwise at 2, the balanced one
(and the unbalanced one converted offline) loads bitwise at 3 and 1; the torch form is one
state dict per optimizer, which plain torch optimizers load and step on bitwise."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse.capture.tracing import reads_whole
from graphfuse.cli import ckpt as checkpoint_cli
from tests._common import run_ranks

SAVED, RESUMED = range(2), range(2, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


KINDS = ("Muon", "Adafactor")


def optimizers(model: Net, kind: str) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    if kind == "Adafactor":
        whole = matrices + [model.a.bias, model.b.bias]
        return [
            torch.optim.Adafactor(whole, lr=0.05, weight_decay=0.05),
            torch.optim.AdamW([model.c.bias], lr=1e-2, foreach=False),
        ]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.05), torch.optim.AdamW(vectors, lr=1e-2, foreach=False)]


def compiled(seed: int, kind: str) -> tuple[Net, list[torch.optim.Optimizer], gf.DistModel]:
    torch.manual_seed(seed)
    model = Net()
    opts = optimizers(model, kind)
    return model, opts, gf.compile(model, opts, loss_fn, batch(0, 0))


def state(model: Net, opts: list[torch.optim.Optimizer]) -> dict:
    """The weights and each optimizer's torch form (gathered: every rank calls it)."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": [o.state_dict() for o in opts]}


def owners(dm: gf.DistModel) -> dict[str, int]:
    return {f: b.owner(f) for b in dm.layout.buckets if reads_whole(dm.program.optim.groups[b.group]) for f in b.fqns}


def eager_step(model: Net, opts: list[torch.optim.Optimizer], b, layout=None) -> float:
    """One step of the eager data-parallel reference: gradients averaged with all_reduce(AVG) per
    parameter, or with `layout` one all_reduce per flat bucket as graphfuse lays them out (at 3
    ranks Gloo sums each chunk of a tensor in another rank order, so only the same chunks give
    the same sums to the bit, as in tests/runtime/test_zero1.py)."""
    import torch.distributed as dist

    for o in opts:
        o.zero_grad()
    loss = loss_fn(model, b)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if dist.is_initialized() and layout is not None:
        for bucket in layout.buckets:
            flat = torch.zeros(bucket.size)
            for s in bucket.slots:
                flat[s.offset : s.offset + s.numel] = grads[s.fqn].reshape(-1)
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            for s in bucket.slots:
                grads[s.fqn].copy_(flat[s.offset : s.offset + s.numel].view_as(grads[s.fqn]))
    elif dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    for o in opts:
        o.step()
    return loss.item()


def first(rank: int, world: int, root: str, kind: str) -> dict:
    """At 2 ranks: train beside the eager data-parallel reference (and gf.shard_optimizer of the
    same list), save both modes, go on; and runs resumed from each checkpoint (fresh models,
    other weights) beside the unbroken one."""
    model, opts, dm = compiled(0, kind)
    eager, by_hand = copy.deepcopy(model), copy.deepcopy(model)
    plain = optimizers(eager, kind)
    sharded = gf.shard_optimizer(optimizers(by_hand, kind), model=by_hand)  # the same list, for an eager backward
    equal = True
    for i in SAVED:
        equal &= eager_step(eager, plain, batch(rank, i)) == dm(batch(rank, i)).item()
        sharded.zero_grad()
        loss_fn(by_hand, batch(rank, i)).backward()
        sharded.step()
    equal &= all(torch.equal(p, q) for p, q in zip(eager.parameters(), by_hand.parameters()))
    gf.save(dm, os.path.join(root, "unbalanced"))
    gf.save(dm, os.path.join(root, "balanced"), mode="balanced")
    saved = state(model, opts)
    if rank == 0:
        torch.save(saved, os.path.join(root, "reference.pt"))
    resumed = {}
    for mode in ("unbalanced", "balanced"):
        resumed[mode] = compiled(1, kind)
        gf.load(resumed[mode][2], os.path.join(root, mode))
    for i in RESUMED:
        loss = eager_step(eager, plain, batch(rank, i))
        equal &= all(loss == d(batch(rank, i)).item() for d in (dm, *(r[2] for r in resumed.values())))
    equal &= all(
        torch.equal(p, q)
        for m in (model, *(r[0] for r in resumed.values()))
        for p, q in zip(eager.parameters(), m.parameters())
    )
    states = [sorted({tuple(sorted(s)) for s in sd["state"].values()}) for sd in saved["optim"]]
    return {"equal": equal, "owners": owners(dm), "states": states}


def load(rank: int, world: int, root: str, kind: str) -> dict:
    """At another world size: the balanced checkpoint, and the unbalanced one converted offline,
    load bitwise (the gathered state equals the saved one); the balanced run goes on bitwise
    beside an eager data-parallel replica that plain torch optimizers resume from the torch form."""
    reference = torch.load(os.path.join(root, "reference.pt"))
    out = {}
    for mode in ("converted", "balanced"):
        model, opts, dm = compiled(1, kind)  # other weights: everything comes from the checkpoint
        gf.load(dm, os.path.join(root, mode))
        out[mode] = same(state(model, opts), reference)
    eager = Net()
    eager.load_state_dict(reference["model"])
    plain = optimizers(eager, kind)
    for o, sd in zip(plain, reference["optim"]):
        o.load_state_dict(sd)
    out["resumed"] = all(
        eager_step(eager, plain, batch(rank, i), dm.layout) == dm(batch(rank, i)).item() for i in RESUMED
    )
    out["resumed"] &= all(torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters()))
    out["owners"] = owners(dm)
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


STATES = {  # per optimizer, the sets of state names its parameters have, as torch.optim keeps them
    "Muon": [[("momentum_buffer",)], [("exp_avg", "exp_avg_sq", "step")]],  # Muon keeps no step
    "Adafactor": [[("col_var", "row_var", "step"), ("step", "variance")], [("exp_avg", "exp_avg_sq", "step")]],
}


@pytest.mark.parametrize("kind", KINDS)
def test_whole_updates_and_adamw_are_bitwise_at_2_and_3_ranks_and_checkpoints_move_ownership_with_the_world_size(
    tmp_path, kind
):
    root = str(tmp_path)
    saved = run_ranks(first, 2, root, kind)
    assert all(r["equal"] for r in saved)
    assert saved[0]["states"] == STATES[kind]
    for mode in ("unbalanced", "balanced"):  # the record names both optimizers, not the wrapper's class
        assert json.loads(Path(root, mode, "graphfuse.json").read_text())["optimizer"] == f"{kind}+AdamW"
    checkpoint_cli.cli_convert(os.path.join(root, "unbalanced"), os.path.join(root, "converted"), "balanced")
    at3 = run_ranks(load, 3, root, kind)
    for r in [*at3, load(0, 1, root, kind)]:  # and at world size 1, in this process
        assert r["converted"] and r["balanced"] and r["resumed"], r
    assert at3[0]["owners"] != saved[0]["owners"]  # ownership moved with the world size
    assert sorted(set(at3[0]["owners"].values())) == [0, 1, 2]


@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_form_is_one_state_dict_per_optimizer_that_plain_torch_loads_and_steps_on_bitwise(kind):
    model, opts, dm = compiled(0, kind)
    eager = copy.deepcopy(model)
    for i in SAVED:
        dm(batch(0, i))
    plain = optimizers(eager, kind)
    with torch.no_grad():
        for p, q in zip(eager.parameters(), model.parameters()):
            p.copy_(q)
    for o, sd in zip(plain, [o.state_dict() for o in opts]):
        o.load_state_dict(sd)
    for i in RESUMED:
        for o in plain:
            o.zero_grad()
        loss = loss_fn(eager, batch(0, i))
        loss.backward()
        for o in plain:
            o.step()
        assert torch.equal(loss.detach(), dm(batch(0, i)))
        assert all(torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters()))
    # and back: plain torch's state dicts (of AdamW alone, then of both) load into graphfuse's
    model2, opts2, dm2 = compiled(1, kind)
    model2.load_state_dict(eager.state_dict())
    opts2[1].load_state_dict(plain[1].state_dict())
    assert same(opts2[1].state_dict(), plain[1].state_dict())
    # The first optimizer, not loaded, keeps its fresh state: zeros (torch.optim's first step
    # starts from the same zeros), and its own param groups
    fresh = opts2[0].state_dict()
    assert not any(t.any() for s in fresh["state"].values() for t in s.values())
    assert fresh["param_groups"] == plain[0].state_dict()["param_groups"]
    dm2.optimizer.load_state_dict([o.state_dict() for o in plain])
    assert same(dm2.optimizer.state_dict(), [o.state_dict() for o in plain])


@pytest.mark.parametrize("kind", KINDS)
def test_shard_optimizer_takes_the_list_too_bitwise_with_a_state_dict_per_optimizer(kind):
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    plain, opts = optimizers(eager, kind), optimizers(model, kind)
    sharded = gf.shard_optimizer(opts, model=model)
    for i in SAVED:
        sharded.zero_grad()
        loss = loss_fn(model, batch(0, i))
        loss.backward()
        sharded.step()
        assert loss.item() == eager_step(eager, plain, batch(0, i))
        assert all(torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters()))
    assert same([o.state_dict() for o in opts], [o.state_dict() for o in plain])
    assert len(sharded.state_dict()["param_groups"]) == 2  # its own: both optimizers' groups


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_program_of_a_whole_update_and_adamw_runs_again_from_its_file(tmp_path, kind):
    """gf.save_program admits Muon's and Adafactor's ops (linalg_vector_norm, the factors' mm);
    DistModel.from_program takes the list."""
    model, opts, dm = compiled(0, kind)
    gf.save_program(dm.program, tmp_path / "program")
    program = gf.load_program(tmp_path / "program")
    assert program.optim.cls_name == f"{kind}+AdamW"
    torch.manual_seed(0)
    again = Net()
    loaded = gf.DistModel.from_program(program, again, optimizers(again, kind))
    for i in SAVED:
        assert torch.equal(dm(batch(0, i)), loaded(batch(0, i)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_a_record_whose_state_shapes_do_not_fit_its_layout_is_refused(tmp_path):
    """graphfuse.json's state_shapes (Adafactor's factors) are checked against the layout like
    the rest of the record: a shard or a parameter it does not hold, a negative size."""
    from graphfuse.checkpoint import record
    from graphfuse.errors import CheckpointError

    _, _, dm = compiled(0, "Adafactor")
    gf.save(dm, tmp_path / "ckpt")
    d = json.loads((tmp_path / "ckpt" / "graphfuse.json").read_text())
    d.pop("crc32")
    shapes = d["state_shapes"]
    # the Adafactor bucket (the matrices and two biases): each factor in its shape, the biases' moments
    assert shapes == {
        "bucket1.row_var": {"c.weight": [4, 1], "b.weight": [16, 1], "a.weight": [16, 1]},
        "bucket1.col_var": {"c.weight": [1, 16], "b.weight": [1, 16], "a.weight": [1, 8]},
        "bucket1.variance": {"b.bias": [16], "a.bias": [16]},
    }
    name = next(iter(shapes))
    for edit, why in (
        (lambda s: s.__setitem__("bucket9.row_var", s[name]), "names 'bucket9.row_var'"),
        (lambda s: s[name].__setitem__("nowhere.weight", [4, 1]), f"names {name!r}"),
        (lambda s: s[name].__setitem__(next(iter(s[name])), [-4, 1]), "must be"),
    ):
        bad = json.loads(json.dumps(d))
        edit(bad["state_shapes"])
        with pytest.raises(CheckpointError, match=why):
            record.from_dict(bad, "graphfuse.json")
    assert record.from_dict(d, "graphfuse.json").shapes() == {
        n: {f: tuple(s) for f, s in m.items()} for n, m in shapes.items()
    }
