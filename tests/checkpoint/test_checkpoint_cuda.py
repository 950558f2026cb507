"""Checkpoints of a model on a GPU: a synchronous and an async save (pinned host copy) load
back bitwise into a fresh model. Skipped where no GPU is present (CI has none)."""

import pytest
import torch

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCHES = [(x.cuda(), y.cuda()) for x, y in synthetic_tokens(CFG, 4, 6, seed=3)] if torch.cuda.is_available() else []


def _dm(seed: int, mode: str):
    torch.manual_seed(seed)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    strategy = gf.Strategy(bucket_size_mb=0.05, checkpoint_mode=mode)
    return gf.compile(model, opt, gpt_loss, BATCHES[0], strategy=strategy)


@pytest.mark.parametrize("mode", ["unbalanced", "balanced"])
def test_async_and_sync_saves_on_cuda_load_bitwise(tmp_path, mode):
    dm = _dm(0, mode)
    for b in BATCHES[:3]:
        dm(b)
    at_save = {k: v.clone() for k, v in dm.tensors.items() if k.startswith("bucket")}
    gf.save(dm, tmp_path / "sync")
    handle = gf.save(dm, tmp_path / "async", async_=True)
    for b in BATCHES[3:]:
        dm(b)  # the GPU buffers change while the background thread writes
    handle.wait()
    for name in ("sync", "async"):
        fresh = _dm(1, mode)
        gf.load(fresh, tmp_path / name)
        assert fresh.steps == [3]
        for k, v in at_save.items():
            assert fresh.tensors[k].is_cuda and torch.equal(fresh.tensors[k], v), (name, k)
