"""Start-up phases of a DistModel (capture, passes, verify, bind, inductor, first step): timed
here, logged at INFO on the "graphfuse" logger by gf.compile and by the first step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator


class Phases(dict):
    """Seconds spent in each start-up phase, by name."""

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t

    def format(self, names: Iterable[str]) -> str:
        return ", ".join(f"{n} {self[n]:.2f} s" for n in names if n in self)
