"""Pass contracts: the `Pass` protocol every pass implements, and what a pass requires of the
program it is given and ensures of the one it makes, raised as `PassContractError` naming the
pass and the passes that ran before it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Protocol, runtime_checkable

from graphfuse.errors import PassContractError
from graphfuse.ir.program import Handoffs, Program

HANDOFFS = tuple(f.name for f in fields(Handoffs))


@runtime_checkable
class Pass(Protocol):
    """A Program rewrite with its contract: a module of passes/ (its top-level names) or an
    object (ShardInputs, a frozen dataclass). The members are read-only properties and hooks
    without `self` in their use, so that a module matches: mypy and pyright accept a module
    where a protocol is expected when its attributes have the members' types (PEP 544,
    "modules as implementations of protocols"), which checks `PIPELINE: list[Pass]`; at run
    time `check_pipeline` checks the same members by name (`MEMBERS`).

    `run_pass` calls them in this order: `applies` (False: the pass is skipped; a pass that
    always applies says `applies = always`), `requires`, `run`, `ensures`."""

    @property
    def NAME(self) -> str: ...  # in Program.passes and in every contract error

    @property
    def NEEDS(self) -> tuple[str, ...]: ...  # Handoffs fields an earlier pass must provide

    @property
    def PROVIDES(self) -> tuple[str, ...]: ...  # Handoffs fields this pass sets

    def applies(self, program: Program) -> bool:
        """Whether the pass runs on `program` (its strategy, its world size, its roles)."""
        ...

    def requires(self, program: Program) -> None:
        """Raise PassContractError (through `expect`) unless `program` is what `run` rewrites."""
        ...

    def run(self, program: Program) -> Program:
        """Rewrite `program`: the pass edits `program.graph` in place (the graph module and its
        nodes are shared, never copied) and returns the new record, `program.with_(...)` with
        the fields it changed (signature, layout, hand-offs), which callers must use from then
        on; the record it was given is stale afterwards."""
        ...

    def ensures(self, program: Program) -> None:
        """Raise PassContractError unless the program `run` returned is what it promises."""
        ...


MEMBERS = tuple(name for name in vars(Pass) if not name.startswith("_"))  # what check_pipeline looks for


def always(program: Program) -> bool:
    """`applies` of a pass that runs on every program: the default, written once."""
    return True


def expect(program: Program, pass_name: str, ok: bool, condition: str, way_out: str = "") -> None:
    """Raise PassContractError unless `ok`; `condition` says what must hold, in words."""
    if ok:
        return
    before = ", ".join(program.pass_names) or "none"
    hint = f"; {way_out}" if way_out else ""
    raise PassContractError(f"pass {pass_name}: expected {condition} (passes run before it: {before}){hint}")


def expect_handoffs(program: Program, pass_name: str, names: Sequence[str], what: str) -> None:
    """Every hand-off in `names` holds one node of the graph per bucket."""
    buckets = len(program.layout.buckets) if program.layout is not None else 0
    graph_nodes = set(program.graph.nodes)
    for name in names:
        nodes = getattr(program.handoffs, name)
        ok = nodes is not None and len(nodes) == buckets and all(n in graph_nodes for n in nodes)
        expect(program, pass_name, ok, f"the hand-off {name}: one node of the graph per bucket, {what}")


def check_pipeline(pipeline: Sequence[Pass]) -> None:
    """Before anything runs: every pass has the members of `Pass`, and every hand-off a pass
    NEEDS is one an earlier pass PROVIDES."""
    provided: set[str] = set()
    for i, p in enumerate(pipeline):
        if not isinstance(p, Pass):
            missing = [m for m in MEMBERS if not hasattr(p, m)]
            name = getattr(p, "NAME", None) or getattr(p, "__name__", type(p).__name__)
            raise PassContractError(
                f"pass {name} (pipeline position {i}) has no {', '.join(missing)}; a pass defines every member of "
                "graphfuse.passes.Pass (applies = always for one that runs on every program)"
            )
        unknown = set(p.NEEDS) | set(p.PROVIDES)
        if not unknown <= set(HANDOFFS):
            raise PassContractError(
                f"pass {p.NAME}: unknown hand-offs {sorted(unknown - set(HANDOFFS))}; known: {HANDOFFS}"
            )
        missing = set(p.NEEDS) - provided
        if missing:
            before = ", ".join(q.NAME for q in pipeline[:i]) or "none"
            raise PassContractError(
                f"pass {p.NAME} needs the hand-offs {sorted(missing)}, which no pass before it provides "
                f"(passes before it: {before}); put the pass that provides them earlier"
            )
        provided |= set(p.PROVIDES)
