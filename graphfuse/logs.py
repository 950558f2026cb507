"""graphfuse's logging: the "graphfuse" logger says each phase once per job (at INFO on rank 0,
at DEBUG on the other ranks), and GRAPHFUSE_LOG=debug|info|warning|error|off sets its level
without code; `logging.getLogger("graphfuse")` configures it as any library's logger."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from graphfuse.errors import GraphfuseError

LOGGER = "graphfuse"
ENV = "GRAPHFUSE_LOG"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 1,
}


def rank() -> int:
    """This process's rank, read when a record is emitted (the process group is usually made after
    graphfuse is imported): the default group's rank if one is initialised, else the RANK variable
    torchrun sets, else 0. Never imports torch.distributed itself."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankZeroInfo(logging.Filter):
    """On every rank but 0, an INFO record becomes a DEBUG one, so that N ranks print each phase's
    line once. A logger's filters run after its level check, made for the level the record was
    created at; so the demoted record is dropped here unless the logger is enabled for DEBUG (as
    a `log.debug` call would be). Past here, Logger.callHandlers compares the new levelno with
    each handler's level, so a handler set to INFO drops it too. A filter on a logger sees only
    the records made on that logger, not its children's: graphfuse's INFO lines are all made on
    "graphfuse" itself ("graphfuse.passes" logs the graph after each pass below DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or rank() == 0:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class _RankFormatter(logging.Formatter):
    """Each line of GRAPHFUSE_LOG's handler names its rank: at DEBUG every rank prints."""

    def format(self, record: logging.LogRecord) -> str:
        record.rank = rank()
        return super().format(record)


def level_from(value: str | None) -> int | None:
    """The level GRAPHFUSE_LOG's `value` names (None when unset or empty); a GraphfuseError
    naming the variable and the choices for anything else, so that a typo is not silent."""
    if value is None or not value.strip():
        return None
    level = LEVELS.get(value.strip().lower())
    if level is None:
        raise GraphfuseError(
            f"{ENV}={value!r}: not a level; set it to one of {', '.join(LEVELS)}, or unset it to configure "
            f'logging.getLogger("{LOGGER}") yourself'
        )
    return level


def install(environ: Mapping[str, str] = os.environ) -> None:
    """Put RankZeroInfo on the "graphfuse" logger (once), and apply GRAPHFUSE_LOG when it is set:
    the logger's level, and a handler to stderr if the logger has none of its own. That handler
    is the logger's only output (propagate off, as torch's TORCH_LOGS does), so a root handler
    from logging.basicConfig does not print every line twice."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, RankZeroInfo) for f in logger.filters):
        logger.addFilter(RankZeroInfo())
    level = level_from(environ.get(ENV))
    if level is None:
        return
    logger.setLevel(level)
    if level <= logging.CRITICAL and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_RankFormatter("[rank%(rank)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
