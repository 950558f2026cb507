"""The one exception hierarchy of graphfuse: every error names its subject and the way out."""


class GraphfuseError(Exception):
    """Base class of every error graphfuse raises on purpose."""


class UnsupportedError(GraphfuseError):
    """A model, optimizer or option graphfuse cannot compile (raised before any state changes)."""


class CheckpointError(GraphfuseError):
    """A checkpoint that cannot be saved or loaded; the live state is left untouched."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit this model's layout (world size, buckets, shapes)."""


class ProgramFormatError(GraphfuseError):
    """A program file that is missing, truncated, altered, too new, or names an unknown operator."""


class PassContractError(GraphfuseError):
    """A pass found the program it was given, or the one it made, breaking its contract (a bug
    in graphfuse or in a custom pipeline); the message names the pass and the passes before it."""


class VerifyError(GraphfuseError):
    """A pass produced a program that breaks an invariant (a bug in graphfuse); raised by
    graphfuse.passes.verify, which checks every program after the passes."""
