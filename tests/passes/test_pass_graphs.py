"""One pass at a time, graph in and graph out (as MLIR tests passes): a captured step of a
tiny model goes through the passes before the one under test, then through that pass with
`verify` after it, and the ops it wrote and their order are checked on `gm.code`.

The model is `Linear(4, 3)` under SGD with momentum, at world size 2 seen from rank 1, with
16-byte alignment and a 48-byte bucket cap: bucket0 holds `weight` (12 elements, padded to
16; rank 1's shard is [8, 16)), bucket1 holds `bias` (3 elements, padded to 8; rank 1's
shard [4, 8) is all padding). Backward produces the weight's gradient first."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.testing import FileCheck

import graphfuse as gf
from graphfuse import passes
from graphfuse.passes import (
    all_gather,
    clip_grad_norm,
    defer_gather,
    fuse_params,
    overlap,
    plan_buckets,
    reduce_scatter,
    serializer,
    sharded_update,
    stage_on_host,
)
from graphfuse.passes.verify import verify

RS = "_c10d_functional.reduce_scatter_tensor.default"
AG = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"


def program_before(pass_under_test, world: int = 2, **strategy) -> gf.Program:
    """The tiny model's captured step after every pass of PIPELINE before `pass_under_test`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    strategy = {"bucket_size_mb": 48 / 2**20, "align_bytes": 16, **strategy}
    program = gf.capture(model, opt, lambda m, b: m(b).square().mean(), torch.randn(2, 4), gf.Strategy(**strategy))
    program = program.with_(world_size=world, rank=1 if world > 1 else 0, group_name="g")
    verify(program)
    for p in passes.PIPELINE[: passes.PIPELINE.index(pass_under_test)]:
        program = passes.run_pass(program, p, check=True)
    return program


def run(program: gf.Program, p) -> tuple[gf.Program, str]:
    out = passes.run_pass(program, p, check=True)  # check: verify after the pass
    assert out.pass_names[-1] == p.NAME
    return out, out.graph_module.code


def test_plan_buckets_plans_in_gradient_order_and_leaves_the_graph_alone():
    program = program_before(plan_buckets)
    before = program.graph_module.code
    out, code = run(program, plan_buckets)
    assert code == before
    assert [[(s.fqn, s.offset, s.numel, s.padded) for s in b.slots] for b in out.layout.buckets] == [
        [("weight", 0, 12, 16)],
        [("bias", 0, 3, 8)],
    ]


def test_fuse_params_turns_parameters_into_views_of_buckets_and_packs_new_values():
    out, code = run(program_before(fuse_params), fuse_params)
    FileCheck().check(
        "def forward(self, state_weight_momentum_buffer, state_bias_momentum_buffer, scalar_group0_lr, "
        "batch_batch_0, bucket_bucket0, bucket_bucket1)"
    ).run(code)
    FileCheck().check_not("param_").run(code)
    # The views come first, before any op of the step.
    (
        FileCheck()
        .check("aten.slice.Tensor(bucket_bucket1, 0, 0, 3)")
        .check("aten.view.default(slice_tensor_1, [3])")
        .check("aten.slice.Tensor(bucket_bucket0, 0, 0, 12)")
        .check("aten.view.default(slice_tensor, [3, 4])")
        .check("aten.t.default(view_default)")
        .run(code)
    )
    # The traced update's new values are flattened, zero-padded to their slots and returned per bucket.
    (
        FileCheck()
        .check("aten.reshape.default(addcmul, [-1])")
        .check("aten.constant_pad_nd.default(reshape_default, [0, 4], 0.0)")
        .check("aten.reshape.default(addcmul_1, [-1])")
        .check("aten.constant_pad_nd.default(reshape_default_1, [0, 5], 0.0)")
        .check("return (detach, add, add_1, constant_pad_nd_default, constant_pad_nd_default_1)")
        .run(code)
    )


def test_reduce_scatter_packs_each_bucket_and_issues_it_as_soon_as_its_gradients_exist():
    out, code = run(program_before(reduce_scatter), reduce_scatter)
    FileCheck().check_count(RS, 2, exactly=True).check_not(RS).run(code)
    (
        FileCheck()
        .check("t_3 = torch.ops.aten.t.default(t_2)")  # the weight's gradient
        .check("aten.reshape.default(t_3, [-1])")
        .check("aten.new_zeros.default(reshape_default_2, [4])")
        .check("aten.cat.default([reshape_default_2, new_zeros_default])")
        .check(f"{RS}(cat_default, 'avg', 2, 'g')")
        .check(WAIT)
        .check("aten.sum.dim_IntList(mul_1, [0], True)")  # the bias's gradient, after bucket0 is issued
        .check("aten.reshape.default(view, [-1])")
        .check("aten.new_zeros.default(reshape_default_3, [5])")
        .check(f"{RS}(cat_default_1, 'avg', 2, 'g')")
        .check(WAIT)
        .check("aten.detach.default(mean)")
        .run(code)
    )


def test_reduce_scatter_at_world_size_1_packs_without_a_collective():
    out, code = run(program_before(reduce_scatter, world=1), reduce_scatter)
    FileCheck().check_not("_c10d_functional").run(code)
    # At world size 1 the weight (12 elements) needs no padding: its flat gradient is the shard.
    shards = [(n.target, str(n.args)) for n in out.handoffs.grad_shards]
    aten = torch.ops.aten
    assert shards == [
        (aten.reshape.default, "(t_3, [-1])"),
        (aten.cat.default, "([reshape_default_3, new_zeros_default],)"),
    ]


def test_clip_grad_norm_scales_every_shard_by_one_all_reduced_norm():
    out, code = run(program_before(clip_grad_norm, max_grad_norm=1.0), clip_grad_norm)
    (
        FileCheck()
        .check("aten._to_copy.default(wait_tensor_default, dtype = torch.float32)")
        .check("aten.square.default")
        .check("aten.sum.default")
        .check("aten._to_copy.default(wait_tensor_default_1, dtype = torch.float32)")
        .check("aten.square.default")
        .check("aten.sum.default")
        .check("aten.add.Tensor(sum_default, sum_default_1)")
        .check("_c10d_functional.all_reduce.default(add_tensor, 'sum', 'g')")
        .check(WAIT)
        .check("aten.sqrt.default")
        .check("aten.add.Tensor(sqrt_default, 1e-06)")
        .check("aten.reciprocal.default")
        .check("aten.mul.Tensor(reciprocal_default, 1.0)")
        .check("aten.clamp_max.default(mul_tensor, 1.0)")
        .check("aten.mul.Tensor(wait_tensor_default, clamp_max_default)")
        .check("aten.mul.Tensor(wait_tensor_default_1, clamp_max_default)")
        .run(code)
    )
    assert [n.name for n in out.handoffs.grad_shards] == ["mul_tensor_1", "mul_tensor_2"]
    # the norm before clipping is returned after the loss (DistModel.grad_norm), written back nowhere
    FileCheck().check("return (").check("sqrt_default)").run(code)
    assert [(s.role, s.target) for s in out.signature.outputs if s.role == "grad_norm"] == [("grad_norm", None)]
    assert out.output_args()[-1].name == "sqrt_default"


def test_sharded_update_updates_each_shard_once_with_flat_states():
    out, code = run(program_before(sharded_update), sharded_update)
    FileCheck().check(
        "def forward(self, scalar_group0_lr, batch_batch_0, bucket_bucket0, bucket_bucket1, "
        "shard_bucket0_momentum_buffer, shard_bucket1_momentum_buffer)"
    ).run(code)
    FileCheck().check_not("state_").check_not("constant_pad_nd").run(code)
    (
        FileCheck()
        .check("aten.slice.Tensor(bucket_bucket0, 0, 8, 16)")  # rank 1's shard of bucket0
        .check("aten.mul.Tensor(shard_bucket0_momentum_buffer, 0.9)")
        .check("aten.add.Tensor(mul_4, wait_tensor_default, alpha = 1.0)")
        .check("aten.addcmul.default(slice_tensor_2, add_2, scalar_group0_lr, value = -1)")
        .check("aten.slice.Tensor(bucket_bucket1, 0, 4, 8)")
        .check("aten.mul.Tensor(shard_bucket1_momentum_buffer, 0.9)")
        .check("aten.add.Tensor(mul_5, wait_tensor_default_1, alpha = 1.0)")
        .check("aten.addcmul.default(slice_tensor_3, add_3, scalar_group0_lr, value = -1)")
        .check("return (detach, add_2, add_3)")
        .run(code)
    )
    FileCheck().check_count("aten.addcmul.default", 2, exactly=True).run(code)
    # The new shards are handed to the all-gather (kept alive although nothing reads them yet).
    assert [n.name for n in out.handoffs.param_shards] == ["addcmul_2", "addcmul_3"]


def test_all_gather_gathers_each_updated_shard_into_its_bucket():
    out, code = run(program_before(all_gather), all_gather)
    (
        FileCheck()
        .check("aten.addcmul.default(slice_tensor_2")
        .check(f"{AG}(addcmul_2, 2, 'g')")
        .check("wait_tensor_default_2 = ")
        .check("aten.addcmul.default(slice_tensor_3")
        .check(f"{AG}(addcmul_3, 2, 'g')")
        .check("wait_tensor_default_3 = ")
        .check("return (detach, add_2, add_3, wait_tensor_default_2, wait_tensor_default_3)")
        .run(code)
    )
    assert out.signature.output_names(gf.ir.signature.NEW_BUCKET) == ["bucket0", "bucket1"]


def test_overlap_moves_each_wait_to_the_first_use_of_its_result():
    out, code = run(program_before(overlap), overlap)
    # Both reduce-scatters are in flight before the first of their waits; the loss's detach
    # runs while they are; the all-gathers are waited for only at the return.
    (
        FileCheck()
        .check(f"{RS}(cat_default,")
        .check_not(WAIT)
        .check(f"{RS}(cat_default_1,")
        .check_not(WAIT)
        .check("aten.detach.default(mean)")
        .check("aten.mul.Tensor(shard_bucket0_momentum_buffer, 0.9)")  # independent of the gradient: before the wait
        .check(f"{WAIT}(reduce_scatter_tensor_default)")
        .check("aten.add.Tensor(mul_4, wait_tensor_default, alpha = 1.0)")
        .run(code)
    )
    (
        FileCheck()
        .check(f"{AG}(addcmul_2")
        .check_not(f"{WAIT}(all_gather")
        .check(f"{AG}(addcmul_3")
        .check_not(WAIT)
        .check(f"{WAIT}(all_gather_into_tensor_default)")
        .check(f"{WAIT}(all_gather_into_tensor_default_1)")
        .check("return")
        .run(code)
    )


def test_overlap_does_not_apply_without_strategy_overlap():
    program = program_before(overlap, overlap=False)
    out = passes.run_pass(program, overlap, check=True)
    assert out is program and out.pass_names[-1] == "all_gather"


def test_defer_gather_issues_each_all_gather_at_the_head_and_ends_the_step_with_shards():
    out, code = run(program_before(defer_gather, overlap_param_gather=True), defer_gather)
    # Head of the step, in forward order (bucket0's weight feeds the first matmul, as does
    # bucket1's bias): this rank's shard of each bucket, gathered, before any op of the step.
    (
        FileCheck()
        .check("def forward(")
        .check_next("aten.slice.Tensor(bucket_bucket0, 0, 8, 16)")
        .check_next(f"{AG}(slice_tensor_4, 2, 'g')")
        .check_next(f"wait_tensor_default_4 = torch.ops.{WAIT}(all_gather_into_tensor_default_2)")
        .check_next("aten.slice.Tensor(bucket_bucket1, 0, 4, 8)")
        .check_next(f"{AG}(slice_tensor_5, 2, 'g')")
        .check_next(f"wait_tensor_default_5 = torch.ops.{WAIT}(all_gather_into_tensor_default_3)")
        .run(code)
    )
    # The forward and the update read the gathered buckets; the parameters' views moved down
    # to the op that first computes on them.
    (
        FileCheck()
        .check("aten.slice.Tensor(wait_tensor_default_4, 0, 0, 12)")
        .check_next("aten.view.default(slice_tensor, [3, 4])")
        .check_next("aten.t.default(view_default)")
        .check_next("aten.slice.Tensor(wait_tensor_default_5, 0, 0, 3)")
        .check_next("aten.view.default(slice_tensor_1, [3])")
        .check_next("aten.addmm.default(view_default_1, batch_batch_0, t)")
        .check(f"{RS}(cat_default,")
        .check(f"{RS}(cat_default_1,")
        .check("aten.addcmul.default(slice_tensor_2")
        .check("aten.addcmul.default(slice_tensor_3")
        .run(code)
    )
    # No collective after the update: the step returns the updated shards themselves.
    FileCheck().check_count(AG, 2, exactly=True).run(code)
    FileCheck().check("addcmul_3 = ").check_not("_c10d_functional").check(
        "return (detach, add_2, add_3, addcmul_2, addcmul_3)"
    ).run(code)
    assert [
        (s.role, s.target)
        for s in out.signature.outputs
        if s.target and s.target.startswith("bucket") and "." not in s.target
    ] == [(gf.ir.signature.NEW_BUCKET_SHARD, "bucket0"), (gf.ir.signature.NEW_BUCKET_SHARD, "bucket1")]


def test_defer_gather_then_overlap_waits_for_each_bucket_just_before_its_first_use():
    program = program_before(defer_gather, overlap_param_gather=True)
    deferred = passes.run_pass(program, defer_gather, check=True)
    code = passes.run_pass(deferred, overlap, check=True).graph_module.code
    # Both all-gathers in flight at the head; bucket0 waited for before the weight's views,
    # bucket1 before the bias's, both before the matmul that reads them.
    (
        FileCheck()
        .check(f"{AG}(slice_tensor_4")
        .check_not(WAIT)
        .check(f"{AG}(slice_tensor_5")
        .check_not(WAIT)
        .check(f"{WAIT}(all_gather_into_tensor_default_2)")
        .check_next("aten.slice.Tensor(wait_tensor_default_4, 0, 0, 12)")
        .check(f"{WAIT}(all_gather_into_tensor_default_3)")
        .check_next("aten.slice.Tensor(wait_tensor_default_5, 0, 0, 3)")
        .check("aten.addmm.default")
        .run(code)
    )
    # The reduce-scatters as without deferral: issued when the gradients exist, waited for by the update.
    (
        FileCheck()
        .check(f"{RS}(cat_default,")
        .check_not(WAIT)
        .check(f"{RS}(cat_default_1,")
        .check_not(WAIT)
        .check("aten.mul.Tensor(shard_bucket0_momentum_buffer, 0.9)")
        .check(f"{WAIT}(reduce_scatter_tensor_default)")
        .check("aten.add.Tensor(mul_4, wait_tensor_default, alpha = 1.0)")
        .check(f"{WAIT}(reduce_scatter_tensor_default_1)")
        .check("aten.add.Tensor(mul_5, wait_tensor_default_1, alpha = 1.0)")
        .check("return (detach, add_2, add_3, addcmul_2, addcmul_3)")
        .run(code)
    )
    # One collective in flight (Gloo): the first gather is waited for before the second is issued.
    bounded = passes.run_pass(
        passes.run_pass(
            program_before(defer_gather, overlap_param_gather=True, max_inflight_collectives=1), defer_gather
        ),
        overlap,
        check=True,
    )
    (
        FileCheck()
        .check(f"{AG}(slice_tensor_4")
        .check(f"{WAIT}(all_gather_into_tensor_default_2)")
        .check_next(f"{AG}(slice_tensor_5")
        .check(f"{WAIT}(all_gather_into_tensor_default_3)")
        .run(bounded.graph_module.code)
    )


@pytest.mark.parametrize("setting,world", [(False, 2), ("auto", 2), (True, 1)])
def test_defer_gather_does_not_apply_unless_asked_at_world_size_above_1(setting, world):
    program = program_before(defer_gather, world=world, overlap_param_gather=setting)
    assert passes.run_pass(program, defer_gather, check=True) is program


def test_stage_on_host_copies_each_collective_input_to_the_host_and_its_result_back():
    out, code = run(program_before(stage_on_host, stage_collectives_on_host=True), stage_on_host)
    host = "device = device(type='cpu')"
    for src, collective in [("cat_default,", RS), ("cat_default_1,", RS), ("addcmul_2,", AG), ("addcmul_3,", AG)]:
        (FileCheck().check(f"_to_copy.default({src} {host})").check_next(f"{collective}(_to_copy_default").run(code))
    # The copy back stands where the result is first used (here right after the wait; the
    # overlap pass then moves the wait down to it).
    (
        FileCheck()
        .check(f"{WAIT}(reduce_scatter_tensor_default)")
        .check(f"_to_copy.default(wait_tensor_default, {host})")
        .check_next("aten.add.Tensor(mul_4, _to_copy_default_1")
        .run(code)
    )
    assert code.count("_to_copy.default(wait_tensor_default") == 4
    assert "return (detach, add_2, add_3, _to_copy_default_5, _to_copy_default_7)" in code


@pytest.mark.parametrize("setting", [False, "auto"])
def test_stage_on_host_does_not_apply_unless_the_strategy_says_so(setting):
    program = program_before(stage_on_host, stage_collectives_on_host=setting)
    assert passes.run_pass(program, stage_on_host, check=True) is program


def test_serializer_plans_rank_1_pieces_and_leaves_the_graph_alone():
    program = program_before(serializer)
    before = program.graph_module.code
    out, code = run(program, serializer)
    assert code == before
    plan = out.state_plan
    saved = [(p.key, p.tensor, p.start, p.stop, p.offsets, p.sizes) for p in plan.saved("balanced")]
    # Rank 1 holds weight's elements 8..11, the chunk at row 2; bias lies in rank 0's shard only.
    assert saved == [
        ("model.weight", "bucket0", 8, 12, (2, 0), (1, 4)),
        ("optim.state.weight.momentum_buffer", "bucket0.momentum_buffer", 0, 4, (2, 0), (1, 4)),
    ]
    assert [(p.key, p.start, p.stop) for p in plan.saved("unbalanced") if p.path[0] != "model"] == [
        ("slice@weight.momentum_buffer@rank1", 0, 4)
    ]


def test_fuse_loss_chunks_a_bias_free_head_over_uneven_chunks():
    """10 tokens in chunks of 4, 4 and 2: per chunk the logits' mm, log-softmax, picked value and
    gradient; the full [10, 6] logits are gone (tests/passes/test_fuse_loss.py has the GPT and numbers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 6, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    batch = (torch.randn(10, 4), torch.randint(0, 6, (10,)))
    st = gf.Strategy(fuse_loss=True, loss_chunk_tokens=4)
    program = gf.capture(model, opt, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), batch, st)
    mms = passes.count_targets(program)["aten.mm"]  # before: the pass edits the graph in place
    out, code = run(program, passes.fuse_loss)
    FileCheck().check_count("_log_softmax.default(mm", 3, exactly=True).run(code)
    FileCheck().check("slice.Tensor(tanh, 0, 0, 4)").check("slice.Tensor(tanh, 0, 4, 8)").check(
        "slice.Tensor(tanh, 0, 8, 12)"
    ).run(code)
    FileCheck().check_count("nll_loss_backward.default(", 3, exactly=True).check("nll_loss_forward.default(cat").run(
        code
    )
    FileCheck().check_not("_log_softmax.default(mm,").run(code)  # the unfused full-size one
    assert passes.count_targets(out)["aten.mm"] == mms - 3 + 3 * 3  # 3 full-size mm's out, 3 per chunk in


@pytest.mark.parametrize("p", passes.PIPELINE, ids=passes.pass_name)
def test_every_pass_of_the_pipeline_has_a_graph_test_here(p):
    assert any(name.startswith(f"test_{p.NAME}_") for name in globals()), f"no test_{p.NAME}_* in {__name__}"
