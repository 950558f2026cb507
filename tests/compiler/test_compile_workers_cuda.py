"""Strategy.compile_workers on one GPU: the step cut into pieces compiled by several processes
gives the step that the same strategy compiled in one process gives, and every piece a worker
compiled is found in inductor's cache by the main process (tests/compiler/test_compile_workers.py checks
that contract deterministically, on the CPU). Skipped where no GPU is present (CI
has none; run on a GPU machine)."""

import logging

import pytest
import torch

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=2, n_embd=64)


def _train(workers: int, batches, bucket_mb: float):
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    strategy = gf.Strategy(compile="inductor", compile_workers=workers, bucket_size_mb=bucket_mb)
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)
    losses = torch.stack([dm(b) for b in batches])
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bucket_mb", [0.02, 256.0])  # many buckets; one bucket cut across pieces
def test_pieces_compiled_by_workers_match_one_compile(tmp_path, monkeypatch, caplog, bucket_mb):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    batches = [(x.cuda(), y.cuda()) for x, y in synthetic_tokens(CFG, 4, 6, seed=3)]
    ref_losses, ref_params = _train(0, batches, bucket_mb)
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        losses, params = _train(2, batches, bucket_mb)
    log = caplog.text
    # Which process compiles which piece depends on how fast the workers start (the main
    # process takes every piece no worker has claimed); each piece is compiled once, and every
    # piece a worker compiled is found in the cache.
    assert "piece 1 of 3 compiled here" in log, log
    assert "not found in inductor's cache" not in log and "compiling it here" not in log, log
    # Pieces are fused apart at their cuts (a value crossing a cut is written out and read
    # back), so kernels differ from the one-graph compile's: close, not bitwise.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-4)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_auto_compiles_in_pieces_by_the_hosts_cores(tmp_path, monkeypatch, caplog):
    # The default, compile_workers="auto", as on a host with 16 cores for this one rank: 3 workers.
    from graphfuse.compiler import workers as W

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(W, "host_cores", lambda: (16, False))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    batches = [(x.cuda(), y.cuda()) for x, y in synthetic_tokens(CFG, 4, 3, seed=5)]
    ref_losses, _ = _train(0, batches, 256.0)
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with caplog.at_level(logging.INFO, logger="graphfuse"):
        dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=gf.Strategy(compile="inductor"))
        losses = torch.stack([dm(b) for b in batches])
    assert dm.compile_workers == 3 and "compile_workers='auto': 3 here" in caplog.text, caplog.text
    assert "piece 1 of 4 compiled here" in caplog.text, caplog.text
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-4)  # pieces: close, not bitwise
