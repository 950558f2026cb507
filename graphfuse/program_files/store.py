"""`save_program` and `load_program`: a program's files written atomically, and read back
through every check (files, graph, metadata, layout, fake run) with the state plan derived."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import safetensors.torch
import torch
from safetensors import SafetensorError

from graphfuse._version import __version__
from graphfuse.errors import GraphfuseError, ProgramFormatError, UnsupportedError
from graphfuse.ir.program import Program
from graphfuse.passes import pass_name, serializer

from . import checks, fake_run
from .files import (
    CONSTANTS,
    GRAPH,
    MANIFEST,
    PROGRAM,
    json_bytes,
    manifest_bytes,
    open_dir,
    parse_json,
    read_listed,
    read_manifest,
    write_dir,
)
from .graph import graph_from_json, graph_to_json
from .limits import MAX_BYTES
from .metadata import program_from_json, program_to_json, upgrade_v1
from .values import Malformed, short

T = TypeVar("T")
# What decoding a damaged file can raise besides Malformed; each becomes a ProgramFormatError.
_DECODE_ERRORS = (
    Malformed,
    GraphfuseError,
    LookupError,
    TypeError,
    ValueError,
    AttributeError,
    RecursionError,
    OverflowError,
    RuntimeError,
)


def save_program(program: Program, path: str | os.PathLike) -> None:
    """Write `program` to the directory `path` (replaced atomically if it holds a program)."""
    nodes, constants = graph_to_json(program.graph_module, program.layout)
    # One node per line: readable, and a diff of two programs is a diff of their nodes.
    graph = (
        '{"nodes": [\n' + ",\n".join(json.dumps(n, allow_nan=False, ensure_ascii=False) for n in nodes) + "\n]}\n"
    ).encode()
    files = {PROGRAM: json_bytes(program_to_json(program)), GRAPH: graph}
    if constants:
        files[CONSTANTS] = safetensors.torch.save(constants)
    for name, data in files.items():
        if len(data) > MAX_BYTES[name]:
            raise UnsupportedError(
                f"cannot save the program: its {name} would be {len(data):,} bytes, over the format's limit "
                f"{MAX_BYTES[name]:,}"
            )
    files[MANIFEST] = manifest_bytes(files, torch.__version__, __version__)
    write_dir(Path(path), files)


def load_program(path: str | os.PathLike) -> Program:
    """Read a program written by `save_program` (format version 1 or 2). Runs no code from
    the file: JSON and safetensors only, call targets from an allowlist; any defect raises
    ProgramFormatError naming the file and the cause."""
    return read_program(path)[0]


def read_program(path: str | os.PathLike) -> tuple[Program, dict]:
    """The loaded program and its checked manifest."""
    path = Path(path)
    dir_fd = open_dir(path)
    try:
        manifest = read_manifest(dir_fd, path)
        data = read_listed(dir_fd, path, manifest)
    finally:
        os.close(dir_fd)
    version = manifest["version"]
    constants = _constants(path / CONSTANTS, data.get(CONSTANTS))
    graph_doc = parse_json(path / GRAPH, data[GRAPH])
    gm = _decoding(path / GRAPH, lambda: graph_from_json(graph_doc, constants, version))
    program_doc = parse_json(path / PROGRAM, data[PROGRAM])
    program = _decoding(path / PROGRAM, lambda: _assemble(program_doc, gm, version))
    fake_run.check(program, path)
    return _with_state_plan(program, path), manifest


def _decoding(where: Path, decode: Callable[[], T]) -> T:
    try:
        return decode()
    except ProgramFormatError:
        raise
    except _DECODE_ERRORS as e:
        what = str(e) if isinstance(e, Malformed) else f"malformed ({type(e).__name__}: {short(e)})"
        raise ProgramFormatError(f"{where}: {what}") from None


def _constants(where: Path, data: bytes | None) -> dict[str, torch.Tensor]:
    if data is None:
        return {}
    try:
        return safetensors.torch.load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError) as e:
        raise ProgramFormatError(f"{where}: not a safetensors file ({short(e)})") from None


def _assemble(doc, gm: torch.fx.GraphModule, version: int) -> Program:
    """The Program of program.json and the graph, with what version 2 leaves out derived:
    each placeholder's input spec is the signature's (version 1 files hold a copy)."""
    program = program_from_json(upgrade_v1(doc) if version == 1 else doc, gm)
    placeholders, inputs = program.placeholders(), program.signature.inputs
    if len(placeholders) != len(inputs):
        raise Malformed(f"the graph has {len(placeholders)} placeholders, the signature {len(inputs)} inputs")
    if version > 1:
        for node, spec in zip(placeholders, inputs):
            node.meta["gf_input"] = spec
    checks.inputs_fit(program)
    return program


def _with_state_plan(program: Program, path: Path) -> Program:
    """The checkpoint state plan is never read from the file: the serializer pass derives it
    from the loaded layout and signature, as it did when the program was built."""
    if pass_name(serializer) not in program.pass_names:
        return program
    try:
        serializer.requires(program)
        program = serializer.run(program)
        serializer.ensures(program)
    except Exception as e:  # the pass's contract checks, or anything the checked data still breaks
        raise ProgramFormatError(
            f"{path / PROGRAM}: the checkpoint state plan cannot be derived from the layout and signature "
            f"({type(e).__name__}: {short(e)})"
        ) from None
    return program
