"""torch.optim.Adafactor under graphfuse: every parameter lies whole in one rank's shard (its
update reads norms of the whole parameter) and its owner runs torch's update on it; a matrix's
second moment is kept factored, a row and a column factor in their own shapes, in state shards
laid out apart (graphfuse.ir.layout.state_bucket), never parameter-sized. Bitwise against
torch.optim.Adafactor at 1 rank; the graph each rank runs at 2 and 3 ranks. Against an eager
data-parallel run at 2 and 3 Gloo ranks, with checkpoints: tests/checkpoint/test_matrix_resume.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse import passes
from graphfuse.capture.tracing import reads_whole
from graphfuse.errors import GraphfuseError
from graphfuse.ir.layout import ParamInfo, plan_buckets
from graphfuse.passes import sharded_update
from graphfuse.passes.sharded_update import whole_update_function
from tests.optim.lockstep import (
    assert_bitwise_lockstep,
    assert_same_torch_state,
    loss_fn,
    regression_batches,
    transformer_pair,
)

STEPS = 4
TESTED = ("Adafactor",)  # the torch.optim classes tested here (tests/optim/test_optimizers.py counts them)


class Shapes(nn.Module):
    """Parameters of every rank Adafactor treats apart: matrices (wide, tall), a stack of
    matrices (3-D: factored over its last two dimensions), vectors and a 0-d scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.heads = nn.Parameter(torch.randn(2, 4, 3) / 2)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))  # (n, 4)
        return torch.einsum("nk,hkj->nhj", h, self.heads).flatten(1) * self.scale


def batches(steps: int, seed: int = 0) -> list:
    return regression_batches(steps, 6, seed)


ADAFACTORS = {
    "default": lambda m: torch.optim.Adafactor(m.parameters()),
    "decay_eps_d_maximize": lambda m: torch.optim.Adafactor(
        m.parameters(), lr=0.05, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.1, maximize=True
    ),
    "two_groups": lambda m: torch.optim.Adafactor(
        [
            {"params": [p for p in m.parameters() if p.ndim >= 2], "d": 2.0, "weight_decay": 0.05},
            {"params": [p for p in m.parameters() if p.ndim < 2], "lr": 0.02},
        ],
        lr=0.03,
    ),
}


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """An lr schedule that also changes weight decay: after each step every group's lr is 0.8× its
    first and its weight decay 0.7× its last (the docs say both may change between steps)."""

    def step(self, epoch=None) -> None:
        super().step(epoch)
        for group in self.optimizer.param_groups:
            group["weight_decay"] *= 0.7


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return _Schedule(optimizer, lambda s: 0.8**s)


@pytest.mark.parametrize("name", ADAFACTORS)
def test_adafactor_is_bitwise_equal_to_torch_optim_adafactor(name):
    """Weights, losses and the state (torch's row_var, col_var, variance and step, each in its
    own shape), with lr and weight decay changing every step, on 2-D, 3-D, 1-D and 0-d parameters."""
    torch.manual_seed(0)
    m_ref = Shapes()
    m_gf = copy.deepcopy(m_ref)
    o_ref = ADAFACTORS[name](m_ref)
    s_ref = _schedule(o_ref)
    o_gf = ADAFACTORS[name](m_gf)
    dm = gf.compile(m_gf, o_gf, loss_fn, batches(1)[0])
    assert_bitwise_lockstep(m_ref, [o_ref], m_gf, dm, loss_fn, batches(STEPS), [s_ref, _schedule(o_gf)])
    assert all(reads_whole(g) for g in dm.program.optim.groups)
    assert_same_torch_state(o_gf.state_dict(), o_ref.state_dict())


def _program(world: int, rank: int) -> gf.Program:
    torch.manual_seed(0)
    model = Shapes()
    program = gf.capture(model, ADAFACTORS["default"](model), loss_fn, batches(1)[0], gf.Strategy(align_bytes=16))
    program = program.with_(world_size=world, rank=rank, group_name="g")
    for p in passes.PIPELINE[: passes.PIPELINE.index(sharded_update) + 1]:
        program = passes.run_pass(program, p, check=True)
    return program


def _optimizer_ops(program: gf.Program) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in program.graph.nodes:
        if n.op == "call_function" and n.meta.get("phase") == "optimizer":
            name = str(getattr(n.target, "_overloadpacket", n.target))
            out[name] = out.get(name, 0) + 1
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_keeps_the_factored_moments_of_what_it_owns_in_state_shards_of_their_own(world):
    """The graph: per rank, the parameters it owns whole (each on exactly one rank), one
    reduce-scatter per bucket; the row and column factors of the matrices it owns packed in
    shards as long as the longest rank's (no parameter-sized moment for a matrix); the ops of
    torch's update per owned parameter: norms of the parameter and of its update (two each),
    of each matrix's gradient rows and columns, and one product of the factors. (One rank
    reduces nothing.)"""
    owned, elements = [], 0
    for rank in range(world):
        program = _program(world, rank)
        (bucket,) = program.layout.buckets  # one group, one dtype, far below the bucket cap
        mine = [s.fqn for s in bucket.slices(rank)]
        assert all(bucket.owner(f) == rank for f in mine)
        shapes = {f: bucket.slot(f).shape for f in bucket.fqns}
        matrices = [f for f in mine if len(shapes[f]) > 1]
        # per rank, the elements of what it owns: row factors, column factors, vectors' moments
        runs = [[shapes[f] for f in bucket.fqns if bucket.owner(f) == r] for r in range(world)]
        rows = max(1, *(sum(torch.Size(s[:-1]).numel() for s in run if len(s) > 1) for run in runs))
        cols = max(1, *(sum(torch.Size(s[:-2] + s[-1:]).numel() for s in run if len(s) > 1) for run in runs))
        vectors = max(1, *(sum(torch.Size(s).numel() for s in run if len(s) < 2) for run in runs))
        meta = program.inputs_meta
        got = [meta[f"bucket0.{s}"].shape for s in ("row_var", "col_var", "variance")]
        assert got == [(rows,), (cols,), (vectors,)]
        elements += rows + cols
        ops = _optimizer_ops(program)
        assert ops.get("aten.linalg_vector_norm", 0) == 2 * len(mine) + 2 * len(matrices)
        assert ops.get("aten.mm", 0) + ops.get("aten.bmm", 0) == len(matrices)
        assert passes.count_targets(program).get("_c10d_functional.reduce_scatter_tensor", 0) == (world > 1)
        owned += mine
    assert sorted(owned) == sorted(shapes)  # each parameter on exactly one rank
    matrix_elements = sum(torch.Size(s).numel() for s in shapes.values() if len(s) > 1)
    assert elements < matrix_elements / 2  # the factors, across ranks, far below one moment per element


def test_a_factored_update_refuses_a_shard_that_holds_part_of_a_parameter():
    """Adafactor's update never runs on a slice: a layout planned elementwise (the 16x16 matrix
    across two shards) is refused for the update and for its factored states."""
    from graphfuse.ir.state_layout import state_bucket

    spec = _program(1, 0).optim.groups[0]
    params = [ParamInfo("w", (16, 16), "float32", "cpu", 0)]
    split = plan_buckets(params, 2, 16, 1 << 20).buckets[0]
    with pytest.raises(GraphfuseError, match=r"rank 1's shard holds elements \[128, 256\) of w \(of 256\)"):
        whole_update_function(spec, split, 1)
    with pytest.raises(GraphfuseError, match="w crosses a shard boundary"):
        state_bucket(split, {"w": (16, 1)})
    whole = plan_buckets(params, 2, 16, 1 << 20, whole={"w": 1}).buckets[0]
    assert state_bucket(whole, {"w": (16, 1)}).slices(0)[0].numel == 16


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_adafactor_on_a_transformer_is_bitwise_equal_to_torch(name):
    m_ref, m_gf, loss_of, data = transformer_pair(name)
    o_ref = torch.optim.Adafactor(m_ref.parameters(), lr=0.02, weight_decay=0.01)
    o_gf = torch.optim.Adafactor(m_gf.parameters(), lr=0.02, weight_decay=0.01)
    dm = gf.compile(m_gf, o_gf, loss_of, data[0])
    assert_bitwise_lockstep(m_ref, [o_ref], m_gf, dm, loss_of, data)
    assert_same_torch_state(o_gf.state_dict(), o_ref.state_dict())


def test_inspect_counts_the_factored_state_in_its_own_shapes():
    """graphfuse inspect's memory row: unsharded, every parameter's Adafactor state in its own
    shape (factors for matrices, a moment for vectors); per rank, the state shards as laid out;
    the ownership table: every parameter on one rank, at the cost counted from the update (a
    matrix: its factors' outer product, 2 FLOPs an element, plus its elements; a vector: its elements)."""
    from graphfuse.cli.facts import memory_facts, ownership_facts

    program = _program(2, 0)
    (bucket,) = program.layout.buckets
    spec = program.optim.groups[0]
    own = sum(torch.Size(s).numel() for slot in bucket.slots for s in spec.state_shapes(slot.shape).values())
    shards = sum(program.inputs_meta[f"bucket0.{s}"].shape[0] for s in ("row_var", "col_var", "variance"))
    row = memory_facts(program)[0]
    assert row["optimizer_state_unsharded"] == 4 * own and row["optimizer_state"] == 4 * shards
    assert own < sum(s.numel for s in bucket.slots)  # factored: below one moment per element
    facts = ownership_facts(program)
    assert sorted(f for o in facts for f in o["params"]) == sorted(bucket.fqns)
    cost = {s.fqn: s.numel * (3 if len(s.shape) >= 2 else 1) for s in bucket.slots}
    assert [o["cost"] for o in facts] == [sum(cost[f] for f in o["params"]) for o in facts]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("compile_", ["eager", "inductor"])
def test_on_cuda_adafactor_trains_like_torch_optim_adafactor(compile_):
    """On CUDA, op by op (`compile="eager"`) and compiled by inductor: weights within 1e-6 of
    torch.optim.Adafactor's on CUDA over 4 steps (inductor's fused kernels round differently)."""
    torch.manual_seed(0)
    m_ref = Shapes().cuda()
    m_gf = copy.deepcopy(m_ref)
    o_ref = torch.optim.Adafactor(m_ref.parameters(), lr=0.02, weight_decay=0.01)
    data = [tuple(t.cuda() for t in b) for b in batches(STEPS)]
    dm = gf.compile(
        m_gf,
        torch.optim.Adafactor(m_gf.parameters(), lr=0.02, weight_decay=0.01),
        loss_fn,
        data[0],
        gf.Strategy(compile=compile_),
    )
    for batch in data:
        o_ref.zero_grad()
        loss_fn(m_ref, batch).backward()
        o_ref.step()
        dm(batch)
    diff = max((p - q).abs().max().item() for p, q in zip(m_ref.parameters(), m_gf.parameters()))
    print(f"cuda, compile={compile_}: max weight difference {diff:.2e} after {STEPS} steps")
    assert diff <= 1e-6, diff


def test_a_program_file_keeps_adafactor_eps_none_and_refuses_an_edited_one(tmp_path):
    """eps=(None, ...) (the dtype's epsilon) is saved as null and loads as None; a program file
    edited to hold a string there is refused, naming the field."""
    import json

    from tests.program_files.test_program_io import rehash

    torch.manual_seed(0)
    model = Shapes()
    dm = gf.compile(model, torch.optim.Adafactor(model.parameters()), loss_fn, batches(1)[0])
    gf.save_program(dm.program, tmp_path / "program")
    assert gf.load_program(tmp_path / "program").optim.groups[0].eps1 is None
    doc = json.loads((tmp_path / "program" / "program.json").read_text())
    doc["optim"]["groups"][0]["eps1"] = "x"
    (tmp_path / "program" / "program.json").write_text(json.dumps(doc))
    rehash(tmp_path / "program")
    with pytest.raises(gf.ProgramFormatError, match=r"optim.groups\[0\].eps1 must be a float or null"):
        gf.load_program(tmp_path / "program")
