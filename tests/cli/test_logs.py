"""graphfuse's logging (graphfuse.logs): on real Gloo ranks spawned with GRAPHFUSE_LOG set, rank 0
says each phase at INFO and rank 1 at DEBUG only; the variable sets the level and a stderr handler;
a value that is not a level fails loudly."""

from __future__ import annotations

import logging

import pytest

from graphfuse import logs
from graphfuse.errors import GraphfuseError
from tests._common import run_ranks


class _Kept(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def _compile_and_log(rank: int, world_size: int) -> dict:
    import sys

    import torch

    import graphfuse as gf

    logger = logging.getLogger("graphfuse")
    found = {
        "level": logger.level,
        "propagate": logger.propagate,
        "stderr": [h.stream is sys.stderr for h in logger.handlers],
    }  # as GRAPHFUSE_LOG=debug left them
    at_info, every = _Kept(logging.INFO), _Kept(logging.NOTSET)
    logger.addHandler(at_info)
    logger.addHandler(every)
    model = torch.nn.Linear(4, 2)
    gf.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), torch.randn(3, 4))
    logger.setLevel(logging.INFO)  # as a user who asks for INFO: rank 1 makes no record at all
    logger.info("graphfuse: a phase at INFO")
    return {**found, "at_info": at_info.records, "every": every.records}


def test_rank_0_logs_each_phase_at_info_and_rank_1_at_debug(monkeypatch):
    monkeypatch.setenv(logs.ENV, "debug")  # read when each spawned rank imports graphfuse
    rank0, rank1 = run_ranks(_compile_and_log, 2)
    for found in (rank0, rank1):
        assert (found["level"], found["propagate"], found["stderr"]) == (logging.DEBUG, False, [True])
    compiled = [m for level, m in rank0["at_info"] if m.startswith("graphfuse.compile:")]
    assert len(compiled) == 1 and ("INFO", "graphfuse: a phase at INFO") in rank0["at_info"], rank0["at_info"]
    assert not [r for r in rank1["at_info"] if r[0] == "INFO"], rank1["at_info"]
    assert [level for level, m in rank1["every"] if m.startswith("graphfuse.compile:")] == ["DEBUG"]
    assert "graphfuse: a phase at INFO" not in [m for _, m in rank1["every"]]


def test_the_rank_comes_from_rank_before_the_process_group_exists(monkeypatch):
    logger, kept, level = logging.getLogger("graphfuse"), _Kept(logging.NOTSET), logging.getLogger("graphfuse").level
    logger.setLevel(logging.INFO)
    logger.addHandler(kept)
    try:
        for rank in ("1", "0"):
            monkeypatch.setenv("RANK", rank)  # what torchrun sets
            logger.info("phase on RANK=%s", rank)
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)
    assert kept.records == [("INFO", "phase on RANK=0")]


@pytest.mark.parametrize("value, level", [("off", logging.CRITICAL + 1), ("WARNING", logging.WARNING), ("", None)])
def test_graphfuse_log_names_a_level(value, level):
    assert logs.level_from(value) == level


def test_a_graphfuse_log_that_is_not_a_level_fails_loudly():
    with pytest.raises(GraphfuseError, match=r"GRAPHFUSE_LOG='verbose': not a level; set it to one of debug, info"):
        logs.level_from("verbose")
