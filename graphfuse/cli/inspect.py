"""`graphfuse inspect PATH`: a program's (or a checkpoint's) buckets, collectives, memory and
passes, as tables, as JSON (`--json`), as the program's Python code (`--code`) or as a graph file (`--graph`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

import graphfuse as gf
from graphfuse.cli import ckpt as checkpoint_cli
from graphfuse.cli.args import UsageError, existing, kind_of, wide_console
from graphfuse.cli.dataflow import FORMATS, dataflow_graph, write_graph
from graphfuse.cli.facts import owners_text, program_facts, slices_text
from graphfuse.cli.trace import read_trace
from graphfuse.ir.program import Program
from graphfuse.passes.graph import PASS_META
from graphfuse.passes.verify import fake_values

ASSIGNMENT = re.compile(r"\s+(\w+)(?:: \"[^\"]*\")? = ")  # a node's line in print_readable's code


def load(path: str, rank: int | None) -> tuple[Program, dict]:
    """The program at `path` (a program directory, or rank `rank` of a trace output) and its facts."""
    where = existing(path)
    kind = kind_of(where)
    if kind == "checkpoint":
        raise UsageError(f"{path}: is a checkpoint; this command draws programs (graphfuse inspect reads both)")
    trace, program_dir = None, where
    if kind == "trace":
        trace = read_trace(where)
        assert trace is not None  # kind_of found its trace file
        rank = 0 if rank is None else rank
        program_dir = where / f"rank{rank}"
        if str(rank) not in trace["ranks"] or not program_dir.is_dir():
            saved = ", ".join(sorted(trace["ranks"])) or "none"
            raise UsageError(
                f"{path}: holds no program of rank {rank} (saved: {saved}); trace with --rank {rank} or --all-ranks"
            )
    elif (parent := read_trace(where.parent)) is not None and where.name.startswith("rank"):
        trace = parent  # a program directory inside a trace output: its statistics are beside it
    program = with_values(gf.load_program(program_dir))
    if rank is not None and rank != program.rank:
        raise UsageError(f"{path}: is the program of rank {program.rank}, not {rank}")
    stats = trace["ranks"].get(str(program.rank)) if trace else None
    return program, program_facts(program, str(program_dir), stats)


def with_values(program: Program) -> Program:
    """`program` with every node's fake value in its meta (a saved program keeps only some):
    the collectives' sizes and the shapes `--code` prints come from them."""
    for node, val in fake_values(program).items():
        node.meta.setdefault("val", val)
    program.graph_module.recompile()
    return program


def run_inspect(args) -> int:
    where = existing(args.path)
    graph_file = args.graph
    if graph_file is not None and Path(graph_file).suffix.lower() not in FORMATS:
        raise UsageError(
            f"--graph {graph_file}: name the file *.graphml (GraphML) or *.dot (DOT); the suffix picks the format"
        )
    if kind_of(where) == "checkpoint":
        if graph_file is not None:
            raise UsageError(f"{args.path}: is a checkpoint; --graph draws programs")
        return checkpoint_cli.cli_info(args.path, verify=not args.no_verify, as_json=args.json)
    program, facts = load(args.path, args.rank)
    if graph_file is not None:
        g = dataflow_graph(program)
        kind = write_graph(g, graph_file)
        print(
            f"{graph_file}: {kind}, {g.number_of_nodes()} nodes, {g.number_of_edges()} edges "
            f"(rank {program.rank} of {program.world_size})"
        )
    elif args.code:
        print(code_text(program, facts), end="")
    elif args.json:
        print(json.dumps(facts, indent=1))
    else:
        print_facts(wide_console(), facts)
    return 0


def code_text(program: Program, facts: dict) -> str:
    """The program as Python that parses (FX's print_readable: every value annotated with its
    shape), after comments naming each bucket input's parameters and their elements; a line a
    pass wrote ends with `# <pass>` (node.meta[PASS_META]; a captured line has none)."""
    lines = [
        f"# graphfuse program: rank {program.rank} of {program.world_size}, layout {facts['layout']['fingerprint']}"
    ]
    for b in facts["buckets"]:
        lines.append(
            f"# bucket_{b['name']} ({b['dtype']}[{b['elements']}]): "
            + ", ".join(f"{p['fqn']} [{p['offset']}, {p['offset'] + p['elements']})" for p in b["params"])
        )
    lines.append("# a line ending in `# <pass>` was written by that pass; the others were captured")
    lines.append("import torch\n\n")
    by_pass = {n.name: n.meta[PASS_META] for n in program.graph.nodes if PASS_META in n.meta}
    code = []
    for line in program.graph_module.print_readable(print_output=False).splitlines():
        m = ASSIGNMENT.match(line)
        code.append(f"{line}  # {by_pass[m.group(1)]}" if m and m.group(1) in by_pass else line)
    return "\n".join(lines) + "\n".join(code) + "\n"


def _table(title: str, *cols: str, right: tuple[str, ...] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(c, justify="right" if c in right else "left", no_wrap=True)
    return t


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def print_facts(console: Console, f: dict) -> None:
    console.print(
        f"[bold]{f['path']}[/bold]: rank {f['rank']} of {f['world_size']}, optimizer {f['optimizer']}, "
        f"process group {f['group_name'] or '-'}, layout {f['layout']['fingerprint']}"
    )
    owned = [ownership_table(f)] if f.get("ownership") else []
    for table in (nodes_table(f), *bucket_tables(f), *owned, collectives_table(f), memory_table(f), passes_table(f)):
        console.print(table)


def nodes_table(f: dict) -> Table:
    before, after = f["nodes"]["before_passes"], f["nodes"]["after_passes"]
    t = _table(
        f"operator nodes by phase ({f['nodes']['total']} nodes in all)",
        "phase",
        "before passes",
        "after passes",
        right=("before passes", "after passes"),
    )
    for phase in sorted(set(after) | set(before or {})):
        t.add_row(phase, "?" if before is None else str(before.get(phase, 0)), str(after.get(phase, 0)))
    if before is None:
        t.caption = "before passes: known only for a `graphfuse trace` output"
    return t


def bucket_tables(f: dict) -> list[Table]:
    out = []
    for b in f["buckets"]:
        t = _table(
            f"{b['name']}: {b['dtype']}, param group {b['group']}, {b['elements']:,} elements ({b['bytes']:,} B), "
            f"{b['shard_elements']:,} per rank's shard, {b['padding']:,} padding",
            "parameter",
            "shape",
            "offset",
            "elements",
            "padding",
            "owners",
            "slice@ per rank (param elements)",
            right=("offset", "elements", "padding"),
        )
        for p in b["params"]:
            t.add_row(
                p["fqn"],
                "×".join(map(str, p["shape"])) or "scalar",
                f"{p['offset']:,}",
                f"{p['elements']:,}",
                f"{p['padding']:,}",
                owners_text(p),
                slices_text(p),
            )
        out.append(t)
    return out


def ownership_table(f: dict) -> Table:
    """Buckets laid out whole (docs/design.md, "Whole-matrix ownership"): what each rank updates."""
    t = _table(
        "whole-matrix ownership: parameters each rank updates whole",
        "bucket",
        "rank",
        "owned parameters",
        "update cost",
        "padding",
        right=("update cost", "padding"),
    )
    for o in f["ownership"]:
        t.add_row(o["bucket"], str(o["rank"]), ", ".join(o["params"]) or "-", f"{o['cost']:,}", f"{o['padding']:,}")
    return t


def collectives_table(f: dict) -> Table:
    t = _table(
        "collectives in issue order (node index and fraction of the step)",
        "#",
        "op",
        "bucket",
        "bytes",
        "issued",
        "waited",
        right=("#", "bytes"),
    )
    for i, c in enumerate(f["collectives"]):
        t.add_row(
            str(i),
            c["op"],
            c["bucket"] or "-",
            "-" if c["bytes"] is None else f"{c['bytes']:,}",
            f"{c['issued']} ({_pct(c['issued_at'])})",
            "-" if c["waited"] is None else f"{c['waited']} ({_pct(c['waited_at'])})",
        )
    if not f["collectives"]:
        t.caption = "none: at world size 1 nothing is communicated"
    return t


def memory_table(f: dict) -> Table:
    t = _table(
        "bytes per rank (sharded) vs every rank holding everything (unsharded)",
        "rank",
        "parameters",
        "gradients (step / kept)",
        "optimizer state",
        right=("parameters", "gradients (step / kept)", "optimizer state"),
    )
    for m in f["memory"]:
        t.add_row(
            str(m["rank"]),
            f"{m['params']:,}",
            f"{m['grads']:,} / {m['grads_after_reduce_scatter']:,}",
            f"{m['optimizer_state']:,}",
        )
    m = f["memory"][0]
    t.add_row(
        "unsharded", f"{m['params_unsharded']:,}", f"{m['grads_unsharded']:,}", f"{m['optimizer_state_unsharded']:,}"
    )
    return t


def passes_table(f: dict) -> Table:
    t = _table(
        "passes in the order they ran",
        "pass",
        "nodes added",
        "nodes removed",
        "collectives added",
        "seconds",
        right=("nodes added", "nodes removed", "collectives added", "seconds"),
    )
    for p in f["passes"]:
        t.add_row(
            p["name"],
            *(str(p[k]) if k in p else "?" for k in ("nodes_added", "nodes_removed", "collectives_added")),
            f"{p['seconds']:.3f}" if "seconds" in p else "?",
        )
    if any("seconds" not in p for p in f["passes"]):
        t.caption = "?: program files keep the passes' names only; a `graphfuse trace` output keeps their statistics"
    return t
