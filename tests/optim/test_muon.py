"""torch.optim.Muon under graphfuse: each weight matrix lies whole in one rank's shard
(graphfuse.ir.ownership) and its owner runs Muon's update on it. Bitwise against
torch.optim.Muon at 1 rank; the graph each rank runs at 2 and 3 ranks. Against an eager
data-parallel run at 2 and 3 Gloo ranks (with AdamW beside it): tests/checkpoint/test_matrix_resume.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse import passes
from graphfuse.capture.tracing import reads_whole
from graphfuse.errors import GraphfuseError, UnsupportedError
from graphfuse.ir.layout import ParamInfo, plan_buckets
from graphfuse.passes import sharded_update
from graphfuse.passes.sharded_update import whole_update_function
from graphfuse.program_files.ops import admitted
from tests.optim.lockstep import (
    assert_bitwise_lockstep,
    assert_same_torch_state,
    loss_fn,
    regression_batches,
    transformer_pair,
)

STEPS = 4
MATRIX_OPTIMIZERS = ("Muon",)  # the torch.optim classes whose update reads whole matrices, tested here


class Matrices(nn.Module):
    """Three bias-free layers: every parameter a matrix, wide, tall and square."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)
        self.c = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batches(steps: int, seed: int = 0) -> list:
    return regression_batches(steps, 4, seed)


MUONS = {
    "default": lambda m: torch.optim.Muon(m.parameters(), lr=0.02),
    "plain_momentum_rms_adamw": lambda m: torch.optim.Muon(
        m.parameters(), lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"
    ),
    "two_groups": lambda m: torch.optim.Muon(
        [
            {"params": [m.a.weight, m.c.weight], "ns_steps": 3, "ns_coefficients": (3.0, -3.2, 1.2)},
            {"params": [m.b.weight], "weight_decay": 0.0, "adjust_lr_fn": "original"},
        ],
        lr=0.02,
    ),
}


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8**s)


@pytest.mark.parametrize("name", MUONS)
def test_muon_is_bitwise_equal_to_torch_optim_muon(name):
    torch.manual_seed(0)
    m_ref = Matrices()
    m_gf = copy.deepcopy(m_ref)
    o_ref = MUONS[name](m_ref)
    s_ref = _schedule(o_ref)
    o_gf = MUONS[name](m_gf)
    dm = gf.compile(m_gf, o_gf, loss_fn, batches(1)[0])
    assert_bitwise_lockstep(m_ref, [o_ref], m_gf, dm, loss_fn, batches(STEPS), [s_ref, _schedule(o_gf)])
    assert reads_whole(dm.program.optim.groups[0]) and dm.steps == [STEPS] * len(o_gf.param_groups)


def _program(world: int, rank: int) -> gf.Program:
    torch.manual_seed(0)
    model = Matrices()
    program = gf.capture(model, MUONS["default"](model), loss_fn, batches(1)[0], gf.Strategy(align_bytes=16))
    program = program.with_(world_size=world, rank=rank, group_name="g")
    for p in passes.PIPELINE[: passes.PIPELINE.index(sharded_update) + 1]:
        program = passes.run_pass(program, p, check=True)
    return program


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_orthogonalises_only_the_matrices_it_owns_and_each_bucket_keeps_one_collective(world):
    """The graph: per rank, one Newton-Schulz (5 steps: 2 addmm and one mm each) per matrix it
    owns, read from whole-matrix views of its shard; one reduce-scatter per bucket."""
    owned = []
    for rank in range(world):
        program = _program(world, rank)
        counts = passes.count_targets(program)
        buckets = program.layout.buckets
        mine = [s.fqn for b in buckets for s in b.slices(rank)]
        assert all(b.owner(f) == rank for b in buckets for f in mine if f in b.fqns)
        assert counts.get("aten.addmm", 0) == 2 * 5 * len(mine)
        assert counts.get("aten.mm", 0) - _backward_mms(program) == 5 * len(mine)
        assert counts["_c10d_functional.reduce_scatter_tensor"] == len(buckets)
        owned += mine
    assert sorted(owned) == ["a.weight", "b.weight", "c.weight"]  # each matrix on exactly one rank


def _backward_mms(program: gf.Program) -> int:
    return sum(
        1
        for n in program.graph.nodes
        if n.op == "call_function"
        and n.meta.get("phase") != "optimizer"
        and str(getattr(n.target, "_overloadpacket", "")) == "aten.mm"
    )


def test_a_whole_matrix_update_refuses_a_shard_that_holds_part_of_a_parameter():
    """The sharded update never runs Muon on a slice: a layout planned elementwise (the 16x16
    matrix across two shards) is refused, naming the parameter and the elements the rank holds."""
    program = _program(1, 0)
    spec = program.optim.groups[0]
    params = [ParamInfo("b.weight", (16, 16), "float32", "cpu", 0)]
    split = plan_buckets(params, 2, 16, 1 << 20).buckets[0]
    with pytest.raises(GraphfuseError, match=r"rank 1's shard holds elements \[128, 256\) of b.weight \(of 256\)"):
        whole_update_function(spec, split, 1)
    whole = plan_buckets(params, 2, 16, 1 << 20, whole={"b.weight": 1}).buckets[0]
    assert [s.numel for s in whole.slices(0)] == [256] and whole.slices(1) == ()
    whole_update_function(spec, whole, 1)


def test_whole_or_elementwise_is_decided_from_the_traced_update():
    """Of torch's optimizers Muon's and Adafactor's updates read a parameter whole; an update of one's own
    that normalises rows (a shape-keeping softmax, or a division by a row norm) is seen as whole
    too, so it gets a whole-matrix layout rather than a silent slice."""
    from graphfuse.optim import RULES, GroupSpec, Rule

    every = {kind: reads_whole(GroupSpec(kind=kind, params=(), momentum=0.9, ns_steps=1, d=1.0)) for kind in RULES}
    assert every == {kind: kind in ("muon", "adafactor") for kind in RULES}
    own = {
        "own_softmax": lambda spec, p, g, states, scalars: (torch.sub(p, torch.softmax(g, dim=-1)), {}),
        "own_rownorm": lambda spec, p, g, states, scalars: (torch.sub(p, g / g.norm(dim=-1, keepdim=True)), {}),
        "own_sign": lambda spec, p, g, states, scalars: (torch.sub(p, torch.sign(g)), {}),
    }
    try:
        for kind, fn in own.items():
            RULES[kind] = Rule(kind, (), lambda s: (), lambda s: (), lambda s, lr, wd, step, c: {}, fn)
        assert {k: reads_whole(GroupSpec(kind=k, params=())) for k in own} == {
            "own_softmax": True,
            "own_rownorm": True,
            "own_sign": False,
        }
    finally:
        for kind in own:
            RULES.pop(kind, None)


def test_the_cost_owners_balance_is_counted_from_the_traced_update():
    """tracing.whole_cost runs the update on fake tensors: its matrix products' FLOPs plus one per
    element. Muon: per Newton-Schulz step 4m²n + 2m³ (m <= n, either orientation), so ns_steps
    changes it; Adafactor: the outer product of its factors, 2mn; an update of one's own is counted
    from its own ops, with nothing looked up by kind."""
    from graphfuse.capture.tracing import whole_cost
    from graphfuse.optim import RULES, GroupSpec, Rule

    def muon(steps):
        return GroupSpec(kind="muon", params=(), momentum=0.95, nesterov=True, ns_steps=steps, eps=1e-7)

    ns = 4 * 3 * 3 * 5 + 2 * 3**3
    assert whole_cost(muon(5), (3, 5)) == whole_cost(muon(5), (5, 3)) == 5 * ns + 15
    assert whole_cost(muon(2), (3, 5)) == 2 * ns + 15
    assert whole_cost(GroupSpec(kind="adafactor", params=(), d=1.0), (4, 6)) == 2 * 24 + 24
    RULES["own_cube"] = Rule(
        "own_cube",
        (),
        lambda s: (),
        lambda s: (),
        lambda s, lr, wd, step, c: {},
        lambda spec, p, g, st, sc: (p - g @ g.mT @ g, {}),
    )
    try:
        assert whole_cost(GroupSpec(kind="own_cube", params=()), (2, 7)) == 2 * 2 * 7 * 2 + 2 * 2 * 2 * 7 + 14
    finally:
        RULES.pop("own_cube")


def test_inspect_reports_each_ranks_owned_matrices_cost_and_padding():
    from rich.console import Console

    from graphfuse.cli.facts import ownership_facts
    from graphfuse.cli.inspect import ownership_table

    program = _program(2, 0)
    facts = ownership_facts(program)
    # Cost: 5 Newton-Schulz steps of 4m²n + 2m³ FLOPs (m <= n) plus the elements. b (16x16) alone
    # on rank 0; c (4x16) and a (16x8) on rank 1, in gradient order.
    ns = {"b": 5 * (4 * 16 * 16 * 16 + 2 * 16**3) + 256, "c": 5 * (4 * 4 * 4 * 16 + 2 * 4**3) + 64}
    ns["a"] = 5 * (4 * 8 * 8 * 16 + 2 * 8**3) + 128
    assert [(o["rank"], o["params"], o["cost"]) for o in facts] == [
        (0, ["b.weight"], ns["b"]),
        (1, ["c.weight", "a.weight"], ns["c"] + ns["a"]),
    ]
    bucket = program.layout.buckets[0]
    assert bucket.shard_size == 256 and [o["padding"] for o in facts] == [0, 256 - 128 - 64]
    console = Console(record=True, width=200)
    console.print(ownership_table({"ownership": facts}))
    text = console.export_text()
    assert "c.weight, a.weight" in text and f"{ns['c'] + ns['a']:,}" in text


class EmbeddingAndMatrices(nn.Module):
    """A 1024x512 embedding (2 MiB in float32) and two small matrices: under Muon at 4 ranks the
    embedding is larger than a fair share of its bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 512)
        self.a = nn.Linear(512, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.embed(x))))


@pytest.mark.parametrize("embedding_under", ["Muon", "AdamW"])
def test_a_bucket_laid_out_whole_that_pads_past_a_fifth_is_reported_with_the_way_out(embedding_under, caplog):
    """Never a silent memory cost: the plan_buckets pass warns (once per bucket) when a bucket laid
    out whole is mostly padding, names the parameter past the fair share and the ways out; with
    the embedding under AdamW (as torch's Muon documentation splits them) it stays quiet."""
    from graphfuse.passes import plan_buckets as plan_pass

    torch.manual_seed(0)
    model = EmbeddingAndMatrices()
    matrices = [model.a.weight, model.b.weight]
    if embedding_under == "Muon":
        optimizers = [torch.optim.Muon([model.embed.weight, *matrices], lr=0.02)]
    else:
        optimizers = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW([model.embed.weight], lr=1e-3)]
    batch = (torch.randint(0, 1024, (4, 3)), torch.randn(4, 3, 16))
    program = gf.capture(model, optimizers, loss_fn, batch, gf.Strategy())
    with caplog.at_level("WARNING", logger="graphfuse"):
        for rank in (3, 2, 1, 0):  # the same layout on every rank: rank 0 alone says it
            planned = passes.run_pass(program.with_(world_size=4, rank=rank, group_name="g"), plan_pass, check=True)
    program = planned
    warned = [r.getMessage() for r in caplog.records if r.name == "graphfuse" and "updated whole" in r.getMessage()]
    whole_bucket = next(b for b in program.layout.buckets if "a.weight" in b.fqns)
    if embedding_under == "AdamW":
        assert warned == [] and whole_bucket.size == whole_bucket.shard_size * 4
        return
    assert whole_bucket.size == 4 * 1024 * 512  # every shard as long as the embedding
    data = 1024 * 512 + 512 * 16 + 16 * 16
    (message,) = warned
    assert f"{whole_bucket.size / data:.2f}x its parameters' elements at 4 ranks" in message
    assert "embed.weight (524,288 elements) is larger than a fair share" in message
    assert "put embed.weight under an elementwise optimizer" in message and "train on fewer ranks" in message


def test_uneven_ownership_is_reported_and_a_small_or_even_bucket_is_not():
    from graphfuse.passes.plan_buckets import WARN_PADDING_BYTES, whole_padding_warnings

    def warnings_for(n: int, side: int, world: int, cap: int = 1 << 30) -> list[str]:
        params = [ParamInfo(f"w{i}", (side, side), "float32", "cpu", 0) for i in range(n)]
        whole = {p.fqn: 1 for p in params}
        return whole_padding_warnings(plan_buckets(params, world, 16, cap, whole=whole), set(whole))

    side = 1024  # 4 MiB a matrix
    (message,) = warnings_for(4, side, 3)  # 2, 1, 1: every shard two matrices long, a third padding
    assert "is 1.50x its parameters' elements at 3 ranks" in message and "do not divide evenly" in message
    assert "bucket_size_mb" not in message  # one bucket holds the group: a larger cap changes nothing
    assert warnings_for(6, side, 3) == []  # two matrices a rank: no padding
    assert 4 * 64 * 64 * 4 < WARN_PADDING_BYTES and warnings_for(4, 64, 3) == []  # a third, but under 1 MiB
    # Split by the cap into buckets of one matrix each: raising it is one of the ways out.
    split = warnings_for(4, side, 2, cap=side * side * 4)
    assert len(split) == 4 and all("raise Strategy.bucket_size_mb (now 4)" in m for m in split)


def hidden_and_rest(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the hidden matrices, AdamW for embeddings, head, norms and biases (as torch's
    Muon documentation splits them)."""
    hidden = [
        p
        for n, p in model.named_parameters()
        if p.ndim == 2 and not any(k in n for k in ("embed", "wte", "wpe", "head"))
    ]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1, foreach=False)]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_muon_and_adamw_on_a_transformer_are_bitwise_equal_to_torch(name):
    m_ref, m_gf, loss_of, data = transformer_pair(name)
    o_ref, o_gf = hidden_and_rest(m_ref), hidden_and_rest(m_gf)
    dm = gf.compile(m_gf, o_gf, loss_of, data[0])
    assert dm.program.optim.cls_name == "Muon+AdamW" and len(o_gf[0].param_groups[0]["params"]) >= 8
    assert_bitwise_lockstep(m_ref, o_ref, m_gf, dm, loss_of, data)
    # Each of the user's optimizers speaks for its own state and refuses a step of its own.
    for o, ref in zip(o_gf, o_ref):
        assert_same_torch_state(o.state_dict(), ref.state_dict())
        with pytest.raises(UnsupportedError, match="step"):
            o.step()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_same_shape_matrices_run_newton_schulz_batched_on_views_of_the_shard(world):
    """What CUDA runs (whole_update_function(batched=True)): on three 8x12 matrices and two
    12x8 ones, each rank's same-shape matrices lie next to each other (plan_buckets), so a stack
    is a (k, m, n) view of the shard: no aten.stack, 3 bmm per Newton-Schulz step and stack and
    no biased product. The momentum buffer is elementwise and bitwise equal to one matrix at a
    time; the weights agree to bfloat16's rounding (other products:
    test_batched_newton_schulz_is_as_accurate_as_torchs); the padding passes through untouched."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = _program(1, 0).optim.groups[0]
    shapes = {"w0": (8, 12), "t0": (12, 8), "w1": (8, 12), "t1": (12, 8), "w2": (8, 12)}
    params = [ParamInfo(f, s, "float32", "cpu", 0) for f, s in shapes.items()]
    bucket = plan_buckets(params, world, 16 * 4, 1 << 20, whole=dict.fromkeys(shapes, 1)).buckets[0]
    g = torch.Generator().manual_seed(world)
    scalars = (torch.tensor(0.02, dtype=torch.float64), torch.tensor(1 - 0.02 * 0.1, dtype=torch.float64))
    for rank in range(world):
        p, grad, buf = (torch.randn(bucket.shard_size, generator=g) for _ in range(3))
        one = whole_update_function(spec, bucket, rank)(p, grad, buf, *scalars)
        batched = whole_update_function(spec, bucket, rank, batched=True)
        together = batched(p, grad, buf, *scalars)
        assert torch.equal(one[1], together[1])
        assert torch.allclose(one[0], together[0], atol=0.02 * 1.5**0.5 * 0.05, rtol=0)
        members = torch.zeros(bucket.shard_size, dtype=torch.bool)
        for s in bucket.slices(rank):
            members[s.shard_start : s.shard_end] = True
        assert torch.equal(together[0][~members], p[~members]) and torch.equal(together[1][~members], buf[~members])
        assert not torch.equal(together[0][members], p[members])
        mine = [bucket.slot(s.fqn).shape for s in bucket.slices(rank)]
        stacks = len({shape for shape in mine})  # each shape's members lie next to each other: one stack each
        # Traced as CUDA would run it, the shards on a device and the host scalars on the CPU (here
        # "meta" stands for the device): nothing mixes the two, and nothing is made by a factory,
        # whose device would be fixed at trace time.
        gm = make_fx(batched)(*(t.to("meta") for t in (p, grad, buf)), *scalars)
        counts = _counts(gm)
        assert not [n for n in gm.graph.nodes if "device" in n.kwargs]
        assert all(admitted(n.target) for n in gm.graph.nodes if n.op == "call_function")  # its program saves
        assert counts.get("aten.bmm", 0) == 3 * 5 * stacks and counts.get("aten.baddbmm", 0) == 0
        assert counts.get("aten.stack", 0) == 0 and counts.get("aten.addmm", 0) == 0


def test_same_shape_matrices_with_padding_between_them_are_stacked_one_by_one():
    """A 3x5 matrix takes 15 elements and its slot 16 (alignment): two of them are not one view,
    so each is a stack of its own (still batched products, of one matrix each)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = _program(1, 0).optim.groups[0]
    params = [ParamInfo(f, (3, 5), "float32", "cpu", 0) for f in ("a", "b")]
    bucket = plan_buckets(params, 1, 16 * 4, 1 << 20, whole={"a": 1, "b": 1}).buckets[0]
    p, grad, buf = (torch.randn(bucket.shard_size) for _ in range(3))
    scalars = (torch.tensor(0.02, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    batched = whole_update_function(spec, bucket, 0, batched=True)
    counts = _counts(make_fx(batched)(p, grad, buf, *scalars))
    assert counts.get("aten.bmm", 0) == 3 * 5 * 2 and counts.get("aten.stack", 0) == 0
    one = whole_update_function(spec, bucket, 0)(p, grad, buf, *scalars)
    together = batched(p, grad, buf, *scalars)
    assert torch.equal(one[1], together[1]) and torch.allclose(one[0], together[0], atol=0.02 * 0.05, rtol=0)
    assert together[0][15] == p[15] and together[1][15] == buf[15]  # the padding after "a"


@pytest.mark.parametrize(
    ("shape", "rank"), [((8, 12), 8), ((12, 8), 8), ((64, 192), 64), ((192, 64), 64), ((128, 128), 128), ((16, 16), 4)]
)
def test_batched_newton_schulz_is_as_accurate_as_torchs(shape, rank):
    """CUDA's batched Newton-Schulz folds a·x into the product, x <- (a·I + b·G + c·G²)·x, so
    its bfloat16 roundings differ from torch's. Against the same iteration in float64, its
    relative error over 32 matrices is within 1.2x of torch's own one-matrix form (measured 0.96x
    to 1.12x). On a gradient of low rank (a 16x16 layer, 4 samples) both are far from float64
    (about 0.4): the iteration grows rounding noise outside the gradient's span, so there the
    two forms differ by as much as either differs from float64."""
    from graphfuse.optim.matrix import newton_schulz

    spec = _program(1, 0).optim.groups[0]
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(32, shape[0], rank, generator=g) @ torch.randn(32, rank, shape[1], generator=g)
    x = grads.double().mT if shape[0] > shape[1] else grads.double()
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    for _ in range(spec.ns_steps):
        gram = x @ x.mT
        x = spec.ns_a * x + (spec.ns_b * gram + spec.ns_c * gram @ gram) @ x
    exact = x.mT if shape[0] > shape[1] else x

    def error(y):
        return ((y.double() - exact).norm() / exact.norm()).item()

    torch_error = error(torch.stack([newton_schulz(g, spec) for g in grads]))
    assert 0 < error(newton_schulz(grads, spec)) <= 1.2 * torch_error


def _counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            name = str(getattr(n.target, "_overloadpacket", n.target))
            out[name] = out.get(name, 0) + 1
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_cuda_the_same_shape_matrices_a_rank_owns_run_newton_schulz_batched():
    """Three 16x16 layers on CUDA: one stacked Newton-Schulz (5 steps of 3 bmm, no biased
    product) instead of three; the weights agree with torch.optim.Muon's to bfloat16's rounding
    of Newton-Schulz (other products and roundings, as accurate as torch's against float64:
    test_batched_newton_schulz_is_as_accurate_as_torchs): per step, the root mean square of the
    weights' difference within 0.05·lr (an entry of a 16x16 update is about 0.25; one entry
    differed by 0.06 on an H100). The batches have 64 samples, so the gradients have full rank."""
    torch.manual_seed(0)
    m_ref = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh()) for _ in range(3))).cuda()
    m_gf = copy.deepcopy(m_ref)
    o_ref = torch.optim.Muon(m_ref.parameters(), lr=0.02)
    dm = gf.compile(
        m_gf,
        torch.optim.Muon(m_gf.parameters(), lr=0.02),
        lambda m, b: m(b).square().mean(),
        torch.randn(64, 16, device="cuda"),
    )
    counts = passes.count_targets(dm.program)
    assert counts.get("aten.bmm", 0) == 3 * 5 and counts.get("aten.baddbmm", 0) == counts.get("aten.addmm", 0) == 0
    for i in range(3):
        x = torch.randn(64, 16, device="cuda")
        o_ref.zero_grad()
        loss = m_ref(x).square().mean()
        loss.backward()
        o_ref.step()
        got = dm(x)  # the same weights at the first step; then within the tolerance below
        assert torch.equal(loss.detach(), got) if i == 0 else torch.allclose(loss.detach(), got, rtol=1e-2)
        for p, q in zip(m_ref.parameters(), m_gf.parameters()):
            rms = (p - q).square().mean().sqrt().item()
            assert rms <= (i + 1) * 0.02 * 0.05, rms
