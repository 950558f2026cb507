"""Split a whole-step graph into pieces that inductor compiles one by one (in parallel processes,
graphfuse/compiler/workers.py), and run the compiled pieces as one step.

Inductor's lowering, scheduling and code generation of one graph is single-threaded Python; a
step cut into k pieces can be compiled by k processes at once. The cut keeps the step's meaning:

- A piece is a contiguous run of the graph's compute nodes. Views of the step's inputs (every
  `slice@<fqn>` of a bucket) belong to no piece: each piece that reads one recomputes it from
  the input, so no piece takes as input a view of an input another piece writes.
- The `copy_` of a new value into its input (compiler/in_place.py) moves to just after the
  last read of that input, so no later piece reads it written.
- No cut falls between a collective and its wait: each piece waits for what it issues.
- Within 2% of one piece's work on either side of each even share, the cut that fewest values
  cross. (A window of 5% of the whole step's work let a piece grow by 40% at 4 pieces: in the
  forward fewer values cross earlier cuts and in the backward later ones, so the second
  piece took both windows, and the slowest compile, on the GPU.)
- A bucket's gradients computed in earlier pieces reach its `cat` packed in parts, one per run
  of them (`partial_cats`), not one by one.

Pieces lose the fusions across their cuts (each crossing value is written out and read back);
docs/benchmarks.md measures what that costs a step.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx

from graphfuse.ir.program import arg_node
from graphfuse.passes.graph import issues_collective, placeholders

WINDOW = 0.02  # of one piece's work: how far from an even share a cut may move to cross fewer values


@dataclass
class Piece:
    gm: torch.fx.GraphModule
    inputs: list[torch.fx.Node]  # the step graph's nodes this piece reads: placeholders, earlier pieces' values
    outputs: list[torch.fx.Node]  # its values read by later pieces or returned by the step


def is_view(node: torch.fx.Node) -> bool:
    """The node's result aliases its first argument (a view op, or getitem of a view op's list)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(arg_node(node))
    if node.target is torch.ops.aten._unsafe_view.default:  # a view in eager, whatever its schema says
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def free_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Views of the inputs (through any chain of views) and constants: recomputed where used."""
    free: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            free.add(n)
        elif is_view(n):
            base = n.args[0]
            if isinstance(base, torch.fx.Node) and (base.op == "placeholder" or base in free):
                free.add(n)
    return free


def input_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder `node` is a view of (or is), else None."""
    while node.op != "placeholder":
        if not is_view(node):
            return None
        node = arg_node(node)  # a view's base
    return node


def order(graph: torch.fx.Graph, free: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The compute nodes in graph order, except: each view, and each node read only by a `cat`
    (a bucket's padding), just after its input; each `cat` just after its last input (a
    bucket's gradients are packed as soon as they exist, as inductor writes them anyway); each
    `copy_` into an input just after the later of its source and the last read of that input
    (through its views)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n not in free]
    copies = {n for n in nodes if n.target is torch.ops.aten.copy_.default and input_root(n.args[0]) is not None}
    key: dict[torch.fx.Node, tuple] = {}
    for i, n in enumerate(nodes):
        if n.target is torch.ops.aten.cat.default:
            key[n] = (*max((key[a] for a in n.all_input_nodes if a in key), default=(-1,)), 1, i)
        elif is_view(n) and n.args[0] in key:  # a view just after its base
            key[n] = (*key[n.args[0]], 0, i)
        elif (
            len(n.users) == 1
            and next(iter(n.users)).target is torch.ops.aten.cat.default
            and any(a in key for a in n.all_input_nodes)
        ):
            key[n] = (*max(key[a] for a in n.all_input_nodes if a in key), 0, i)  # e.g. a bucket's padding
        elif n not in copies:
            key[n] = (i,)
    for i, c in enumerate(nodes):
        if c in copies:
            # A hand walk over the views' users: it stops at the first non-view, which nx.descendants cannot.
            # copies holds only copies into (a view of) an input: the root is a placeholder
            reads, seen, stack = [], set(), [cast(torch.fx.Node, input_root(arg_node(c)))]
            while stack:
                for u in stack.pop().users:
                    if u in free and u not in seen:
                        seen.add(u)
                        stack.append(u)
                    elif u in key:
                        reads.append(key[u])
            key[c] = (*max([key.get(c.args[1], (-1,)), *reads]), 2, i)
    return sorted(nodes, key=key.__getitem__)


def cuts(body: list[torch.fx.Node], k: int) -> list[int]:
    """Indices i of `body` after which to cut (at most k - 1), per the module docstring."""
    # No graph library: `body` is already a topological order, and a cut's crossing values are a
    # prefix sum over it (each value alive from its position to its last reader's).
    n = len(body)
    pos = {x: i for i, x in enumerate(body)}
    work = [0 if is_view(x) else 1 for x in body]
    total = sum(work)
    if k <= 1 or total < 2 * k:
        return []
    allowed, crossing = [True] * n, [0] * (n + 1)
    for i, x in enumerate(body):
        span = None
        if issues_collective(x):  # issued and waited for in one piece
            span = (i, max([pos[u] for u in x.users if u in pos] or [i]))
        if span:
            for j in range(*span):
                allowed[j] = False
        last = max((pos.get(u, n) for u in x.users), default=i)  # the step's output reads at n
        crossing[i] += 1  # x is alive across cuts i .. last - 1
        crossing[last] -= 1
    alive, cum = 0, 0
    score = []
    for i in range(n):
        alive += crossing[i]
        cum += work[i]
        score.append((alive, cum))
    chosen: list[int] = []
    for share in range(1, k):
        target = total * share / k
        ok = [i for i in range(n - 1) if allowed[i] and 0 < score[i][1] < total and (not chosen or i > chosen[-1])]
        near = [i for i in ok if abs(score[i][1] - target) <= WINDOW * total / k]
        if near:
            chosen.append(min(near, key=lambda i: (score[i][0], abs(score[i][1] - target))))
        elif ok:
            chosen.append(min(ok, key=lambda i: abs(score[i][1] - target)))
    return sorted(set(chosen))


def split(gm: torch.fx.GraphModule, k: int) -> list[Piece]:
    """`gm` (a graph whose only mutations are `copy_` into its inputs) as up to k pieces. The
    partial cats (`partial_cats`) are added to `gm` too, which computes what it did."""
    graph = gm.graph
    free = free_nodes(graph)
    body = order(graph, free)
    bounds = [0, *(c + 1 for c in cuts(body, k)), len(body)]
    piece_of = {x: p for p in range(len(bounds) - 1) for x in body[bounds[p] : bounds[p + 1]]}
    body = partial_cats(graph, body, piece_of)
    for x in body:  # the results of an op with several are taken where it runs: no piece returns a tuple
        if x.target is operator.getitem:
            piece_of[x] = piece_of[arg_node(x)]
    builders = [_Builder(gm, [x for x in body if piece_of[x] == p], piece_of, free) for p in range(len(bounds) - 1)]
    outputs: list[list[torch.fx.Node]] = [[] for _ in builders]
    for x in body:
        if any(u.op == "output" or piece_of.get(u, piece_of[x]) > piece_of[x] for u in x.users):
            outputs[piece_of[x]].append(x)
    for x in graph.output_node().all_input_nodes:  # a view of an input returned by the step
        if x in free and x not in outputs[-1]:
            builders[-1].value(x)
            outputs[-1].append(x)
    gm.recompile()
    pieces = []
    for b, outs in zip(builders, outputs):
        b.graph.output(tuple(b.env[x] for x in outs))
        pieces.append(Piece(torch.fx.GraphModule(gm, b.graph), b.inputs, outs))
    return pieces


def partial_cats(graph: torch.fx.Graph, body: list[torch.fx.Node], piece_of: dict) -> list[torch.fx.Node]:
    """Each run of two or more consecutive inputs of a `cat` that an earlier piece computes is
    concatenated there first (cat is associative: the same values). The cat's piece then copies
    one tensor per run, where it would copy every input: inductor writes an input computed in
    the cat's own graph straight into it, and copies one from outside, grouping such copies
    into one kernel per cat that took seconds to build for a bucket of ~100 gradients. Returns
    `body` with the new cats, each just after its run; `piece_of` gets them."""
    out = list(body)
    for c in body:
        if c.target is not torch.ops.aten.cat.default:
            continue
        args, runs, start = list(cast(Sequence[torch.fx.Node], c.args[0])), [], 0  # cat's tensors
        for i in range(1, len(args) + 1):
            if i == len(args) or piece_of.get(args[i], -1) != piece_of.get(args[start], -1):
                if i - start >= 2 and -1 < piece_of.get(args[start], -1) < piece_of[c]:
                    runs.append((start, i))
                start = i
        for lo, hi in reversed(runs):
            run = args[lo:hi]
            with graph.inserting_before(c):  # in graph order every input precedes c
                part = graph.call_function(torch.ops.aten.cat.default, (run, *c.args[1:]), dict(c.kwargs))
            piece_of[part] = piece_of[run[0]]
            out.insert(max(out.index(a) for a in run) + 1, part)
            args[lo:hi] = [part]
        if runs:
            c.args = (args, *c.args[1:])
    return out


class _Builder:
    """One piece's graph: its nodes copied, every value from outside it a placeholder (in order
    of first use), every view of an input recomputed from that input."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], piece_of: dict, free: set) -> None:
        self.graph, self.free = torch.fx.Graph(), free
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.inputs: list[torch.fx.Node] = []
        first = []
        for x in nodes:
            for a in x.all_input_nodes:
                while a in free and a.op != "get_attr":
                    a = arg_node(a)  # a view's base
                if a.op == "placeholder" or (a not in free and piece_of[a] < piece_of[x]):
                    first.append(a)
        for a in dict.fromkeys(first):  # placeholders before any compute node
            self.value(a)
        for x in nodes:
            self.env[x] = self.graph.node_copy(x, self.value)

    def value(self, a: torch.fx.Node) -> torch.fx.Node:
        if a not in self.env:
            if a in self.free:  # a view of an input (or a constant): recomputed here
                self.env[a] = self.graph.node_copy(a, self.value)
            else:  # an input of the step, or a value of an earlier piece
                self.env[a] = self.graph.placeholder(a.name)
                self.inputs.append(a)
        return self.env[a]


class PieceRunner:
    """Runs compiled pieces in order as the step: feeds each its inputs (the step's arguments
    and earlier pieces' values), drops each value after its last reader, returns the step's
    outputs. `fns[i]` is piece i compiled (called with its inputs in order, returns its outputs)."""

    writes_in_place = True

    def __init__(self, gm: torch.fx.GraphModule, pieces: list[Piece], fns: list) -> None:
        inputs = placeholders(gm.graph)
        slot = {n: i for i, n in enumerate(inputs)}
        for piece in pieces:
            for x in piece.outputs:
                slot[x] = len(slot)
        self.n_args, self.n_slots = len(inputs), len(slot)
        last = {}
        for p, piece in enumerate(pieces):
            for a in piece.inputs:
                last[slot[a]] = p
        # the step returns a tuple of graph values (graphfuse.ir.program.output_nodes)
        self.results = [slot[x] for x in cast(Sequence[torch.fx.Node], gm.graph.output_node().args[0])]
        keep = set(self.results) | set(range(self.n_args))  # the step's outputs, and the caller's arguments
        self.plan = [
            (
                fn,
                [slot[a] for a in piece.inputs],
                [slot[x] for x in piece.outputs],
                [s for s, q in last.items() if q == p and s not in keep],
            )
            for p, (piece, fn) in enumerate(zip(pieces, fns))
        ]

    def __call__(self, *args):
        values = [*args, *[None] * (self.n_slots - self.n_args)]
        for fn, ins, outs, done in self.plan:
            for s, v in zip(outs, fn(*[values[i] for i in ins])):
                values[s] = v
            for s in done:
                values[s] = None
        return [values[s] for s in self.results]
