"""The CUDA path: eager and inductor-compiled programs on one GPU, with and without an NCCL
process group. Skipped where no GPU is present (CI has none; run on a GPU machine)."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the NaN-fill test

import pytest
import torch
import torch.distributed as dist

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).cuda()


def _batches(n: int = 8):
    return [(x.cuda(), y.cuda()) for x, y in synthetic_tokens(CFG, 4, n, seed=3)]


def _eager(batches, **opt_kwargs):
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False, **opt_kwargs)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = gpt_loss(model, b)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, opt, losses


def test_eager_program_on_cuda_matches_torch_optim():
    batches = _batches()
    ref, _, ref_losses = _eager(batches)
    model = _gpt()
    dm = gf.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), gpt_loss, batches[0])
    assert all(t.is_cuda for n, t in dm.tensors.items() if n.startswith("bucket"))
    losses = [dm(b) for b in batches]
    # Not bitwise on CUDA (measured on an H200: params within 7e-6 after 8 steps): the CUDA
    # kernels of add(alpha=) and addcmul contract multiply-adds differently, and Adam's
    # normalisation magnifies tiny differences where a gradient is near zero.
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=1e-5)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=3e-5)


def test_inductor_program_on_cuda_writes_buckets_in_place():
    batches = _batches()
    ref, _, ref_losses = _eager(batches)
    model = _gpt()
    dm = gf.compile(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        gpt_loss,
        batches[0],
        strategy=gf.Strategy(compile="inductor"),
    )
    ptrs = {n: t.data_ptr() for n, t in dm.tensors.items()}
    losses = [dm(b) for b in batches]
    assert {n: t.data_ptr() for n, t in dm.tensors.items()} == ptrs
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-4)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_nccl_group_of_one_and_bf16_master_weights(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        batches = _batches()
        model = _gpt().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dm = gf.compile(
            model, opt, gpt_loss, batches[0], strategy=gf.Strategy(master_dtype=torch.float32, compile="inductor")
        )
        assert dm.world_size == 1 and dm.group_name
        masters = [n for n in dm.tensors if n.endswith(".master")]
        assert masters and all(dm.tensors[n].dtype == torch.float32 for n in masters)
        losses = [dm(b).float().item() for b in batches]
        assert losses[-1] < losses[0]
        bucket = dm.tensors[masters[0].split(".")[0]]
        torch.testing.assert_close(bucket, dm.tensors[masters[0]].to(torch.bfloat16), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_shard_optimizer_on_cuda_with_inductor():
    batches = _batches()
    ref, _, _ = _eager(batches)
    model = _gpt()
    sharded = gf.shard_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), gf.Strategy(compile="inductor")
    )
    for b in batches:
        sharded.zero_grad()
        gpt_loss(model, b).backward()
        sharded.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# Large enough for inductor's mix-order reduction of LayerNorm backward (rows = 64 x 128 = 8192
# >= 4096, rows x 768 >= 5 Mi elements), which wrote LayerNorm gradients outside the packed
# gradient bucket until graphfuse.compiler.inductor.WORKAROUNDS turned it off (issue 9).
WIDE = GPTConfig(vocab_size=256, block_size=128, n_layer=1, n_head=12, n_embd=768)


def _live(bucket) -> torch.Tensor:
    """True where a bucket (or, at world size 1, a state shard) holds a parameter's value."""
    live = torch.zeros(bucket.size, dtype=torch.bool)
    for s in bucket.slots:
        live[s.offset : s.offset + s.numel] = True
    return live


def _first_step_state(compile_mode: str, batch) -> tuple[gf.DistModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(WIDE).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    dm = gf.compile(model, opt, gpt_loss, batch, strategy=gf.Strategy(compile=compile_mode))
    dm(batch)
    torch.cuda.synchronize()
    return dm, {n: t.detach().cpu() for n, t in dm.tensors.items() if t.is_floating_point() and t.dim() == 1}


def test_inductor_step_gradients_match_eager_executor_with_nan_filled_memory():
    """Every gradient of step 1 (read back as exp_avg = (1 - beta1) * grad) of the compiled step
    equals the eager executor's within rounding, while every uninitialised allocation reads NaN;
    every bucket and shard stays finite, with its padding zero."""
    batch = tuple(t.cuda() for t in synthetic_tokens(WIDE, 64, 1, seed=0)[0])
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        dm, eager = _first_step_state("eager", batch)
        _, compiled = _first_step_state("inductor", batch)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    assert eager.keys() == compiled.keys()
    for bucket in dm.layout.buckets:
        live = _live(bucket)
        for name in [n for n in compiled if n == bucket.name or n.startswith(bucket.name + ".")]:
            assert torch.isfinite(compiled[name]).all(), f"{name} holds non-finite values"
            assert (compiled[name][~live] == 0).all(), f"{name}'s padding is not zero"
        for s in bucket.slots:
            want = eager[f"{bucket.name}.exp_avg"][s.offset : s.offset + s.numel]
            got = compiled[f"{bucket.name}.exp_avg"][s.offset : s.offset + s.numel]
            # Rounding from other reduction orders and fused kernels stays far inside 1e-3 of the
            # parameter's largest gradient (the test passes on an H200); the bug gave errors of
            # 1e3 to 1e4 times the gradient.
            tol = 1e-3 * want.abs().max().item() + 1e-12
            err = (got - want).abs().max().item()
            assert err <= tol, f"gradient of {s.fqn}: max |compiled - eager| {err:.3g} > {tol:.3g}"
