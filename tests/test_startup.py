"""Start-up: gf.compile logs where its time goes, and a restart from a program file gives inductor
the same graph as the first start, which AOTAutograd's and inductor's FX graph caches then serve
(no second trace or compile)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import graphfuse as gf
import graphfuse.execute as execute


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
    assert any(m.startswith("graphfuse.compile: capture ") and all(f"{p} " in m for p in ("passes", "verify", "bind")) for m in messages), messages
    assert sum(m.startswith("graphfuse: first step: first step ") for m in messages) == 1, messages  # eager: no inductor phase
    assert set(dm.startup) == {"capture", "passes", "verify", "bind", "first step"} and all(t > 0 for t in dm.startup.values())


def test_program_file_restart_gives_inductor_the_same_graph_and_hits_its_caches(tmp_path, monkeypatch):
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm.code)
        return compile_graph(gm, example_inputs)

    compile_graph = execute.compile_graph
    monkeypatch.setattr(execute, "compile_graph", spy)
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
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1 and counters["aot_autograd"]["autograd_cache_miss"] == 0
        assert "inductor" in restarted.startup
    assert len(seen) == 2 and seen[0] == seen[1]  # byte-identical graph code: the cache key matches
    assert torch.equal(first, again)
