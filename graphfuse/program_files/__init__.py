"""Program files: a rewritten per-rank `Program` saved as plain JSON and safetensors, and
loaded back without running any code from the file (docs/program-format.md, version 2).

values: the typed value codec; ops: the op allowlist; layers: a node's layer, for errors;
graph: graph.json; metadata and checks: program.json; files: the manifest and safe reads;
fake_run: the last check; store: save and load.
"""

from __future__ import annotations

from .files import FORMAT_NAME, FORMAT_VERSION
from .store import load_program, read_program, save_program

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "load_program", "read_program", "save_program"]
