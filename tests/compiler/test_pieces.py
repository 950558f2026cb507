"""graphfuse/compiler/pieces.py: the graph a step is cut into (Strategy.compile_workers). The pieces are
checked as graphs (where each input comes from, where every collective, wait, cat and copy
lands) and run eagerly, bitwise against the program run whole."""

from __future__ import annotations

import pytest
import torch

import graphfuse as gf
from graphfuse.compiler import pieces as P
from graphfuse.compiler.in_place import in_place_graph
from graphfuse.passes import run_pipeline
from graphfuse.passes.graph import is_collective, issues_collective
from graphfuse.runtime.batches import flatten_batch
from graphfuse.runtime.execute import run_step
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
COPY, CAT = torch.ops.aten.copy_.default, torch.ops.aten.cat.default


def _model_opt():
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _program(world: int = 1, **strategy) -> gf.Program:
    model, opt = _model_opt()
    batch = synthetic_tokens(CFG, 2, 1, seed=0)[0]
    program = gf.capture(model, opt, gpt_loss, batch, gf.Strategy(**strategy))
    return run_pipeline(program.with_(world_size=world, rank=1 if world > 1 else 0, group_name="g"))


def _root(n: torch.fx.Node) -> torch.fx.Node:
    while n.op != "placeholder" and P.is_view(n):
        n = n.args[0]
    return n


@pytest.mark.parametrize("k", [2, 3, 5])
def test_every_piece_reads_inputs_and_earlier_values_never_a_view_of_an_input(k):
    gm = in_place_graph(_program(bucket_size_mb=0.002))
    pieces = P.split(gm, k)
    assert len(pieces) == k
    produced: set = set()
    for piece in pieces:
        phs = [n for n in piece.gm.graph.nodes if n.op == "placeholder"]
        assert [n.name for n in phs] == [a.name for a in piece.inputs]
        first_compute = next(i for i, n in enumerate(piece.gm.graph.nodes) if n.op != "placeholder")
        assert first_compute == len(phs)  # placeholders first
        for a in piece.inputs:
            assert a.op == "placeholder" or (a in produced and _root(a).op != "placeholder"), a
        produced.update(piece.outputs)
        piece.gm.graph.lint()


def test_no_piece_reads_an_input_after_an_earlier_piece_wrote_it():
    gm = in_place_graph(_program(bucket_size_mb=0.002))
    pieces = P.split(gm, 4)
    written: dict[str, int] = {}
    for p, piece in enumerate(pieces):
        for n in piece.gm.graph.nodes:
            if n.target is COPY:
                written[_root(n.args[0]).name] = p
    assert len(written) == sum(1 for n in gm.graph.nodes if n.target is COPY)
    for p, piece in enumerate(pieces):
        for a in piece.inputs:
            if a.op == "placeholder" and a.name in written:
                assert written[a.name] >= p, f"{a.name} written in piece {written[a.name]}, read in piece {p}"


def test_each_collective_is_waited_for_in_the_piece_that_issues_it():
    gm = in_place_graph(_program(world=2, bucket_size_mb=0.002))
    for piece in P.split(gm, 4):
        issued = [n for n in piece.gm.graph.nodes if issues_collective(n)]
        waits = [n for n in piece.gm.graph.nodes if is_collective(n) and not issues_collective(n)]
        assert len(issued) == len(waits)
        for n in issued:
            assert any(u in waits for u in n.users), n
    total = sum(1 for n in gm.graph.nodes if issues_collective(n))
    assert total > 4  # the step has collectives to place


def test_a_bucket_cut_across_pieces_is_packed_in_part_where_its_gradients_are():
    program = _program(bucket_size_mb=256.0)  # one bucket: its gradients span the backward
    gm = in_place_graph(program)
    pieces = P.split(gm, 4)
    cats = [(p, n) for p, piece in enumerate(pieces) for n in piece.gm.graph.nodes if n.target is CAT]
    # The bucket's own cat: the largest that its piece uses itself (a part is handed on).
    p, cat = max(((p, n) for p, n in cats if all(u.op != "output" for u in n.users)), key=lambda pc: len(pc[1].args[0]))
    from_outside = [
        a
        for a in cat.args[0]
        if _root(a).op == "placeholder" and _root(a).name not in {s.name for s in program.signature.inputs}
    ]
    computed_before = [a for a in cat.args[0] if a.op == "placeholder" or _root(a).op == "placeholder"]
    outside = [a for a in from_outside if a.name.startswith("cat")]
    # The bucket's cat (gradients and their padding) is in one of the last two pieces (just
    # after the last gradient; a cut may fall before or after it). The earlier pieces hand it
    # their gradients packed in parts (a few gradients come alone, where the bucket's order is
    # not the order the backward computes them in).
    assert p >= 2 and len(outside) >= 2 and len(from_outside) <= 4 and len(computed_before) == len(from_outside)
    parts = [n for q, n in cats if q < p and any(u.op == "output" for u in n.users)]
    assert len(parts) >= len(outside) and all(len(n.args[0]) >= 2 for n in parts)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_pieces_run_eagerly_give_the_program_bitwise(k):
    model_a, opt_a = _model_opt()
    model_b, opt_b = _model_opt()
    batches = synthetic_tokens(CFG, 2, 3, seed=1)
    strategy = gf.Strategy(bucket_size_mb=0.002)
    dm_a = gf.compile(model_a, opt_a, gpt_loss, batches[0], strategy)
    dm_b = gf.compile(model_b, opt_b, gpt_loss, batches[0], strategy)
    gm = in_place_graph(dm_a.program)
    pieces = P.split(gm, k)
    runner = P.PieceRunner(gm, pieces, [p.gm for p in pieces])
    for step, batch in enumerate(batches, 1):
        leaves = flatten_batch(batch)[1]
        loss_a = run_step(dm_a.program, runner, dm_a.tensors, opt_a.param_groups, [step], [{}], leaves)[0]
        loss_b = run_step(
            dm_b.program, dm_b.program.graph_module, dm_b.tensors, opt_b.param_groups, [step], [{}], leaves
        )[0]
        assert torch.equal(loss_a, loss_b)
    for name, t in dm_a.tensors.items():
        assert torch.equal(t, dm_b.tensors[name]), name


def test_the_same_program_loaded_from_a_file_is_cut_into_the_same_pieces(tmp_path):
    program = _program(bucket_size_mb=0.002)
    gf.save_program(program, tmp_path / "p")
    loaded = gf.load_program(tmp_path / "p")
    a, b = P.split(in_place_graph(program), 3), P.split(in_place_graph(loaded), 3)
    assert [p.gm.code for p in a] == [p.gm.code for p in b]


def test_a_step_too_small_to_cut_is_one_piece():
    gm = in_place_graph(_program())
    assert len(P.split(gm, 1)) == 1
    assert P.cuts(list(gm.graph.nodes)[:3], 4) == []


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_pieces_hold_even_shares_of_the_work(k):
    # A piece's compile time grows with its ops; the slowest piece is the compile's critical
    # path. A cut may move off an even share by WINDOW of one piece's work (to cross fewer
    # values), so no piece is more than twice that (plus one op) off its share.
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    program = run_pipeline(gf.capture(model, opt, gpt_loss, synthetic_tokens(cfg, 2, 1, seed=0)[0], gf.Strategy()))
    gm = in_place_graph(program)
    body = P.order(gm.graph, P.free_nodes(gm.graph))
    work = [0 if P.is_view(x) else 1 for x in body]
    bounds = [0, *(c + 1 for c in P.cuts(body, k)), len(body)]
    shares = [sum(work[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert len(shares) == k
    even = sum(work) / k
    assert all(abs(s - even) <= 2 * P.WINDOW * even + 1 for s in shares), (shares, even)
