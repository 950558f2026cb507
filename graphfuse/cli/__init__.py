"""The `graphfuse` command: trace a training step into per-rank programs, inspect and draw
programs and checkpoints, run the demo, convert checkpoints (docs/cli.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from importlib import metadata

from graphfuse.cli.args import CliFailure, UsageError, add_demo_arguments, add_trace_arguments
from graphfuse.errors import GraphfuseError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `cat` in `cat big | head`
# Printed by `graphfuse --help` and quoted word for word in docs/cli.md (a test holds them equal).
EXIT_STATUS = """\
exit status:
  0    done
  1    the command ran and failed: a damaged or refused input (a program file, a checkpoint
       record or data file), a factory that raised, a check that differs, a rank that failed,
       an unexpected error
  2    a usage error: a bad option or value, a path that does not exist or is neither a
       program nor a checkpoint, a factory that is not there
  141  stdout was closed before everything was written (`graphfuse inspect --json | head`):
       the command stops quietly, as `cat` killed by SIGPIPE does
"""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (the usage itself is one `--help` away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    def of(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"graphfuse {of('graphfuse')} (torch {of('torch')}, Python {sys.version.split()[0]})"


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the traceback too"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(
        prog="graphfuse",
        description=f"{__doc__}\n\n{EXIT_STATUS}",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, run, parent=sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(run=run)
        return p

    add_trace_arguments(
        command("trace", "capture FACTORY's training step and save the rewritten program of each rank", _trace)
    )
    _inspect_arguments(
        command("inspect", "a program's or a checkpoint's buckets, collectives, memory and passes", _inspect)
    )
    _report_arguments(command("report", "an HTML page (SVG pictures and tables) of a program or trace output", _report))

    add_demo_arguments(
        command("demo", "train a small GPT on CPU ranks with graphfuse, save and reload both checkpoint modes", _demo)
    )

    ckpt = command("ckpt", "inspect or convert a checkpoint", None)
    ck = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="COMMAND")
    info = command("info", "mode, world size, layout, tensors and files of a checkpoint, verified", _ckpt_info, ck)
    info.add_argument("path")
    info.add_argument("--no-verify", action="store_true", help="skip the size and checksum checks of the files")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    conv = command("convert", "convert an unbalanced checkpoint to a balanced one (one process)", _ckpt_convert, ck)
    conv.add_argument("src")
    conv.add_argument("dst", help="must not exist")
    conv.add_argument("--to", default="balanced", choices=("balanced",))

    prog = command("program", "summarise a saved program (see also inspect)", None)
    pg = prog.add_subparsers(dest="program_command", required=True, metavar="COMMAND")
    pinfo = command("info", "passes, layout, signature and op counts of a program directory", _program_info, pg)
    pinfo.add_argument("path")
    pinfo.add_argument("--code", action="store_true", help="also print the graph as valid Python with shapes")
    pinfo.add_argument("--json", action="store_true", help="print inspect's JSON object instead")
    return parser


def _inspect_arguments(insp: argparse.ArgumentParser) -> None:
    insp.add_argument("path", help="a program directory, a `graphfuse trace` output, or a checkpoint")
    insp.add_argument("--rank", type=int, default=None, help="which rank's program of a trace output (default 0)")
    insp.add_argument("--code", action="store_true", help="print the program as valid Python with shapes instead")
    insp.add_argument("--no-verify", action="store_true", help="checkpoints: skip the size and checksum checks")
    insp.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    insp.add_argument(
        "--graph",
        metavar="FILE",
        default=None,
        help="programs: write the dataflow graph (FX nodes and the values between them) to FILE, "
        "GraphML (.graphml) or DOT (.dot) by its suffix, instead of printing",
    )


def _report_arguments(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("path", help="a program directory or a `graphfuse trace` output")
    rep.add_argument("--out", required=True, help="the file to write")
    rep.add_argument("--rank", type=int, default=None, help="which rank's program of a trace output (default 0)")
    rep.add_argument(
        "--format",
        choices=("html", "svg", "png"),
        default="html",
        help="html: the whole page; svg or png: the bucket layout picture alone (png needs graphfuse[png])",
    )


# Commands import their own modules (trace's models, the demo's ranks, rich tables) when they run,
# so that `--help` and usage errors skip them.
def _trace(args) -> int:
    from graphfuse.cli.trace import run_trace

    return run_trace(args)


def _inspect(args) -> int:
    from graphfuse.cli.inspect import run_inspect

    return run_inspect(args)


def _report(args) -> int:
    from graphfuse.cli.report import run_report

    return run_report(args)


def _demo(args) -> int:
    print("graphfuse demo: loading torch and graphfuse", flush=True)  # an import takes seconds: say so first
    from graphfuse.cli.demo import run_demo

    return run_demo(args)


def _ckpt_info(args) -> int:
    from graphfuse.cli import ckpt as checkpoint_cli

    return checkpoint_cli.cli_info(args.path, verify=not args.no_verify, as_json=args.json)


def _ckpt_convert(args) -> int:
    from graphfuse.cli import ckpt as checkpoint_cli

    return checkpoint_cli.cli_convert(args.src, args.dst, args.to)


def _program_info(args) -> int:
    if args.json:
        from graphfuse.cli.inspect import run_inspect

        return run_inspect(
            argparse.Namespace(path=args.path, rank=None, code=False, no_verify=False, json=True, graph=None)
        )
    from graphfuse.cli.program_info import cli_info

    return cli_info(args.path, code=args.code)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _exit_status(e: Exception) -> tuple[int, str]:
    """The exit status of an error and its one line."""
    if isinstance(e, UsageError):  # the command line: a path that is not there, a wrong option
        return EXIT_USAGE, _one_line(e)
    if isinstance(e, CliFailure | GraphfuseError):  # the command ran and failed: a damaged file, a refused model
        return EXIT_FAILED, _one_line(e)
    return EXIT_FAILED, f"{type(e).__name__}: {_one_line(e)} (unexpected: rerun with --debug for the traceback)"


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (EXIT_STATUS)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # what a closed pipe refuses may still be buffered (`--help` | head)
    except BrokenPipeError:
        return _output_closed()


def _output_closed() -> int:
    """The reader of stdout has gone (`| head`): stop without a word. As the Python docs advise
    (signal module, "Note on SIGPIPE"), stdout is pointed at /dev/null, so that the interpreter's
    last flush at exit does not fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (redirected in-process)
        pass
    return EXIT_OUTPUT_CLOSED


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("graphfuse: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed: not an error of the command (main stops quietly)
        raise
    except Exception as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        status, line = _exit_status(e)
        print(f"graphfuse: error: {line}", file=sys.stderr)
        return status
