"""Which parameters belong to a repeated block (a transformer layer) that gets buckets of its
own under Strategy.align_buckets_to_blocks: identical blocks then lie at identical bucket
offsets, and inductor compiles their kernels once (graphfuse.ir.layout.plan_buckets does the
placing)."""

from __future__ import annotations

import re
from collections import Counter

from graphfuse.errors import UnsupportedError
from graphfuse.ir.layout import ParamInfo, itemsize

# The first numbered module of an FQN ("transformer.h.3" of "transformer.h.3.attn.c_attn.weight").
BLOCK = re.compile(r"^(.*?\.\d+)\.")

# Under align_buckets_to_blocks="auto", a block gets buckets of its own only when it holds at
# least this many bytes: smaller blocks' kernels compile fast, and a bucket each would multiply
# the collectives (a 1000-layer stack of small layers would issue 1000 reduce-scatters).
MIN_ALIGNED_BLOCK_BYTES = 1 << 20


def block_of(fqn: str) -> str | None:
    m = BLOCK.match(fqn)
    return m.group(1) if m else None


def aligned_blocks(params: list[ParamInfo], rule: bool | str) -> dict[str, str]:
    """FQN -> block, for the parameters of the blocks that get buckets of their own under
    Strategy.align_buckets_to_blocks = `rule`: every block for True, none for False; for "auto",
    the blocks that repeat (another block has the same parameters by relative name, shape,
    dtype and param group: their kernels are the ones inductor can share) and hold at least
    MIN_ALIGNED_BLOCK_BYTES."""
    if not (isinstance(rule, bool) or rule == "auto"):
        raise UnsupportedError(f"Strategy.align_buckets_to_blocks must be True, False or 'auto', got {rule!r}")
    if rule is False:
        return {}
    members: dict[str, list[tuple]] = {}
    size: Counter[str] = Counter()
    for p in params:
        if (b := block_of(p.fqn)) is not None:
            members.setdefault(b, []).append((p.fqn[len(b) :], p.shape, p.dtype, p.group))
            size[b] += p.numel * itemsize(p.dtype)
    if rule == "auto":
        shapes = {b: tuple(sorted(m)) for b, m in members.items()}
        repeats = Counter(shapes.values())
        members = {b: m for b, m in members.items() if repeats[shapes[b]] >= 2 and size[b] >= MIN_ALIGNED_BLOCK_BYTES}
    return {p.fqn: b for p in params if (b := block_of(p.fqn)) in members}
