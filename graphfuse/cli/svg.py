"""The report's two pictures as SVG text: the bucket layout (a row per bucket, a column per rank's
shard, a segment per parameter, padding hatched) and the step's schedule (ops coloured by phase,
each collective drawn from where it is issued to where it is waited for)."""

from __future__ import annotations

import colorsys
import hashlib
from xml.sax.saxutils import escape, quoteattr

PHASE_COLOURS = {
    "input": "#d9d9d9",
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "optimizer": "#59a14f",
    "comm": "#e15759",
    "output": "#bab0ac",
    "other": "#9c755f",
}
SHORT_OPS = {
    "reduce_scatter_tensor": "reduce-scatter",
    "all_gather_into_tensor": "all-gather",
    "all_reduce": "all-reduce",
}
SHARD_W, ROW_H, GAP, LABEL_W, TOP = 260, 26, 12, 170, 34
HATCH = (
    '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    '<rect width="6" height="6" fill="#ffffff"/><line x1="0" y1="0" x2="0" y2="6" stroke="#999999" stroke-width="2"/>'
    "</pattern></defs>"
)


def colour(fqn: str) -> str:
    """A stable, light-enough colour per parameter name."""
    h = int(hashlib.sha1(fqn.encode()).hexdigest()[:6], 16)
    r, g, b = colorsys.hls_to_rgb(h % 360 / 360, (60 + h // 10800 % 18) / 100, (45 + h // 360 % 30) / 100)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"  # hex: every SVG renderer reads it


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12, extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>{escape(s)}</text>'


def _segments(bucket: dict, lo: int, hi: int):
    """(start, stop, fqn, is_padding) of every parameter's data and padding inside [lo, hi)."""
    for p in bucket["params"]:
        data = (p["offset"], p["offset"] + p["elements"])
        pad = (data[1], data[1] + p["padding"])
        for (a, b), padding in ((data, False), (pad, True)):
            a, b = max(a, lo), min(b, hi)
            if a < b:
                yield a, b, p["fqn"], padding


def _shard(bucket: dict, rank: int, x0: float, y: float) -> str:
    size = bucket["shard_elements"]
    lo, hi = rank * size, (rank + 1) * size
    parts = [f'<g class="shard" data-rank="{rank}">']
    for a, b, fqn, padding in _segments(bucket, lo, hi):
        x, w = x0 + SHARD_W * (a - lo) / size, max(SHARD_W * (b - a) / size, 0.5)
        fill = "url(#hatch)" if padding else colour(fqn)
        what = f"padding after {fqn}" if padding else fqn
        tip = f"{what}: {bucket['name']} elements [{a}, {b}), {b - a} elements in rank {rank}'s shard"
        cls = "padding" if padding else "param"
        parts.append(
            f'<rect class="{cls}" data-fqn={quoteattr(fqn)} x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_H - 6}" '
            f'fill="{fill}" stroke="#ffffff" stroke-width="0.5"><title>{escape(tip)}</title></rect>'
        )
        name = ".".join(fqn.split(".")[-2:])
        if not padding and w > 6.5 * len(name) + 6:  # the name fits: show it without hovering
            parts.append(_text(x + 3, y + 14, name, size=10, extra=' pointer-events="none"'))
    parts.append(f'<rect x="{x0}" y="{y}" width="{SHARD_W}" height="{ROW_H - 6}" fill="none" stroke="#333333"/></g>')
    return "".join(parts)


def layout_svg(facts: dict) -> str:
    """Buckets as rows, ranks' shards as columns; hover a segment for its parameter."""
    world, buckets = facts["world_size"], facts["buckets"]
    width = LABEL_W + world * (SHARD_W + GAP)
    height = TOP + len(buckets) * ROW_H + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="layout" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        HATCH,
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for r in range(world):
        x = LABEL_W + r * (SHARD_W + GAP)
        out.append(_text(x + SHARD_W / 2, 20, f"rank {r}'s shard", "middle", 13, ' class="column"'))
    for i, b in enumerate(buckets):
        y = TOP + i * ROW_H
        out.append(f'<g class="bucket" data-bucket="{b["name"]}">')
        out.append(_text(4, y + 14, f"{b['name']} ({b['dtype']}, {b['elements']:,})", size=12))
        out.extend(_shard(b, r, LABEL_W + r * (SHARD_W + GAP), y) for r in range(world))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def schedule_svg(phases: list[str], collectives: list[dict], width: int = 1000) -> str:
    """One thin bar per node in order, coloured by phase; below, a lane per collective from
    its issue to its wait."""
    n = max(len(phases), 1)
    lanes = len(collectives)
    left, bar_h, lane_h = 150, 36, 14
    height = 60 + bar_h + lanes * lane_h + 30
    total_w = left + width + 20

    def x(i: float) -> float:
        return left + width * i / n

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="schedule" width="{total_w}" height="{height}" '
        f'viewBox="0 0 {total_w} {height}" font-family="sans-serif">'
    ]
    for j, (phase, colour) in enumerate(PHASE_COLOURS.items()):
        out.append(f'<rect x="{left + j * 120}" y="6" width="12" height="12" fill="{colour}"/>')
        out.append(_text(left + j * 120 + 16, 16, phase))
    out.append(_text(4, 40 + bar_h / 2, f"ops in order ({len(phases)})"))
    for i, phase in enumerate(phases):
        out.append(
            f'<rect class="op" x="{x(i):.2f}" y="30" width="{max(width / n, 0.6):.2f}" height="{bar_h}" '
            f'fill="{PHASE_COLOURS.get(phase, PHASE_COLOURS["other"])}"><title>node {i}: {escape(phase)}</title></rect>'
        )
    for k, c in enumerate(collectives):
        y = 30 + bar_h + 10 + k * lane_h
        end = c["waited"] if c["waited"] is not None else c["issued"]
        label = f"{SHORT_OPS.get(c['op'], c['op'])} {c['bucket'] or ''}".strip()
        tip = (
            f"{c['op']} {c['bucket'] or ''}: {c['bytes'] or '?'} bytes, issued at node {c['issued']}, "
            f"waited at node {c['waited']}"
        )
        out.append(_text(left - 6, y + 9, label, "end", 10))
        out.append(
            f'<g class="collective"><title>{escape(tip)}</title><rect x="{x(c["issued"]):.2f}" y="{y}" '
            f'width="{max(x(end + 1) - x(c["issued"]), 2):.2f}" height="{lane_h - 4}" '
            f'fill="{PHASE_COLOURS["comm"]}"/></g>'
        )
    out.append(_text(left, height - 6, "step start", size=10))
    out.append(_text(left + width, height - 6, "step end", "end", 10))
    out.append("</svg>")
    return "\n".join(out)
