"""`graphfuse report PATH --out FILE`: one self-contained HTML page (inline SVG and CSS, no
network, no JavaScript) with the bucket layout, the step's schedule and inspect's tables; or,
with `--format svg|png`, the bucket layout picture alone."""

from __future__ import annotations

from importlib import metadata, resources
from pathlib import Path

import jinja2

from graphfuse.cli.args import UsageError
from graphfuse.cli.facts import node_phases
from graphfuse.cli.inspect import load
from graphfuse.cli.svg import layout_svg, schedule_svg

PNG_EXTRA = "pip install 'graphfuse[png]'  (cairosvg, and the cairo library: apt-get install libcairo2)"


def render_html(facts: dict, phases: list[str]) -> str:
    template = resources.files("graphfuse.cli").joinpath("report.html.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    after = facts["nodes"]["after_passes"]
    before = facts["nodes"]["before_passes"] or {}
    return env.from_string(template).render(
        f=facts,
        layout_svg=layout_svg(facts),
        schedule_svg=schedule_svg(phases, facts["collectives"]),
        phases=sorted(set(after) | set(before)),
        version=metadata.version("graphfuse"),
    )


def write_png(svg: str, out: Path) -> None:
    try:  # optional (the png extra), so imported only for --format png
        import cairosvg
    except (ImportError, OSError) as e:  # OSError: cairosvg installed but the cairo library missing
        raise UsageError(
            f"--format png needs cairosvg ({type(e).__name__}: {e}); {PNG_EXTRA}, or use --format svg"
        ) from None
    cairosvg.svg2png(bytestring=svg.encode(), write_to=str(out), output_width=None, scale=2.0)


def run_report(args) -> int:
    program, facts = load(args.path, args.rank)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory for --out")
    if args.format == "html":
        out.write_text(render_html(facts, node_phases(program)), encoding="utf-8")
    elif args.format == "svg":
        out.write_text(layout_svg(facts) + "\n", encoding="utf-8")
    else:
        write_png(layout_svg(facts), out)
    print(f"wrote {out} ({out.stat().st_size:,} bytes: {args.format}, rank {facts['rank']} of {facts['world_size']})")
    return 0
