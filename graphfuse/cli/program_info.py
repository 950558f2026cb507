"""`graphfuse program info`: a saved program's passes, ranks, layout, signature and op counts."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from graphfuse.ir.layout import BucketLayout
from graphfuse.ir.program import Program
from graphfuse.program_files.files import FORMAT_NAME
from graphfuse.program_files.store import read_program


def cli_info(path: str, code: bool = False) -> int:
    """Print the summary of the program at `path` (and its graph's code with `code`)."""
    program, manifest = read_program(path)
    console = Console()
    console.print(
        f"[bold]{path}[/bold]: {FORMAT_NAME} v{manifest['version']}, written by graphfuse "
        f"{manifest.get('graphfuse_version')} on torch {manifest.get('torch_version')}",
        highlight=False,
    )
    console.print(
        f"rank {program.rank} of {program.world_size}, process group {program.group_name or '-'}; "
        f"optimizer {program.optim.cls_name}, param groups: {len(program.optim.groups)}"
    )
    console.print("files: " + ", ".join(f"{name} {entry['bytes']:,} B" for name, entry in manifest["files"].items()))
    console.print("passes: " + " → ".join(program.pass_names))
    if program.layout is not None:
        console.print(_layout_table(program.layout))
    console.print(_signature_table(program))
    t = Table(title=f"ops ({sum(1 for _ in program.graph.nodes)} nodes)")
    t.add_column("op")
    t.add_column("count", justify="right")
    ops = Counter(
        str(getattr(n.target, "_overloadpacket", n.target)) for n in program.graph.nodes if n.op == "call_function"
    )
    for name, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
        t.add_row(name, str(n))
    console.print(t)
    if code:
        print(program.graph_module.print_readable(print_output=False), end="")  # valid Python, never wrapped
    return 0


def _layout_table(layout: BucketLayout) -> Table:
    t = Table(
        title=f"layout {layout.fingerprint}: {len(layout.buckets)} buckets, align {layout.align_bytes} B, cap "
        f"{layout.bucket_bytes} B"
    )
    for col in ("bucket", "dtype", "group", "params", "elements", "bytes", "shard elements"):
        t.add_column(col, justify="left" if col in ("bucket", "dtype") else "right")
    for b in layout.buckets:
        t.add_row(b.name, b.dtype, str(b.group), str(len(b.slots)), f"{b.size:,}", f"{b.nbytes:,}", f"{b.shard_size:,}")
    return t


def _signature_table(program: Program) -> Table:
    t = Table(title="signature")
    for col in ("kind", "role"):
        t.add_column(col)
    t.add_column("count", justify="right")
    for kind, specs in (("input", program.signature.inputs), ("output", program.signature.outputs)):
        counts: dict[str, int] = {}
        for s in specs:
            counts[s.role] = counts.get(s.role, 0) + 1
        for role, n in counts.items():
            t.add_row(kind, role, str(n))
    return t
