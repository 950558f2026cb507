"""Start-up: gf.compile logs where its time goes, and a restart from a program file gives inductor
the same graph as the first start, which AOTAutograd's and inductor's FX graph caches then serve
(no second trace or compile)."""

from __future__ import annotations

import logging
import re

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import graphfuse as gf
import graphfuse.compiler.in_place as in_place


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def loss_fn(model, batch):
    return model(batch).square().mean()


BATCH = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_compile_logs_each_startup_phase_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        dm = gf.compile(*mlp(), loss_fn, BATCH)
        dm(BATCH)
        dm(BATCH)
    messages = [r.getMessage() for r in caplog.records if r.name == "graphfuse"]
    assert any(
        m.startswith("graphfuse.compile: capture ") and all(f"{p} " in m for p in ("passes", "verify", "bind"))
        for m in messages
    ), messages
    assert sum(m.startswith("graphfuse: first step: first step ") for m in messages) == 1, (
        messages
    )  # eager: no inductor phase
    assert set(dm.startup) == {"capture", "passes", "verify", "bind", "first step"} and all(
        t > 0 for t in dm.startup.values()
    )


def test_program_file_restart_gives_inductor_the_same_graph_and_hits_its_caches(tmp_path, monkeypatch):
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm.code)
        return compile_graph(gm, example_inputs)

    compile_graph = in_place.compile_graph
    monkeypatch.setattr(in_place, "compile_graph", spy)
    with fresh_cache():
        counters.clear()
        model, opt = mlp()
        dm = gf.compile(model, opt, loss_fn, BATCH, gf.Strategy(compile="inductor"))
        first = dm(BATCH)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and counters["inductor"]["fxgraph_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_saved"] == 1
        gf.save_program(dm.program, tmp_path / "program")

        counters.clear()
        model, opt = mlp()
        restarted = gf.DistModel.from_program(gf.load_program(tmp_path / "program"), model, opt)
        again = restarted(BATCH)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
        # and AOTAutograd's cache (it missed while a traced graph's module named its tracer class)
        assert (
            counters["aot_autograd"]["autograd_cache_hit"] == 1 and counters["aot_autograd"]["autograd_cache_miss"] == 0
        )
        assert "inductor" in restarted.startup
    assert len(seen) == 2 and seen[0] == seen[1]  # byte-identical graph code: the cache key matches
    assert torch.equal(first, again)


def _code(n_layer: int, blocks: bool = False) -> str:
    """The code inductor generates for a GPT's whole step (CPU; FX graph cache off, so the code
    is generated and can be read)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=n_layer, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = synthetic_tokens(cfg, 2, 1, seed=0)[0]
    strategy = gf.Strategy(compile="inductor", align_buckets_to_blocks=blocks)
    dm = gf.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), gpt_loss, batch, strategy=strategy)
    with inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: dm(batch))
    return codes[-1]


def _kernels(n_layer: int, blocks: bool) -> int:
    """Distinct kernels in `_code`."""
    return len(re.findall(r"^\w+ = async_compile\.\w+\(", _code(n_layer, blocks), re.M))


def test_the_compile_speed_settings_shorten_the_fusion_search_and_leave_the_code_as_it_was(monkeypatch):
    # graphfuse.compiler.inductor.COMPILE_SPEED: fewer fusion pairs tried among the readers of one buffer
    # (every parameter is a view of its bucket, so a bucket has many). The kernels must not change.
    from torch._inductor.scheduler import Scheduler

    import graphfuse.compiler.inductor as inductor

    calls = []
    can_fuse = Scheduler.can_fuse

    def counted(self, *args, **kwargs):
        calls[-1] += 1
        return can_fuse(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "can_fuse", counted)
    codes = []
    for settings in ({}, dict(inductor.COMPILE_SPEED)):
        monkeypatch.setattr(inductor, "COMPILE_SPEED", settings)
        calls.append(0)
        codes.append(re.sub(r"#.*", "", _code(2)))  # comments name source nodes and cache paths
    assert codes[0] == codes[1]
    assert 0 < calls[1] < calls[0], calls  # measured (torch 2.13 CPU, 2 layers): 1166 against 1421


def test_aligned_blocks_compile_each_blocks_kernels_once():
    # One bucket per block: 4 and 6 layers compile the same kernels. In the default layout the
    # blocks lie at other offsets of one bucket, constants in the kernels' code, and the count
    # grows with the layers (measured, torch 2.13 CPU: 28 at 4 layers, 36 at 6; aligned 25 at
    # both). The count is not monotonic in the layers in general (5 aligned layers gave 28:
    # inductor groups the buckets' update kernels by count), hence two even counts.
    aligned = [_kernels(n, blocks=True) for n in (4, 6)]
    assert aligned[0] == aligned[1], aligned


def test_aligned_blocks_train_bitwise_like_the_default_layout():
    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
    batches = synthetic_tokens(cfg, 2, 3, seed=0)
    runs = []
    for blocks in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=gf.Strategy(align_buckets_to_blocks=blocks))
        losses = [dm(b) for b in batches]
        runs.append((dm, torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain, plain_losses, plain_params), (aligned, aligned_losses, aligned_params) = runs
    assert len(aligned.layout.buckets) > len(plain.layout.buckets)  # a bucket (or more) per block
    assert torch.equal(aligned_losses, plain_losses)
    assert all(torch.equal(aligned_params[n], p) for n, p in plain_params.items())


def test_auto_gives_buckets_of_their_own_to_the_repeated_blocks_of_a_mebibyte_or_more():
    from graphfuse.ir.blocks import block_of
    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    # 256 wide: each block holds 12 × 256² floats (3 MiB), the blocks repeat; the embeddings do not.
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = synthetic_tokens(cfg, 2, 1, seed=0)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dm = gf.compile(model, opt, gpt_loss, batch, strategy=gf.Strategy(align_buckets_to_blocks="auto"))
    blocks = [{block_of(f) for f in b.fqns} for b in dm.layout.buckets]
    assert sorted(b for s in blocks for b in s if b is not None) == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(len(s) == 1 for s in blocks), blocks  # no bucket mixes blocks, or a block and the rest
    assert dm.program.strategy.align_buckets_to_blocks == "auto"
    assert torch.isfinite(dm(batch))


def test_programs_compile_with_one_launch_configuration_per_pointwise_kernel(monkeypatch):
    # graphfuse.compiler.inductor.FIRST_STEP: a program's pointwise kernels are built with one launch
    # configuration, not timed among several at the first step; torch.compile's graphs through
    # the "graphfuse" backend keep inductor's default. What inductor sees when it compiles:
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    import graphfuse.compiler.inductor as inductor

    assert inductor.FIRST_STEP == {"triton.autotune_pointwise": False}
    seen = []
    real = compile_fx_module.compile_fx

    def watched(*args, **kwargs):
        seen.append(inductor_config.triton.autotune_pointwise)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", watched)
    model, opt = mlp()
    dm = gf.compile(model, opt, loss_fn, BATCH, gf.Strategy(compile="inductor"))
    dm(BATCH)
    assert seen == [False]
    assert inductor_config.triton.autotune_pointwise is True  # only while compiling
    torch._dynamo.reset()
    x = torch.randn(8)
    assert torch.equal(torch.compile(lambda t: t * 2 + 1, backend="graphfuse")(x), x * 2 + 1)
    assert seen == [False, True]
