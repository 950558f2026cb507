"""Fuse the output projection with the cross-entropy (Strategy.fuse_loss): the logits, their
log-softmax and their gradient are made a chunk of tokens at a time, so the full [tokens, vocab]
logits (and their fp32 copy) never exist; the head weight's gradient is summed over the chunks."""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta

from ._contract import expect
from .graph import aten, call, eliminate_dead_code, inline

log = logging.getLogger("graphfuse")

NAME = "fuse_loss"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
MEAN, SUM = 1, 2  # nll_loss's reduction codes


@dataclass(frozen=True)
class LossHead:
    """One output projection feeding a cross-entropy, as the captured step shows it."""

    hidden: torch.fx.Node  # [tokens, hidden] the head reads
    weight_t: torch.fx.Node  # t(weight) [hidden, vocab], the forward's right operand
    weight: torch.fx.Node  # the head weight [vocab, hidden]: a trainable parameter input, or autocast's copy of one
    target: torch.fx.Node  # [tokens] class indices
    cast: torch.dtype | None  # the logits' cast before the softmax, if any
    softmax_dtype: torch.dtype  # _log_softmax_backward_data's input_dtype
    reduction: int
    ignore_index: int
    loss: torch.fx.Node  # nll_loss_forward's loss and total weight (getitem 0 and 1)
    total_weight: torch.fx.Node
    grad_out: torch.fx.Node  # the loss's incoming gradient (nll_loss_backward's first argument)
    grad_hidden: torch.fx.Node  # mm(dlogits, weight)
    grad_weight: torch.fx.Node  # mm(t(dlogits), hidden), or mm(t(hidden), dlogits) when transposed
    transposed: bool
    nll_backward: torch.fx.Node

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, hidden size, vocabulary size)."""
        (n, c), v = self.hidden.meta["val"].shape, self.weight_t.meta["val"].shape[1]
        return n, c, v

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.meta["val"].dtype


def _shape(node) -> tuple[int, ...] | None:
    """The node's traced shape; None where capture recorded none."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _back(node, ops) -> torch.fx.Node:
    while isinstance(node, torch.fx.Node) and node.target in ops:
        node = node.args[0]
    return node


def _forward_chain(nll: torch.fx.Node):
    """(mm, cast) of the logits nll_loss_forward reads through _log_softmax, or None."""
    logsm, _, weight, reduction, _ = nll.args
    if weight is not None or reduction not in (MEAN, SUM) or logsm.target is not aten._log_softmax.default:
        return None
    x, dim, half_to_float = logsm.args
    if half_to_float or dim not in (1, -1) or len(_shape(logsm) or ()) != 2:
        return None
    x, cast = _back(x, VIEWS), None
    if x.target is aten._to_copy.default and set(x.kwargs) == {"dtype"}:
        x, cast = _back(x.args[0], VIEWS), x.kwargs["dtype"]
    if x.target is not aten.mm.default or _shape(x) != _shape(logsm) or _shape(x.args[0]) is None:
        return None
    wt = x.args[1]
    w = _back(wt.args[0], (aten._to_copy.default,)) if wt.target is aten.t.default else None  # autocast's copy
    if w is None or w.op != "placeholder" or w.meta["gf_input"].role != sig.PARAM or _shape(wt) is None:
        return None
    return x, cast


def _backward_mms(dlogits: torch.fx.Node, hidden: torch.fx.Node, weight_t: torch.fx.Node):
    """(grad_hidden, grad_weight, transposed) of the two matmuls that read the logits' gradient."""
    grad_hidden = grad_weight = transposed = None
    for u in dlogits.users:
        if u.target is aten.mm.default and u.args[0] is dlogits:
            w = u.args[1]
            if w is weight_t.args[0] or (w.target is aten.t.default and w.args[0] is weight_t):
                grad_hidden = u
        elif u.target is aten.mm.default and u.args[1] is dlogits:
            th = u.args[0]
            if th.target is aten.t.default and th.args[0] is hidden:
                grad_weight, transposed = u, True
        elif u.target is aten.t.default:
            for mm in u.users:
                if mm.target is aten.mm.default and mm.args == (u, hidden):
                    grad_weight, transposed = mm, False
    return grad_hidden, grad_weight, transposed


def _match(nll: torch.fx.Node) -> LossHead | None:
    chain = _forward_chain(nll)
    if chain is None:
        return None
    (mm, cast), logsm = chain, nll.args[0]
    hidden, weight_t = mm.args
    items = {u.args[1]: u for u in nll.users if u.target is operator.getitem}
    bwd = [u for u in logsm.users if u.target is aten.nll_loss_backward.default and u.args[1] is logsm]
    if (
        set(items) != {0, 1}
        or len(bwd) != 1
        or bwd[0].args[2:] != (nll.args[1], None, nll.args[3], nll.args[4], items[1])
    ):
        return None
    lsbd = [u for u in bwd[0].users if u.target is aten._log_softmax_backward_data.default]
    if len(bwd[0].users) != 1 or len(lsbd) != 1:
        return None
    dlogits = lsbd[0]
    while len(dlogits.users) == 1 and next(iter(dlogits.users)).target in (*VIEWS, aten._to_copy.default):
        dlogits = next(iter(dlogits.users))
    grad_hidden, grad_weight, transposed = _backward_mms(dlogits, hidden, weight_t)
    if grad_hidden is None or grad_weight is None or _shape(dlogits) != _shape(mm):
        return None
    head = LossHead(
        hidden,
        weight_t,
        weight_t.args[0],
        nll.args[1],
        cast,
        lsbd[0].args[3],
        nll.args[3],
        nll.args[4],
        items[0],
        items[1],
        bwd[0].args[0],
        grad_hidden,
        grad_weight,
        transposed,
        bwd[0],
    )
    return head if _private(mm, head) else None


def _private(logits: torch.fx.Node, head: LossHead) -> bool:
    """Nothing but the loss and the two gradients is computed from the logits: once those are
    replaced, every node between them is dead (a model that also returns its logits is left as it is)."""
    stops = {head.loss, head.total_weight, head.grad_hidden, head.grad_weight}
    inner, todo = set(), [logits]
    while todo:
        n = todo.pop()
        if n in inner or n in stops:
            continue
        if n.op == "output" or n.is_impure():
            return False
        inner.add(n)
        todo.extend(n.users)
    return True


def find_heads(program: Program) -> list[LossHead]:
    """Every output projection + cross-entropy of the step that the pass can fuse, in graph order
    (one per micro-batch with gradient accumulation)."""
    nodes = [n for n in program.graph.nodes if n.target is aten.nll_loss_forward.default]
    return [h for h in map(_match, nodes) if h is not None]


def chunk_tokens(program: Program, head: LossHead) -> int:
    """Strategy.loss_chunk_tokens, or for "auto" about tokens / ceil(vocab / hidden): a chunk's
    logits are about as large as the hidden states (Liger-Kernel's rule), rounded up to 8 rows."""
    n, c, v = head.shape
    chosen = program.strategy.loss_chunk_tokens
    if chosen == "auto":
        chosen = 8 * math.ceil(math.ceil(n / math.ceil(v / c)) / 8)
    return max(1, min(n, chosen))


def applies(program: Program) -> bool:
    if not program.strategy.fuse_loss:
        return False
    if find_heads(program):
        return True
    # Asked for and not done must not pass unseen: say so, and why it can be (docs/design.md).
    log.warning(
        "graphfuse: Strategy(fuse_loss=True) found no output projection followed only by a cross-entropy "
        "(a bias-free matmul whose logits feed nothing but log_softmax + nll_loss; no label smoothing); "
        "the loss runs unfused"
    )
    return False


def requires(program: Program) -> None:
    expect(
        program,
        NAME,
        program.layout is None,
        "a captured step whose buckets are not planned yet",
        "run fuse_loss first in the pipeline: it rewrites per-parameter gradients",
    )


def run(program: Program) -> Program:
    for head in find_heads(program):
        program = _fuse(program, head, chunk_tokens(program, head))
    eliminate_dead_code(program)
    return program


def ensures(program: Program) -> None:
    left = find_heads(program)
    expect(program, NAME, not left, f"no unfused output projection + cross-entropy left, found {len(left)}")


def _chunked(head: LossHead, chunk: int):
    """The fused head as a function of (hidden, weight_t, weight, target) -> (loss, total_weight,
    grad_hidden, grad_weight) for an incoming loss gradient of 1: per chunk, the very ops of the
    unfused step on its rows (so every row's values are the same), then one nll_loss_forward over
    the [tokens, 1] picked log-probabilities (the same values summed in the same order)."""
    n, dtype = head.shape[0], head.dtype
    soft = head.cast or dtype
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype  # chunk sums in fp32
    red, ignore = head.reduction, head.ignore_index

    def fused(hidden, weight_t, weight, target):
        valid = aten.ne.Scalar(target, ignore)
        index = aten.unsqueeze.default(aten.where.self(valid, target, aten.zeros_like.default(target)), 1)
        target0 = aten.where.self(valid, aten.zeros_like.default(target), target)  # ignored rows keep ignore
        _, total = aten.nll_loss_forward.default(
            aten.new_zeros.default(hidden, [n, 1], dtype=soft), target0, None, red, ignore
        )
        one = aten.ones_like.default(total)  # the loss's incoming gradient, in the loss's dtype
        picked, grad_hidden, grad_weight = [], [], None
        for s in range(0, n, chunk):
            h, t = aten.slice.Tensor(hidden, 0, s, s + chunk), aten.slice.Tensor(target, 0, s, s + chunk)
            logits = aten.mm.default(h, weight_t)
            logp = aten._log_softmax.default(
                logits if head.cast is None else aten._to_copy.default(logits, dtype=soft), 1, False
            )
            picked.append(aten.gather.default(logp, 1, aten.slice.Tensor(index, 0, s, s + chunk)))
            d = aten.nll_loss_backward.default(one, logp, t, None, red, ignore, total)
            d = aten._log_softmax_backward_data.default(d, logp, 1, head.softmax_dtype)
            d = d if head.cast is None else aten._to_copy.default(d, dtype=dtype)
            grad_hidden.append(aten.mm.default(d, weight))
            part = aten.mm.default(aten.t.default(h), d) if head.transposed else aten.mm.default(aten.t.default(d), h)
            part = part if acc == dtype else aten._to_copy.default(part, dtype=acc)
            grad_weight = part if grad_weight is None else aten.add.Tensor(grad_weight, part)
        loss, total = aten.nll_loss_forward.default(aten.cat.default(picked), target0, None, red, ignore)
        grad_weight = grad_weight if acc == dtype else aten._to_copy.default(grad_weight, dtype=dtype)
        return loss, total, aten.cat.default(grad_hidden), grad_weight

    return fused


def _meta(node: torch.fx.Node) -> TensorMeta:
    v = node.meta["val"]
    return TensorMeta(tuple(v.shape), str(v.dtype).removeprefix("torch."), v.device.type)


def _fuse(program: Program, head: LossHead, chunk: int) -> Program:
    graph = program.graph
    args = [head.hidden, head.weight_t, head.weight, head.target]
    before = set(graph.nodes)
    with graph.inserting_before(head.loss):
        loss, total, grad_hidden, grad_weight = inline(
            graph, _chunked(head, chunk), args, [_meta(a) for a in args], sig.FORWARD
        )
    _mark_gradient_work(before, [loss, total])
    if head.grad_out.target is not aten.ones_like.default:  # e.g. a loss scaled by 1/micro-batches
        with graph.inserting_before(head.nll_backward):
            grad_hidden = call(graph, aten.mul.Tensor, grad_hidden, head.grad_out, phase=sig.BACKWARD)
            grad_weight = call(graph, aten.mul.Tensor, grad_weight, head.grad_out, phase=sig.BACKWARD)
    renamed = {}
    for old, new in (
        (head.loss, loss),
        (head.total_weight, total),
        (head.grad_hidden, grad_hidden),
        (head.grad_weight, grad_weight),
    ):
        old.replace_all_uses_with(new)
        renamed[old.name] = new.name
    grads = {fqn: renamed.get(name, name) for fqn, name in program.signature.grads.items()}
    return program.with_(signature=program.signature.with_(grads=grads))


def _mark_gradient_work(before: set, forward_roots: list[torch.fx.Node]) -> None:
    """The new nodes the loss needs are forward; the rest (the gradients) backward, as capture
    marks phases."""
    new, forward, todo = [n for n in forward_roots[0].graph.nodes if n not in before], set(), list(forward_roots)
    while todo:
        n = todo.pop()
        if n not in before and n not in forward:
            forward.add(n)
            todo.extend(n.all_input_nodes)
    for n in new:
        n.meta["phase"] = sig.FORWARD if n in forward else sig.BACKWARD
