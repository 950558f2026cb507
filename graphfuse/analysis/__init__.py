"""What the tools measure and tests pin about a program, beyond running it: the overlap model of
its collectives (overlap, timeline) and the kernels inductor generates for it (kernels)."""

from graphfuse.analysis.kernels import analyse, family, output_modules
from graphfuse.analysis.overlap import (
    BUSBW_GBPS,
    LATENCY_US,
    Collective,
    Measured,
    collective_seconds,
    collectives_of,
    measured_from_report,
    report,
    scale_update,
    simulate,
)
from graphfuse.analysis.timeline import fake_group, instrument, measure, on_fake_group, without_mark_cost

__all__ = [
    "BUSBW_GBPS",
    "LATENCY_US",
    "Collective",
    "Measured",
    "analyse",
    "collective_seconds",
    "collectives_of",
    "family",
    "fake_group",
    "instrument",
    "measure",
    "measured_from_report",
    "on_fake_group",
    "output_modules",
    "report",
    "scale_update",
    "simulate",
    "without_mark_cost",
]
