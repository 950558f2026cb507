"""Strategy(cuda_graphs=True): the whole compiled step replayed from a CUDA graph. The refusals
run everywhere; the replays need a GPU and are skipped without one (with that reason)."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the bitwise tests

import contextlib
import dataclasses
import re

import pytest
import torch

import graphfuse as gf
from graphfuse.compiler.cuda_graph import GraphedStep
from graphfuse.ir import signature as sig
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss
from tests._common import run_ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
GRAPHED = gf.Strategy(compile="inductor", cuda_graphs=True)
CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 10


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


BATCH = (torch.randn(4, 8), torch.randn(4, 4))


# ---- refusals (any machine) ---------------------------------------------------------------
def test_cuda_graphs_needs_the_inductor_compiled_step():
    with pytest.raises(gf.UnsupportedError, match=r"compile='eager'; set compile='inductor', or cuda_graphs=False"):
        gf.Strategy(cuda_graphs=True)
    with pytest.raises(gf.UnsupportedError, match="must be True or False"):
        gf.Strategy(compile="inductor", cuda_graphs="auto")
    assert gf.Strategy(compile="inductor", cuda_graphs=True).cuda_graphs is True


def test_cuda_graphs_refuses_a_model_on_the_cpu():
    model, opt = _tiny()
    with pytest.raises(
        gf.UnsupportedError, match=r"parameter 0\.weight is on cpu; move the model to the GPU .*cuda_graphs=False"
    ):
        gf.compile(model, opt, _mse, BATCH, strategy=GRAPHED)


def test_a_program_file_keeps_cuda_graphs_and_from_program_refuses_a_model_on_the_cpu(tmp_path):
    model, opt = _tiny()
    program = gf.compile(model, opt, _mse, BATCH).program
    program = program.with_(strategy=dataclasses.replace(program.strategy, compile="inductor", cuda_graphs=True))
    gf.save_program(program, tmp_path / "program")
    loaded = gf.load_program(tmp_path / "program")
    assert loaded.strategy.cuda_graphs is True
    fresh, fresh_opt = _tiny()
    with pytest.raises(gf.UnsupportedError, match=r"parameter 0\.weight is on cpu"):
        gf.DistModel.from_program(loaded, fresh, fresh_opt)


def test_shard_optimizer_refuses_cuda_graphs():
    model, opt = _tiny()
    with pytest.raises(gf.UnsupportedError, match=r"gf\.shard_optimizer: Strategy\.cuda_graphs .*use gf\.compile"):
        gf.shard_optimizer(opt, GRAPHED, model=model)


def _compile_on_gloo(rank: int, world: int) -> str:
    model, opt = _tiny()
    try:
        gf.compile(model, opt, _mse, BATCH, strategy=GRAPHED)
    except gf.UnsupportedError as e:
        return str(e)
    return "gf.compile accepted cuda_graphs on a Gloo group"


def test_cuda_graphs_refuses_a_gloo_group_of_two_ranks():
    for message in run_ranks(_compile_on_gloo, 2):
        assert "'gloo'" in message and "world size 2" in message and "use an NCCL process group" in message, message


# ---- the replay logic on any machine, with a recording stand-in for torch.cuda's graphs ---
class _Recorder:
    """Stands in for torch.cuda.CUDAGraph: what the step runs while "capturing" is recorded, not
    run; replay runs it again on the same tensors, reading them as they are then, as a graph
    reads device memory. Checks graphfuse's bookkeeping, not CUDA (the GPU tests below do)."""

    capturing = None
    fail = False

    def __init__(self) -> None:
        self.recorded, self.replays = None, 0

    def replay(self) -> None:
        fn, args, outs = self.recorded
        for out, new in zip(outs, fn(*args)):
            out.copy_(new)
        self.replays += 1


@contextlib.contextmanager
def _capture(graph, pool=None, stream=None, capture_error_mode="global"):
    _Recorder.capturing = graph
    try:
        yield
    finally:
        _Recorder.capturing = None


def _recording(compiled):
    def run(*args):
        graph = _Recorder.capturing
        if graph is None:
            return compiled(*args)
        if _Recorder.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph.recorded = (compiled, args, [torch.zeros(())])  # the loss, written at each replay
        return graph.recorded[2]

    return run


@pytest.fixture
def recording_cuda(monkeypatch):
    from graphfuse.compiler import cuda_graph

    class Stream:
        def __init__(self, *args) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    for name, value in [
        ("Stream", Stream),
        ("current_stream", lambda device=None: Stream()),
        ("graph", _capture),
        ("stream", lambda s: contextlib.nullcontext()),
        ("graph_pool_handle", lambda: None),
        ("CUDAGraph", _Recorder),
    ]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(
        cuda_graph, "start", lambda s, *_: cuda_graph.CudaGraphs(torch.device("cpu")) if s.cuda_graphs else None
    )
    wrap = cuda_graph.CudaGraphs.wrap
    monkeypatch.setattr(
        cuda_graph.CudaGraphs, "wrap", lambda self, compiled, program: wrap(self, _recording(compiled), program)
    )
    monkeypatch.setattr(_Recorder, "fail", False)


def _tiny_run(cuda_graphs: bool, batches):
    model, opt = _tiny()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dm = gf.compile(model, opt, _mse, batches[0], strategy=gf.Strategy(compile="inductor", cuda_graphs=cuda_graphs))
    return dm, _train(dm, sched, batches)


def test_one_update_per_call_warm_up_then_capture_then_replay(recording_cuda):
    g = torch.Generator().manual_seed(1)
    big = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    small = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(3)]
    batches = big + small + big  # two batch keys
    ref, ref_losses = _tiny_run(False, batches)
    dm, losses = _tiny_run(True, batches)
    steps = [fn for _, fn in dm._programs.values()]
    # 8 big steps: 1 warm-up, 7 replays (the first right after capture); 3 small: 1 + 2
    assert sorted(fn.graph.replays for fn in steps) == [2, 7] and dm.cuda_graphs.captured == 2
    assert dm.steps == ref.steps == [len(batches)]
    assert torch.equal(losses, ref_losses)
    _assert_bitwise(_state(dm), _state(ref), "recorded replays against the compiled step")


def test_a_failed_capture_changes_nothing_and_a_moved_tensor_is_refused(recording_cuda):
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(3)]
    dm, _ = _tiny_run(True, batches[:1])
    before, steps = _state(dm), list(dm.steps)
    _Recorder.fail = True
    with pytest.raises(
        gf.UnsupportedError, match=r"capturing the step in a CUDA graph failed .*this call updated nothing"
    ):
        dm(batches[1])
    _assert_bitwise(_state(dm), before, "after a failed capture")
    assert dm.steps == steps
    _Recorder.fail = False
    dm(batches[1])  # captured now
    name = next(n for n in dm.tensors if n.endswith(".exp_avg"))
    dm.tensors[name] = dm.tensors[name].clone()
    with pytest.raises(gf.GraphfuseError, match=rf"reads {re.escape(name)} where it was at capture"):
        dm(batches[2])


# ---- replays (one GPU) --------------------------------------------------------------------
@pytest.fixture
def deterministic():
    """Settings under which two runs of one compiled step agree to the bit, so that comparing
    with the un-captured step measures the capture alone: no TF32, inductor's deterministic
    reduction configs where this torch has them, and batches of distinct tokens (_batches).
    Not torch.use_deterministic_algorithms: it changes the kernels under test (inductor then
    runs the embedding's backward as aten's index_put_, which some torch versions range-check
    with a read back to the host that no CUDA graph can capture), and distinct tokens already
    make the default scatter-add exact."""
    import torch._inductor.config as inductor_config

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with inductor_config.patch({"deterministic": True} if hasattr(inductor_config, "deterministic") else {}):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _batches(n: int, batch_size: int = 4, seed: int = 3):
    """Batches whose tokens are all distinct: each row of the embedding's gradient gets at most
    one contribution, so inductor's scatter-add (float atomics) is exact in any order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randperm(CFG.vocab_size, generator=g)[: batch_size * CFG.block_size].view(
            batch_size, CFG.block_size
        )
        targets = torch.randint(0, CFG.vocab_size, (batch_size, CFG.block_size), generator=g)
        out.append((tokens.cuda(), targets.cuda()))
    return out


def _dm(cuda_graphs: bool, example, seed: int = 0, lr_lambda=lambda s: 1.0 / (1 + s)):
    torch.manual_seed(seed)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)  # a new lr at every step
    strategy = gf.Strategy(compile="inductor", cuda_graphs=cuda_graphs)
    return gf.compile(model, opt, gpt_loss, example, strategy=strategy), sched


def _train(dm, sched, batches) -> torch.Tensor:
    losses = []
    for b in batches:
        losses.append(dm(b))
        sched.step()
    return torch.stack(losses)


def _state(dm) -> dict[str, torch.Tensor]:
    """Every bucket, shard and host scalar, on the CPU."""
    return {n: t.detach().cpu() for n, t in dm.tensors.items()}


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, f"{what}: {different} differ"


def _reference(batches):
    """The un-captured compiled run, done twice: if two runs differ, no bitwise comparison
    with the graph could mean anything on this machine."""
    runs = []
    for _ in range(2):
        dm, sched = _dm(False, batches[0])
        runs.append((_train(dm, sched, batches), _state(dm)))
    (losses, state), (losses_again, state_again) = runs
    assert torch.equal(losses, losses_again), "the un-captured compiled step is not reproducible here"
    _assert_bitwise(state_again, state, "two un-captured runs")
    return losses, state


@needs_cuda
def test_replayed_steps_equal_the_uncaptured_steps_bitwise_under_a_changing_lr(deterministic):
    batches = _batches(STEPS)
    want_losses, want = _reference(batches)
    dm, sched = _dm(True, batches[0])
    losses = _train(dm, sched, batches)
    assert dm.cuda_graphs.captured == 1  # step 1 ran un-captured, step 2 captured, 3..10 replayed
    assert all(dm.tensors[s.name].is_cuda for s in dm.program.signature.inputs if s.role == sig.SCALAR)
    assert dm.steps == [STEPS]
    assert torch.equal(losses, want_losses)
    _assert_bitwise(_state(dm), want, "cuda_graphs=True against cuda_graphs=False")


@needs_cuda
def test_a_replayed_step_reads_the_learning_rate_of_its_own_step():
    """lr alternates 1e-3, 0, 1e-3, 0...: a step at lr 0 leaves AdamW's weights unchanged to the
    bit (decay factor 1, step size -0), so a graph that kept the lr of its capture would show."""
    batches = _batches(8)
    dm, sched = _dm(True, batches[0], lr_lambda=lambda s: 0.0 if s % 2 else 1.0)
    for i, b in enumerate(batches):
        before = {n: p.detach().clone() for n, p in dm.model.named_parameters()}
        dm(b)
        sched.step()
        same = [torch.equal(p, before[n]) for n, p in dm.model.named_parameters()]
        assert all(same) if i % 2 else not any(same), f"step {i + 1} at lr {'0' if i % 2 else '1e-3'}"
    assert dm.cuda_graphs.captured == 1


@needs_cuda
def test_a_load_mid_run_keeps_the_graph_valid_and_the_steps_bitwise(deterministic, tmp_path):
    batches = _batches(STEPS)
    dm, sched = _dm(True, batches[0])
    losses = []
    for i, b in enumerate(batches):
        losses.append(dm(b))
        sched.step()
        if i == 4:
            gf.save(dm, tmp_path / "ckpt", extra={"scheduler": sched.state_dict()})
    fresh, fresh_sched = _dm(True, batches[0], seed=1)
    _train(fresh, fresh_sched, batches[:3])  # other weights; its graph is captured by now
    assert fresh.cuda_graphs.captured == 1
    addresses = {n: t.data_ptr() for n, t in fresh.tensors.items()}
    fresh_sched.load_state_dict(gf.load(fresh, tmp_path / "ckpt")["scheduler"])
    assert {n: t.data_ptr() for n, t in fresh.tensors.items()} == addresses  # copied in place
    assert torch.equal(_train(fresh, fresh_sched, batches[5:]), torch.stack(losses[5:]))
    assert fresh.cuda_graphs.captured == 1  # the same graph replayed after the load
    _assert_bitwise(_state(fresh), _state(dm), "loaded at step 5 and run to 10, against run straight through")


@needs_cuda
def test_a_second_batch_shape_gets_its_own_graph(deterministic):
    big, small = _batches(4), _batches(4, batch_size=2, seed=5)
    batches = [b for pair in zip(big, small) for b in pair]
    want_losses, want = _reference(batches)
    dm, sched = _dm(True, batches[0])
    losses = _train(dm, sched, batches)
    steps = [fn for _, fn in dm._programs.values()]
    assert len(steps) == 2 and all(isinstance(fn, GraphedStep) and fn.graph is not None for fn in steps)
    assert steps[0].graph is not steps[1].graph and dm.cuda_graphs.captured == 2
    assert torch.equal(losses, want_losses)
    _assert_bitwise(_state(dm), want, "two batch shapes, cuda_graphs=True against False")


@needs_cuda
def test_a_tensor_replaced_after_capture_is_refused():
    batches = _batches(3)
    dm, _ = _dm(True, batches[0])
    dm(batches[0])
    dm(batches[1])  # captured
    name = next(n for n in dm.tensors if n.endswith(".exp_avg"))
    dm.tensors[name] = dm.tensors[name].clone()
    with pytest.raises(gf.GraphfuseError, match=rf"reads {re.escape(name)} where it was at capture.*copy in place"):
        dm(batches[2])
