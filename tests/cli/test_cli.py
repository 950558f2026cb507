"""The `graphfuse` command driven as a user would, in subprocesses: help and version, trace at
world size 3, inspect's JSON against the program itself, the report's pictures, and errors that
are one line with the documented exit status."""

import ast
import json
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import networkx as nx
import pytest

import graphfuse as gf
from graphfuse.passes import issues_collective
from tests._common import ROOT, run_ranks

SVG = "{http://www.w3.org/2000/svg}"
FACTORY = textwrap.dedent("""
    import torch
    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)

    def make():
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, gpt_loss, next(iter(synthetic_tokens(CFG, 4, 1, seed=0)))

    def batches(rank):
        return list(synthetic_tokens(CFG, 4, 3, seed=100 + rank))

    def broken():
        raise ValueError("the data set is not there")

    def linear():
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), torch.randn(3, 4)
""")


def graphfuse(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphfuse", *args], capture_output=True, text=True, timeout=timeout)


# Many commands in one subprocess, each through graphfuse.cli.main as the console script calls it
# (a traceback escaping main lands in its stderr): one torch import instead of one per command.
BATCH = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from graphfuse.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException:
                traceback.print_exc()
                code = "escaped"
        results.append([code, out.getvalue(), err.getvalue()])
    print(json.dumps(results))
""")


def graphfuse_batch(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    done = subprocess.run(
        [sys.executable, "-c", BATCH, json.dumps(commands)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return [
        subprocess.CompletedProcess(argv, code, out, err)
        for argv, (code, out, err) in zip(commands, json.loads(done.stdout))
    ]


def assert_one_line_error(done: subprocess.CompletedProcess, status: int, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "error:" in lines[0] and all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factory") / "tiny_gpt.py"
    path.write_text(FACTORY)
    return path


@pytest.fixture(scope="module")
def traced(factory, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "gpt3"
    done = graphfuse(
        "trace", f"{factory}:make", "--out", str(out), "--world-size", "3", "--all-ranks", "--bucket-mb", "0.004"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert all((out / f"rank{r}" / "manifest.json").is_file() for r in range(3))
    return out


def test_every_command_has_help_and_the_tool_its_version():
    commands = (
        [],
        ["trace"],
        ["inspect"],
        ["report"],
        ["demo"],
        ["ckpt"],
        ["ckpt", "info"],
        ["ckpt", "convert"],
        ["program"],
        ["program", "info"],
    )
    *helped, version = graphfuse_batch(*(c + ["--help"] for c in commands), ["--version"])
    for cmd, done in zip(commands, helped):
        assert done.returncode == 0 and done.stdout.startswith("usage: graphfuse " + " ".join(cmd)), (
            cmd,
            done.stdout[:80],
        )
    assert version.returncode == 0 and re.match(r"graphfuse \d+\.\d+\.\d+ \(torch 2\.", version.stdout), version.stdout
    script_help = subprocess.run(
        [str(Path(sys.executable).parent / "graphfuse"), "--help"], capture_output=True, text=True
    )
    assert script_help.returncode == 0 and all(
        c in script_help.stdout for c in ("trace", "inspect", "report", "demo", "ckpt")
    )


def test_inspect_json_matches_the_program_at_world_size_3(traced):
    runs = graphfuse_batch(*(["inspect", str(traced), "--rank", str(rank), "--json"] for rank in range(3)))
    for rank, done in enumerate(runs):
        assert done.returncode == 0, done.stderr
        facts, program = json.loads(done.stdout), gf.load_program(traced / f"rank{rank}")
        layout = program.layout
        assert (facts["rank"], facts["world_size"], len(layout.buckets)) == (rank, 3, len(facts["buckets"]))
        assert len(layout.buckets) > 2, "the tiny GPT should need several buckets at this cap"
        for b, fb in zip(layout.buckets, facts["buckets"]):
            assert (fb["name"], fb["elements"], fb["bytes"], fb["shard_elements"]) == (
                b.name,
                b.size,
                b.nbytes,
                b.size // 3,
            )
            assert [p["fqn"] for p in fb["params"]] == list(b.fqns)
            for s, p in zip(b.slots, fb["params"]):
                assert (p["offset"], p["elements"], p["padding"]) == (s.offset, s.numel, s.padded - s.numel)
                owners = [
                    r
                    for r in range(3)
                    if max(s.offset, r * b.shard_size) < min(s.offset + s.numel, (r + 1) * b.shard_size)
                ]
                assert p["owners"] == owners and sum(x["param"][1] - x["param"][0] for x in p["slices"]) == s.numel
        _check_collectives(facts, program)
        assert [p["name"] for p in facts["passes"]] == list(program.pass_names)
        assert all("nodes_added" in p for p in facts["passes"]), "a trace output keeps the passes' statistics"
        assert facts["nodes"]["before_passes"]["optimizer"] > 0 and facts["nodes"]["after_passes"]["comm"] > 0
        mem = facts["memory"][rank]
        assert mem["optimizer_state"] * 3 == sum(2 * b.nbytes for b in layout.buckets)  # AdamW: 2 states, 1/3 each


def _check_collectives(facts: dict, program) -> None:
    nodes = list(program.graph.nodes)
    scatters = [c for c in facts["collectives"] if c["op"] == "reduce_scatter_tensor"]
    gathers = [c for c in facts["collectives"] if c["op"] == "all_gather_into_tensor"]
    names = [b.name for b in program.layout.buckets]
    assert [c["bucket"] for c in scatters] == names and sorted(c["bucket"] for c in gathers) == sorted(names)
    for c in scatters + gathers:
        b = program.layout.buckets[names.index(c["bucket"])]
        assert c["bytes"] == b.nbytes
        assert nodes[c["issued"]].name == c["node"] and c["issued"] < c["waited"]
        assert nodes[c["waited"]].args[0].name == c["node"]  # the wait of this collective


def _run_traced_program(rank: int, world_size: int, trace: str, factory: str) -> tuple[list[float], list[float]]:
    from graphfuse.cli.trace import call_factory, load_factory

    program = gf.load_program(f"{trace}/rank{rank}")
    model, opt, _, _, _ = call_factory(f"{factory}:make")
    loaded = gf.DistModel.from_program(program, model, opt)
    model2, opt2, loss_fn, batch, _ = call_factory(f"{factory}:make")
    compiled = gf.compile(model2, opt2, loss_fn, batch)
    batches = load_factory(f"{factory}:batches")(rank)
    return [loaded(b).item() for b in batches], [compiled(b).item() for b in batches]


def test_a_traced_program_runs_on_3_ranks_like_gf_compile(traced, factory):
    for loaded, compiled in run_ranks(_run_traced_program, 3, str(traced), str(factory)):
        assert loaded == compiled


def test_report_draws_a_row_per_bucket_and_a_column_per_rank(traced, tmp_path):
    done, svg = graphfuse_batch(
        ["report", str(traced), "--out", str(tmp_path / "r.html")],
        ["report", str(traced), "--out", str(tmp_path / "l.svg"), "--format", "svg"],
    )
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<script" not in html and not re.search(r"(src|href)=\"https?:", html)  # self-contained, no JavaScript
    program = gf.load_program(traced / "rank0")
    layout_svg, schedule_svg = (ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", html, re.S))
    rows = layout_svg.findall(f".//{SVG}g[@class='bucket']")
    assert [r.get("data-bucket") for r in rows] == [b.name for b in program.layout.buckets]
    for row, bucket in zip(rows, program.layout.buckets):
        shards = row.findall(f"{SVG}g[@class='shard']")
        assert [s.get("data-rank") for s in shards] == ["0", "1", "2"]
        drawn = {r.get("data-fqn") for s in shards for r in s.findall(f"{SVG}rect[@class='param']")}
        assert drawn == set(bucket.fqns)
        titles = " ".join(t.text for t in row.iter(f"{SVG}title"))
        assert all(f in titles for f in bucket.fqns)
        hatched = row.findall(f".//{SVG}rect[@class='padding']")
        assert bool(hatched) == any(s.padded > s.numel for s in bucket.slots)
        assert all(r.get("fill") == "url(#hatch)" for r in hatched)
    assert len(layout_svg.findall(f".//{SVG}text[@class='column']")) == 3
    assert len(schedule_svg.findall(f".//{SVG}g[@class='collective']")) == 2 * len(program.layout.buckets)
    assert len(schedule_svg.findall(f".//{SVG}rect[@class='op']")) == len(program.graph.nodes)
    assert svg.returncode == 0 and ET.parse(tmp_path / "l.svg").getroot().get("class") == "layout"


def test_inspect_code_is_python_with_shapes_and_tables_cut_nothing(traced):
    done, tables = graphfuse_batch(["inspect", str(traced / "rank2"), "--code"], ["inspect", str(traced / "rank2")])
    assert done.returncode == 0, done.stderr
    ast.parse(done.stdout)
    assert "def forward(" in done.stdout and '"f32[' in done.stdout and "wte.weight" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) > 200, "long lines are not wrapped"
    # provenance: a line a pass wrote names it, a captured line names none
    lines = done.stdout.splitlines()
    scatters = [line for line in lines if "reduce_scatter_tensor.default(" in line]
    assert scatters and all(line.endswith("  # reduce_scatter") for line in scatters)
    assert any("aten.mm.default(" in line and "  # " not in line for line in lines)
    # not a terminal: nothing may be cut to a width
    for fqn in gf.load_program(traced / "rank2").layout.fqns:
        assert re.search(rf"│ {re.escape(fqn)} +│", tables.stdout), fqn


@pytest.fixture(scope="module")
def graph_files(traced, tmp_path_factory) -> tuple[Path, Path, Path, list[subprocess.CompletedProcess]]:
    """`inspect --graph` of rank 1 as GraphML and as DOT, and with a suffix of neither (one subprocess)."""
    out = tmp_path_factory.mktemp("graph")
    graphml, dot, bad = out / "g.graphml", out / "g.dot", out / "g.png"
    done = graphfuse_batch(
        ["inspect", str(traced), "--rank", "1", "--graph", str(graphml)],
        ["inspect", str(traced / "rank1"), "--graph", str(dot)],
        ["inspect", str(traced), "--graph", str(bad)],
    )
    return graphml, dot, bad, done


def test_inspect_graph_writes_the_dataflow_graph_as_graphml_and_dot(traced, graph_files):
    graphml, dot, bad, (wrote_graphml, wrote_dot, refused) = graph_files
    program = gf.load_program(traced / "rank1")
    nodes = list(program.graph.nodes)
    edges = {(a.name, n.name) for n in nodes for a in n.all_input_nodes}
    assert (
        wrote_graphml.returncode == 0 and f"GraphML, {len(nodes)} nodes, {len(edges)} edges" in wrote_graphml.stdout
    ), wrote_graphml
    g = nx.read_graphml(graphml)
    assert list(g.nodes) == [n.name for n in nodes] and set(g.edges) == edges
    # Every collective is marked, with its target; at world size 3 each bucket has a reduce-scatter and an all-gather.
    collectives = [n for n in nodes if issues_collective(n)]
    assert len(collectives) == 2 * len(program.layout.buckets) > 0
    assert {k for k, a in g.nodes(data=True) if a["collective"]} == {n.name for n in collectives}
    assert {g.nodes[n.name]["target"] for n in collectives} == {
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_gather_into_tensor.default",
    }
    # Inputs carry their signature role and name, and their shape and dtype; every op its phase.
    for n, spec in zip([n for n in nodes if n.op == "placeholder"], program.signature.inputs, strict=True):
        meta, a = program.inputs_meta[spec.name], g.nodes[n.name]
        assert (a["role"], a["name"], a["dtype"]) == (spec.role, spec.name, meta.dtype.removeprefix("torch."))
        assert a["tensor_shape"] == ("x".join(map(str, meta.shape)) or "scalar")
    assert all(g.nodes[n.name]["phase"] == n.meta.get("phase", "") for n in nodes)
    loss = program.signature.output_names("loss")
    assert [k for k, a in g.nodes(data=True) if a["output_role"] == "loss"] and loss == [
        a["output_name"] for _, a in g.nodes(data=True) if a["output_role"] == "loss"
    ]
    # DOT: a statement per node and per edge, the same graph; collectives drawn in red.
    assert wrote_dot.returncode == 0, wrote_dot.stderr
    text = dot.read_text()
    assert set(re.findall(r'^  "([^"]+)" -> "([^"]+)";$', text, re.M)) == edges
    declared = re.findall(r'^  "([^"]+)" \[op=', text, re.M)
    assert declared == [n.name for n in nodes]
    red = re.findall(r'^  "([^"]+)" \[.*color="red"', text, re.M)
    assert set(red) == {n.name for n in collectives}
    assert_one_line_error(refused, 2, "g.png", ".graphml", ".dot")
    assert not bad.exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed (apt-get install graphviz)")
def test_graphviz_reads_the_dot_file_without_a_warning(traced, graph_files):
    _, dot, _, (_, wrote_dot, _) = graph_files
    assert wrote_dot.returncode == 0, wrote_dot.stderr
    drawn = subprocess.run(["dot", "-Tsvg", str(dot)], capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and not drawn.stderr, drawn.stderr
    svg = ET.fromstring(drawn.stdout)
    assert len(svg.findall(f".//{SVG}g[@class='node']")) == len(gf.load_program(traced / "rank1").graph.nodes)


def test_missing_paths_and_non_programs_are_one_line_usage_errors(tmp_path, traced):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    missing, notes, report, rank = graphfuse_batch(
        ["inspect", str(tmp_path / "nope")],
        ["inspect", str(tmp_path / "notes")],
        ["report", str(tmp_path / "notes"), "--out", str(tmp_path / "r.html")],
        ["inspect", str(traced), "--rank", "5"],
    )
    assert_one_line_error(missing, 2, "nope", "no such path")
    assert_one_line_error(notes, 2, "not a program directory")
    assert_one_line_error(report, 2, "notes")
    assert_one_line_error(rank, 2, "no program of rank 5")


def test_a_factory_that_raises_is_a_one_line_failure(factory, tmp_path):
    done = graphfuse("trace", f"{factory}:broken", "--out", str(tmp_path / "t"))
    assert_one_line_error(done, 1, "broken raised ValueError: the data set is not there")
    assert not (tmp_path / "t").exists()
    nothing, debug = graphfuse_batch(
        ["trace", f"{factory}:nothing", "--out", str(tmp_path / "t")],
        ["trace", f"{factory}:broken", "--out", str(tmp_path / "t"), "--debug"],
    )
    assert_one_line_error(nothing, 2, "no function nothing")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "the data set is not there" in debug.stderr


def test_bad_demo_arguments_are_one_line():
    options = [("--world-size", "0"), ("--steps", "1"), ("--d-model", "30"), ("--bucket-mb", "0"), ("--layers", "two")]
    for option, done in zip(options, graphfuse_batch(*(["demo", *o] for o in options))):
        assert_one_line_error(done, 2, option[0])


def test_trace_options_are_checked(factory, tmp_path):
    rank, both = graphfuse_batch(
        ["trace", f"{factory}:make", "--out", str(tmp_path / "t"), "--world-size", "2", "--rank", "2"],
        ["trace", f"{factory}:make", "--out", str(tmp_path / "t"), "--rank", "0", "--all-ranks"],
    )
    assert_one_line_error(rank, 2, "--rank 2", "--world-size 2")
    assert_one_line_error(both, 2, "not allowed with argument")


def test_a_new_trace_replaces_the_earlier_ranks_and_nothing_else(traced, factory, tmp_path):
    """A trace at world size 2 into the output of one at world size 3: rank0/ and rank2/ of the
    earlier trace go (gf.load_program would load them as current), the user's files stay; a
    rank<R>/ holding the user's files is refused before any work and everything is kept."""
    again, guarded = (shutil.copytree(traced, tmp_path / n) for n in ("again", "guarded"))
    for out in (again, guarded):
        (out / "notes.txt").write_text("mine")
        (out / "results").mkdir()
    (guarded / "rank5").mkdir()
    (guarded / "rank5" / "data.csv").write_text("1,2")
    before = sorted(p.name for p in guarded.iterdir())
    refused, done = graphfuse_batch(
        ["trace", f"{factory}:linear", "--out", str(guarded), "--world-size", "2"],
        ["trace", f"{factory}:linear", "--out", str(again), "--world-size", "2", "--rank", "1"],
    )
    assert_one_line_error(refused, 2, str(guarded / "rank5"), "nothing was written")
    assert refused.stdout == "" and sorted(p.name for p in guarded.iterdir()) == before  # the factory never ran
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in again.iterdir()) == ["notes.txt", "rank1", "results", "trace.json"]
    assert list(json.loads((again / "trace.json").read_text())["ranks"]) == ["1"]
    assert (gf.load_program(again / "rank1").world_size, (again / "notes.txt").read_text()) == (2, "mine")


def test_help_and_docs_give_the_same_exit_statuses():
    from graphfuse.cli import EXIT_FAILED, EXIT_OUTPUT_CLOSED, EXIT_STATUS, EXIT_USAGE, build_parser

    docs = (ROOT / "docs" / "cli.md").read_text()
    assert EXIT_STATUS in build_parser().format_help() and f"```\n{EXIT_STATUS}```" in docs
    codes = [line.split()[0] for line in EXIT_STATUS.splitlines()[1:] if not line.startswith("     ")]
    assert codes == ["0", str(EXIT_FAILED), str(EXIT_USAGE), str(EXIT_OUTPUT_CLOSED)]


def test_png_without_cairosvg_says_how_to_get_it(traced, tmp_path):
    try:
        import cairosvg  # noqa: F401
    except (ImportError, OSError):
        (done,) = graphfuse_batch(["report", str(traced), "--out", str(tmp_path / "l.png"), "--format", "png"])
        assert_one_line_error(done, 2, "graphfuse[png]")
    else:
        (done,) = graphfuse_batch(["report", str(traced), "--out", str(tmp_path / "l.png"), "--format", "png"])
        assert done.returncode == 0 and (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_dependencies_are_declared_exactly_as_imported():
    """Every third-party module graphfuse imports is a declared dependency (an optional extra for
    imports that say how to get it: png, and hf for graphfuse.integrations), and every declared
    dependency is imported."""
    import tomllib
    from importlib import metadata

    root = ROOT
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}

    declared = names(project["dependencies"])
    optional = names(project["optional-dependencies"]["png"]) | names(project["optional-dependencies"]["hf"])
    owners = metadata.packages_distributions()
    imported = set()
    for f in [*(root / "graphfuse").rglob("*.py"), *(root / "passes").rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            tops = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if (isinstance(node, ast.ImportFrom) and node.level == 0)
                else []
            )
            for top in (t.split(".")[0] for t in tops):
                if top not in sys.stdlib_module_names and top != "graphfuse":
                    imported |= {d.lower() for d in owners.get(top, [top])}
    assert imported - optional == declared, (imported, declared)


def test_a_factory_file_python_cannot_import_is_a_usage_error(tmp_path):
    from graphfuse.cli.args import UsageError
    from graphfuse.cli.trace import load_factory

    (tmp_path / "model.txt").write_text("def make(): pass\n")
    with pytest.raises(UsageError, match=r"model\.txt: Python cannot import it \(expected a \.py file\)"):
        load_factory(f"{tmp_path / 'model.txt'}:make")
