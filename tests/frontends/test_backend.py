"""The torch.compile path: backend="graphfuse" for forward/backward, gf.shard_optimizer for a
fused, sharded optimizer step."""

import pytest
import torch
import torch.distributed as dist

import graphfuse as gf
from graphfuse.passes.graph import count_targets
from tests._common import run_ranks


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _batches(seed: int, n: int = 10):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _eager_vs_sharded(rank: int, world: int, optim_cls, kwargs) -> tuple[bool, bool, dict]:
    ref, mine = _mlp(), _mlp()
    ref_opt = optim_cls(ref.parameters(), foreach=False, **kwargs)
    opt = optim_cls(mine.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: min(1.0, (s + 1) / 4))
    sharded = gf.shard_optimizer(opt, gf.Strategy(align_bytes=32, bucket_size_mb=0.0005))
    losses_equal = True
    for batch in _batches(100 + rank):
        ref_opt.zero_grad()
        loss_ref = _loss(ref, batch)
        loss_ref.backward()
        if world > 1:
            for p in ref.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        ref_opt.step()
        ref_sched.step()
        sharded.zero_grad()
        loss = _loss(mine, batch)
        loss.backward()
        sharded.step()
        sched.step()
        losses_equal &= torch.equal(loss, loss_ref)
    params_equal = all(torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters()))
    return losses_equal, params_equal, {"buckets": len(sharded.layout.buckets), **count_targets(sharded.program)}


@pytest.mark.parametrize(
    "optim_cls,kwargs",
    [(torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True})],
)
def test_shard_optimizer_is_bitwise_torch_optim_at_world_size_1(optim_cls, kwargs):
    losses_equal, params_equal, counts = _eager_vs_sharded(0, 1, optim_cls, kwargs)
    assert losses_equal and params_equal
    assert counts["buckets"] > 1  # the tiny cap splits the MLP
    assert "_c10d_functional.reduce_scatter_tensor" not in counts


def _two_ranks(rank, world):
    return _eager_vs_sharded(rank, world, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def test_shard_optimizer_matches_eager_data_parallel_at_2_ranks():
    for losses_equal, params_equal, counts in run_ranks(_two_ranks, 2):
        assert losses_equal and params_equal  # bitwise: the average of two values has one rounding
        assert counts["_c10d_functional.reduce_scatter_tensor"] == counts["buckets"]
        assert counts["_c10d_functional.all_gather_into_tensor"] == counts["buckets"]


def test_torch_compile_backend_trains_like_eager():
    ref, mine = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sharded = gf.shard_optimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2))
    compiled = torch.compile(mine, backend="graphfuse")
    for batch in _batches(7, 5):
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        ref_opt.step()
        sharded.zero_grad()
        _loss(compiled, batch).backward()
        sharded.step()
    # inductor fuses the forward/backward differently from eager kernels: not bitwise
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_shard_optimizer_refuses_missing_gradient():
    model = _mlp()
    sharded = gf.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gf.UnsupportedError, match="no gradient"):
        sharded.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_shard_optimizer_with_inductor_compiles_at_the_first_step():
    ref, mine = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sharded = gf.shard_optimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2), gf.Strategy(compile="inductor"))
    for batch in _batches(9, 3):
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        ref_opt.step()
        sharded.zero_grad()
        _loss(mine, batch).backward()
        sharded.step()
    # inductor's update does not round exactly like eager kernels (lerp, sqrt): not bitwise
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
