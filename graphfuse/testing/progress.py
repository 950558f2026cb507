"""Which step each rank has reached, as one small file per rank: a run past its timeout can then be
told apart, slow (every rank still moving) or hung (a rank's last step long ago). tools/soak.py uses it."""

from __future__ import annotations

import time
from pathlib import Path


def heartbeat(progress: str | Path, rank: int, step: int) -> None:
    """Record that `rank` finished `step` now (written whole: a reader never sees half a line)."""
    path = Path(progress) / f"rank{rank}"
    path.with_suffix(".tmp").write_text(f"{step} {time.time()}")
    path.with_suffix(".tmp").replace(path)


def reached(progress: str | Path, ranks: int) -> dict[int, str]:
    """Each rank's last recorded step and how long ago: "step 1234, 5s ago", or "no step finished"."""
    now, out = time.time(), {}
    for r in range(ranks):
        try:
            step, at = (Path(progress) / f"rank{r}").read_text().split()
            out[r] = f"step {step}, {now - float(at):.0f}s ago"
        except (OSError, ValueError):
            out[r] = "no step finished"
    return out
