"""torch.compile(backend="graphfuse") + gf.shard_optimizer on what a PyTorch user writes: a CNN
(BatchNorm, max pool, GroupNorm), and several models of one class in one process (a notebook,
an evaluation copy, a restart), each with its own optimizer and buckets."""

import pytest
import torch
import torch.nn.functional as F

import graphfuse as gf

# As tests/frontends/test_backend.py: inductor's kernels round unlike eager ones, so not bitwise.
RTOL, ATOL = 1e-5, 1e-6


class CNN(torch.nn.Module):
    """Every layer a small image model has: conv, BatchNorm, max and adaptive average pooling,
    GroupNorm, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        # no bias before BatchNorm: its gradient is zero up to rounding, which AdamW turns into O(lr) steps
        self.conv1, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.conv2, self.gn = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.GroupNorm(2, 8)
        self.head = torch.nn.Linear(8 * 2 * 2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.gn(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def _pair(build, seed: int = 0):
    """The same model twice: an eager reference with torch AdamW, and one whose parameters a
    gf.shard_optimizer owns (tiny buckets: several per model), compiled with backend="graphfuse"."""
    torch.manual_seed(seed)
    ref = build()
    torch.manual_seed(seed)
    mine = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    strategy = gf.Strategy(align_bytes=32, bucket_size_mb=0.0005)
    opt = gf.shard_optimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2), strategy, model=mine)
    return ref, ref_opt, mine, opt, torch.compile(mine, backend="graphfuse")


def _images(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def _step(model, opt, batch) -> None:
    opt.zero_grad()
    F.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()


def _assert_close(ref: torch.nn.Module, mine: torch.nn.Module) -> None:
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


def _reduced_in_backward(opt) -> list[int]:
    return sorted(b for _, buckets in opt.backward_graphs for b in buckets)


def test_cnn_with_batchnorm_max_pool_and_groupnorm_trains_through_the_backend_like_eager():
    """Inductor's decomposition of max_pool2d calls into torch._inductor.lowering, which the
    backend must have imported (it crashed with an AttributeError before)."""
    torch._dynamo.reset()
    ref, ref_opt, mine, opt, compiled = _pair(CNN)
    for batch in _images(3, 3):
        _step(ref, ref_opt, batch)
        _step(compiled, opt, batch)
    _assert_close(ref, mine)  # parameters and BatchNorm's running statistics
    assert _reduced_in_backward(opt) == list(range(len(opt.layout.buckets))) and len(opt.layout.buckets) > 1
    assert set(opt.last_reductions.values()) == {1}
    ref.eval(), mine.eval()
    x = _images(4, 1)[0][0]
    with torch.no_grad():  # evaluation between training steps: its own region, no backward
        torch.testing.assert_close(compiled(x), ref(x), rtol=RTOL, atol=ATOL)
    assert len(opt.regions) == 1  # the no_grad region keeps no bucket out of the training backward


def test_a_validation_pass_under_no_grad_with_dropout_compiles():
    """A loss computed under torch.no_grad() without model.eval(): AOTAutograd compiles a graph
    without backward, whose dropout inductor lowers only after its joint-graph passes (as
    backend="inductor" runs them); it failed with "should have been handled in replace_random.py"."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    opt = gf.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    compiled = torch.compile(model, backend="graphfuse")
    x, y = _vectors(6, 1)[0]
    _step(compiled, opt, (x, y))
    with torch.no_grad():
        out = compiled(x)
        plain = model.eval()(x)
    assert out.shape == (6, 4) and torch.isfinite(out).all()
    assert not torch.allclose(out, plain)  # dropout ran


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _vectors(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def test_two_models_of_one_class_train_each_with_its_own_optimizer_and_buckets():
    """Dynamo reuses the first model's graph for the second instance; the backend dispatches each
    call on the optimizer owning the parameters passed, and runs that owner's backward. The
    second model is built after the first has trained (the backward compiled for the first)."""
    torch._dynamo.reset()
    a = _pair(_mlp, seed=0)
    data = _vectors(5, 8)
    for batch in data[:2]:
        _step(a[0], a[1], batch)
        _step(a[4], a[3], batch)
    b = _pair(_mlp, seed=1)
    for i, batch in enumerate(data[2:6]):  # alternately, each on its own batches
        for ref, ref_opt, _, opt, compiled in (a, b) if i % 2 else (b, a):
            _step(ref, ref_opt, batch)
            _step(compiled, opt, batch)
    # both forwards before one backward: each call's backward still finds its own optimizer
    for ref_opt, opt in ((a[1], a[3]), (b[1], b[3])):
        ref_opt.zero_grad(), opt.zero_grad()
    x, y = data[6]
    (F.mse_loss(a[0](x), y) + F.mse_loss(b[0](x), y)).backward()
    (F.mse_loss(a[4](x), y) + F.mse_loss(b[4](x), y)).backward()
    for ref, ref_opt, mine, opt, _ in (a, b):
        ref_opt.step(), opt.step()
        _assert_close(ref, mine)
        assert _reduced_in_backward(opt) == list(range(len(opt.layout.buckets))) and len(opt.layout.buckets) > 1
        assert set(opt.last_reductions.values()) == {1}  # each bucket once: by its own backward
    assert not torch.equal(a[2][0].weight, b[2][0].weight)  # two models, not one trained twice


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Stack(torch.nn.Module):
    """Blocks with a graph break inside the loop over them: dynamo compiles Block.forward once
    for an input that requires grad and calls that graph for every block after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for block in self.blocks[:depth]:
            x = block(x)
            torch._dynamo.graph_break()
        return x


def test_one_graph_reused_for_another_block_of_the_same_optimizer_after_its_backward_is_refused():
    """The refusal stays for the case it was meant for (several modules of one model under one
    optimizer, the backward already rewritten for one of them), and names the parameters."""
    torch._dynamo.reset()
    model = Stack()
    strategy = gf.Strategy(align_bytes=32, bucket_size_mb=0.0002)  # a bucket per parameter
    opt = gf.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy, model=model)
    compiled = torch.compile(model, backend="graphfuse")
    x = torch.randn(4, 8)
    compiled(x, 2).sum().backward()  # the second graph's backward is rewritten for blocks.1
    assert all(buckets for _, buckets in opt.backward_graphs)
    with pytest.raises(
        gf.UnsupportedError,
        match=r"same gf.shard_optimizer.*blocks\.2\.fc\.weight where it had blocks\.1\.fc\.weight.*loop",
    ):
        compiled(x, 3)
