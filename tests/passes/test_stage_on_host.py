"""Collectives staged through the host (Strategy.stage_collectives_on_host, for Gloo ranks
sharing one GPU) compute the same step: bitwise at 2 real Gloo ranks on the CPU, where the
host copies are plain copies."""

import torch

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from tests._common import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _train(rank: int, world: int, stage: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    strategy = gf.Strategy(bucket_size_mb=0.01, max_grad_norm=1.0, stage_collectives_on_host=stage)
    batches = synthetic_tokens(CFG, 2, 3, seed=10 + rank)
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)
    staged = sum(
        1
        for n in dm.program.graph.nodes
        if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("device") == torch.device("cpu")
    )
    losses = [dm(b).item() for b in batches]
    return {
        "losses": losses,
        "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
        "staged": staged,
        "collectives": sum(
            1 for n in dm.program.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default
        ),
    }


def test_staged_collectives_train_bitwise_like_direct_ones_at_2_ranks():
    direct = run_ranks(_train, 2, False)
    staged = run_ranks(_train, 2, True)
    for d, s in zip(direct, staged):
        assert d["staged"] == 0 and s["staged"] == 2 * s["collectives"] > 0  # a copy there and back per collective
        assert s["losses"] == d["losses"]
        for name, p in d["params"].items():
            assert p == s["params"][name], name  # exact: float32 values are exact as Python floats
