"""Pass contracts: broken pre- and postconditions raise PassContractError naming the pass and
the passes before it (also under `python -O`); each pass decides whether it applies; hand-offs
are typed, checked before the pipeline runs and dropped after it; statistics are recorded."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse import passes
from graphfuse.errors import PassContractError
from graphfuse.ir.program import Handoffs
from graphfuse.passes import all_gather, clip_grad_norm, overlap, reduce_scatter, sharded_update, stage_on_host
from graphfuse.passes.graph import c10d
from graphfuse.passes.verify import VerifyError, verify


def mlp_program(world: int = 2, **strategy) -> gf.Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batch = (torch.randn(4, 8), torch.randn(4, 4))

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    strategy.setdefault("bucket_size_mb", 0.0005)  # a few hundred bytes: several buckets
    program = gf.capture(model, opt, loss_fn, batch, gf.Strategy(**strategy))
    return program.with_(world_size=world, rank=0, group_name="fake")


def test_a_broken_precondition_names_the_pass_and_the_passes_before_it():
    program = passes.run_pass(mlp_program(), passes.plan_buckets)
    with pytest.raises(
        PassContractError,
        match=r"pass reduce_scatter: expected bucket inputs \(passes run before it: capture, plan_buckets\); "
        r"run fuse_params first",
    ):
        passes.run_pass(program, reduce_scatter)


def test_contracts_hold_under_python_O():
    code = (
        "import graphfuse as gf, torch\n"
        "from graphfuse import passes\n"
        "from graphfuse.errors import PassContractError\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "p = gf.capture(m, o, lambda m, b: m(b).sum(), torch.ones(1, 2))\n"
        "try:\n    passes.run_pass(p, passes.fuse_params)\n"
        "except PassContractError as e:\n    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True).stdout
    assert "raised: pass fuse_params: expected a bucket layout (passes run before it: capture)" in out


def test_a_pipeline_whose_hand_offs_are_not_provided_is_refused_before_it_runs():
    program = mlp_program()
    nodes = len(program.graph.nodes)
    broken = [p for p in passes.PIPELINE if p is not reduce_scatter]
    with pytest.raises(
        PassContractError,
        match=r"pass clip_grad_norm needs the hand-offs \['grad_shards'\].*before it: fuse_loss, plan_buckets, "
        r"fuse_params",
    ):
        passes.run_pipeline(program, pipeline=broken)
    assert len(program.graph.nodes) == nodes and program.layout is None  # nothing ran


def test_a_hand_off_a_pass_needs_must_be_there_when_it_runs():
    program = mlp_program()
    for p in (passes.plan_buckets, passes.fuse_params):
        program = passes.run_pass(program, p)
    with pytest.raises(
        PassContractError,
        match=r"pass sharded_update: expected the hand-off grad_shards: one node of the graph per bucket",
    ):
        passes.run_pass(program, sharded_update)


@pytest.mark.parametrize(
    "strategy,skipped",
    [
        ({}, {"fuse_loss", "clip_grad_norm", "stage_on_host", "defer_gather"}),
        ({"overlap": False}, {"fuse_loss", "clip_grad_norm", "overlap", "stage_on_host", "defer_gather"}),
        ({"max_grad_norm": 1.0}, {"fuse_loss", "stage_on_host", "defer_gather"}),
    ],
)
def test_each_pass_decides_whether_it_applies(strategy, skipped):
    program = passes.run_pipeline(mlp_program(**strategy), check=True)
    ran = [passes.pass_name(p) for p in passes.PIPELINE if passes.pass_name(p) not in skipped]
    assert program.pass_names == ("capture", *ran)
    assert clip_grad_norm.applies(program) == ("max_grad_norm" in strategy)
    assert overlap.applies(program) == strategy.get("overlap", True)
    assert not stage_on_host.applies(program)  # "auto" is resolved by a runtime only; none here


def test_statistics_count_what_each_pass_did(caplog):
    with caplog.at_level(logging.DEBUG, logger="graphfuse.passes"):
        program = passes.run_pipeline(mlp_program(max_grad_norm=1.0))
    runs = {r.name: r for r in program.passes}
    buckets = len(program.layout.buckets)
    assert buckets > 1
    assert runs["reduce_scatter"].collectives_added == buckets
    assert runs["all_gather"].collectives_added == buckets
    assert runs["clip_grad_norm"].collectives_added == 1
    assert runs["sharded_update"].collectives_added == 0 and runs["sharded_update"].nodes_removed > 0
    # fuse_params replaces 4 parameter placeholders with bucket placeholders and views.
    assert (
        runs["fuse_params"].nodes_removed >= 4 and runs["fuse_params"].nodes_added > runs["fuse_params"].nodes_removed
    )
    assert runs["overlap"].nodes_added == runs["overlap"].nodes_removed == 0
    assert all(r.seconds > 0 for r in program.passes if r.name != "capture")
    logged = [r.getMessage() for r in caplog.records if r.name == "graphfuse.passes"]
    for name in runs:
        if name != "capture":
            assert any(m.startswith(f"{name}: +") for m in logged), name


def test_hand_offs_are_dropped_at_the_end_and_only_the_names_of_passes_compare():
    program = passes.run_pipeline(mlp_program(), check=True)
    assert program.handoffs == Handoffs()
    assert program.passes[1] == gf.ir.program.PassRun("plan_buckets")  # statistics do not compare


def test_overlap_ensures_every_collective_is_read_only_through_its_wait():
    program = passes.run_pipeline(mlp_program(), check=True)
    overlap.ensures(program)
    issued = next(n for n in program.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    wait = next(iter(issued.users))
    user = next(iter(wait.users))
    user.replace_input_with(wait, issued)  # reads the all-gather's buffer before the wait
    with pytest.raises(
        PassContractError, match=r"pass overlap: expected collective .* read only through one wait_tensor"
    ):
        overlap.ensures(program)


def test_overlap_ensures_every_wait_comes_before_the_first_use_of_its_result():
    program = passes.run_pipeline(mlp_program(), check=True)
    issued = next(n for n in program.graph.nodes if n.target is c10d.reduce_scatter_tensor.default)
    wait = next(iter(issued.users))
    program.graph.output_node().prepend(wait)  # waits after its first user
    with pytest.raises(
        PassContractError,
        match=rf"pass overlap: expected the wait {wait.name} after its collective .* before the first use",
    ):
        overlap.ensures(program)


def test_all_gather_requires_no_new_bucket_output_yet():
    program = passes.run_pipeline(mlp_program(), check=True)
    with pytest.raises(
        PassContractError,
        match=r"pass all_gather: expected no new-bucket output yet .*passes run before it: capture, plan_buckets",
    ):
        all_gather.requires(program)


def test_verify_leaves_node_meta_as_it_was():
    program = passes.run_pipeline(mlp_program(), check=False)
    before = {n: dict(n.meta) for n in program.graph.nodes}
    verify(program, propagate=True)
    after = {n: dict(n.meta) for n in program.graph.nodes}
    assert before.keys() == after.keys()
    for n, meta in before.items():
        assert meta.keys() == after[n].keys() and all(meta[k] is after[n][k] for k in meta), n.name


def test_verify_rejects_a_hand_off_to_a_node_outside_the_graph():
    program = passes.run_pass(
        passes.run_pass(passes.run_pass(mlp_program(), passes.plan_buckets), passes.fuse_params), reduce_scatter
    )
    verify(program)
    stray = torch.fx.Graph().placeholder("stray")
    program = program.handing_off(grad_shards=(stray, *program.handoffs.grad_shards[1:]))
    with pytest.raises(VerifyError, match="hand-off between passes names stray"):
        verify(program)


def test_an_unexpected_error_in_a_pass_is_noted_with_the_pass_and_the_passes_before_it():
    def broken_run(program):
        raise ValueError("a bug")

    broken = SimpleNamespace(
        NAME="broken",
        NEEDS=(),
        PROVIDES=(),
        applies=lambda p: True,
        requires=lambda p: None,
        run=broken_run,
        ensures=lambda p: None,
    )
    with pytest.raises(ValueError, match="a bug") as info:
        passes.run_pipeline(mlp_program(), pipeline=[passes.plan_buckets, broken])
    assert info.value.__notes__ == ["in graphfuse pass broken, after: capture, plan_buckets"]


def test_a_program_file_holds_the_names_of_the_passes_and_no_hand_off(tmp_path):
    program = passes.run_pipeline(mlp_program(world=1), check=True)
    gf.save_program(program, tmp_path / "prog")
    text = "".join(f.read_text(errors="replace") for f in (tmp_path / "prog").rglob("*") if f.is_file())
    assert "handoffs" not in text and "grad_shard" not in text and "PassRun" not in text
    loaded = gf.load_program(tmp_path / "prog")
    assert loaded.pass_names == program.pass_names and loaded.handoffs == Handoffs()


# ---- the Pass protocol (passes/_contract.py) -------------------------------------------------


def test_every_pass_of_the_pipeline_and_shard_inputs_implement_the_pass_protocol():
    from graphfuse.passes._contract import MEMBERS, always
    from graphfuse.passes.shard_inputs import ShardInputs

    assert MEMBERS == ("NAME", "NEEDS", "PROVIDES", "applies", "requires", "run", "ensures")
    for p in [*passes.PIPELINE, ShardInputs(frozenset({0}))]:
        assert isinstance(p, passes.Pass), p
    # the passes that run on every program share the one default
    assert [p.NAME for p in passes.PIPELINE if p.applies is always] == [
        "plan_buckets",
        "fuse_params",
        "reduce_scatter",
        "sharded_update",
        "all_gather",
        "serializer",
    ]
    assert ShardInputs(frozenset()).applies(mlp_program()) is True


def test_a_pass_without_a_member_of_the_protocol_is_refused_before_anything_runs():
    program = mlp_program()
    nodes = len(program.graph.nodes)
    hookless = SimpleNamespace(
        NAME="hookless", NEEDS=(), PROVIDES=(), applies=lambda p: True, requires=lambda p: None, run=lambda p: p
    )
    assert not isinstance(hookless, passes.Pass)
    with pytest.raises(
        PassContractError, match=r"pass hookless \(pipeline position 1\) has no ensures; .*graphfuse.passes.Pass"
    ):
        passes.run_pipeline(program, pipeline=[passes.plan_buckets, hookless])
    assert len(program.graph.nodes) == nodes and program.layout is None  # refused before plan_buckets ran


def test_each_node_a_pass_creates_names_that_pass_and_program_files_keep_it(tmp_path):
    from graphfuse.passes.graph import PASS_META

    captured = mlp_program(max_grad_norm=1.0)
    before = {n.name for n in captured.graph.nodes}
    program = passes.run_pipeline(captured)
    by_pass: dict = {}
    for n in program.graph.nodes:
        by_pass.setdefault(n.meta.get(PASS_META), []).append(n)
    buckets = len(program.layout.buckets)

    def targets(name):
        return [n.target for n in by_pass[name] if n.op == "call_function"]

    # where each collective comes from: one reduce-scatter and one all-gather per bucket, one all-reduce
    assert targets("reduce_scatter").count(c10d.reduce_scatter_tensor.default) == buckets
    assert targets("all_gather").count(c10d.all_gather_into_tensor.default) == buckets
    assert targets("clip_grad_norm").count(c10d.all_reduce.default) == 1
    assert {n.target for n in by_pass["fuse_params"] if n.op == "placeholder"} == {
        f"bucket_{b.name}" for b in program.layout.buckets
    }
    # a captured node is not stamped, and every stamped node is new
    assert all(n.name in before for n in by_pass[None]) and not any(
        n.name in before for k, ns in by_pass.items() if k for n in ns
    )
    assert set(by_pass) - {None} <= set(program.pass_names)
    gf.save_program(program, tmp_path / "prog")
    loaded = gf.load_program(tmp_path / "prog")
    assert [n.meta.get(PASS_META) for n in loaded.graph.nodes] == [n.meta.get(PASS_META) for n in program.graph.nodes]
