"""The eager executor never reads memory that nothing wrote: with every uninitialised
allocation filled with NaN (deterministic mode), steps are bitwise those of a normal run, and
every bucket and shard stays finite with zero padding (issue 9's class of bug, on the CPU)."""

import pytest
import torch

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

CFG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=18)  # odd sizes: every slot padded


def _run(master: bool, nan_fill: bool) -> tuple[list[torch.Tensor], gf.DistModel]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if master:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    strategy = gf.Strategy(bucket_size_mb=0.01, master_dtype=torch.float32 if master else None, max_grad_norm=1.0)
    batches = synthetic_tokens(CFG, 3, 4, seed=1)
    torch.use_deterministic_algorithms(nan_fill)
    try:
        dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)
        losses = [dm(b).detach().clone() for b in batches]
    finally:
        torch.use_deterministic_algorithms(False)
    return losses, dm


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
def test_eager_executor_with_nan_filled_memory_is_bitwise_and_finite(master):
    assert torch.utils.deterministic.fill_uninitialized_memory
    ref_losses, ref = _run(master, nan_fill=False)
    losses, dm = _run(master, nan_fill=True)
    assert len(dm.layout.buckets) > 1
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for name, t in dm.tensors.items():
        assert torch.equal(t, ref.tensors[name]), name
        assert torch.isfinite(t).all(), f"{name} holds non-finite values"
    for bucket in dm.layout.buckets:
        assert any(s.padded > s.numel for s in bucket.slots)
        live = torch.zeros(bucket.size, dtype=torch.bool)
        for s in bucket.slots:
            live[s.offset : s.offset + s.numel] = True
        for name in [n for n in dm.tensors if n == bucket.name or n.startswith(bucket.name + ".")]:
            assert (dm.tensors[name][~live] == 0).all(), f"{name}'s padding is not zero"
