"""The bound on collectives in flight (issue 11): the overlap pass keeps at most k outstanding,
counted at every node of the graph; NCCL keeps unbounded overlap; Gloo groups get the bound."""

from __future__ import annotations

import pytest
import torch

import graphfuse as gf
from graphfuse import passes
from graphfuse.passes.graph import c10d, is_collective, position
from graphfuse.strategy import INFLIGHT_BY_BACKEND
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from tests._common import run_ranks

GLOO_BOUND = 1  # what the soak and the repro in docs/gloo-inflight.md support
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def program(world: int = 2, **strategy) -> gf.Program:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    strategy.setdefault("bucket_size_mb", 0.01)
    p = gf.capture(model, opt, gpt_loss, synthetic_tokens(CFG, 4, 1, 0)[0], gf.Strategy(max_grad_norm=1.0, **strategy))
    return passes.run_pipeline(p.with_(world_size=world, rank=0, group_name="fake"), check=True)


def outstanding_after_each_node(graph) -> list[int]:
    """Collectives issued whose wait has not run yet, counted after every node."""
    issued: set = set()
    counts = []
    for n in graph.nodes:
        if n.target is c10d.wait_tensor.default:
            issued.discard(n.args[0])
        elif is_collective(n):
            issued.add(n)
        counts.append(len(issued))
    return counts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_at_most_k_collectives_are_outstanding_at_every_node(k):
    bounded = program(max_inflight_collectives=k)
    free = program(max_inflight_collectives=None)
    assert len(bounded.layout.buckets) >= 6
    # unbounded, every bucket's all-gather is in flight at the end of the step
    assert max(outstanding_after_each_node(free.graph)) >= len(free.layout.buckets)
    counts = outstanding_after_each_node(bounded.graph)
    assert max(counts) == k
    # the bound moves waits only: the same ops, and every collective still waited before use
    assert sorted(str(n.target) for n in bounded.graph.nodes) == sorted(str(n.target) for n in free.graph.nodes)
    order = position(bounded.graph)
    for w in (n for n in bounded.graph.nodes if n.target is c10d.wait_tensor.default):
        assert order[w.args[0]] < order[w] < min(order[u] for u in w.users)


def test_unbounded_overlap_is_unchanged_by_the_bound_field():
    old = program(max_inflight_collectives=None)
    auto = program()  # "auto" without a runtime: no backend known, no bound
    assert old.graph_module.code == auto.graph_module.code


def test_bound_is_chosen_per_backend():
    s = gf.Strategy()
    assert s.max_inflight_collectives == "auto"
    assert s.for_backend("nccl").max_inflight_collectives is None
    assert s.for_backend("gloo").max_inflight_collectives == INFLIGHT_BY_BACKEND["gloo"] == GLOO_BOUND
    assert s.for_backend(None).max_inflight_collectives is None
    assert gf.Strategy(max_inflight_collectives=4).for_backend("gloo").max_inflight_collectives == 4
    with pytest.raises(gf.UnsupportedError, match="max_inflight_collectives"):
        gf.Strategy(max_inflight_collectives=0)


def _gloo_default_is_bounded(rank: int, world: int) -> tuple:
    losses = {}
    for name, strategy in {
        "auto": gf.Strategy(bucket_size_mb=0.01),
        "free": gf.Strategy(bucket_size_mb=0.01, max_inflight_collectives=None),
    }.items():
        torch.manual_seed(0)
        model = GPT(CFG)
        dm = gf.compile(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            gpt_loss,
            synthetic_tokens(CFG, 4, 1, rank)[0],
            strategy=strategy,
        )
        losses[name] = [dm(b).item() for b in synthetic_tokens(CFG, 4, 3, rank)]
        if name == "auto":
            bound = dm.strategy.max_inflight_collectives, dm.program.strategy.max_inflight_collectives
            peak = max(outstanding_after_each_node(dm.program.graph))
    return bound, peak, losses["auto"] == losses["free"]


def test_gloo_group_runs_the_default_strategy_with_the_gloo_bound():
    for bound, peak, same_losses in run_ranks(_gloo_default_is_bounded, 2):
        assert bound == (GLOO_BOUND, GLOO_BOUND) and peak == GLOO_BOUND
        assert same_losses  # waiting earlier changes no numerics
