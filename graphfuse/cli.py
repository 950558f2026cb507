"""The `graphfuse` command: the demo, and offline tools for checkpoints and program files."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small GPT on CPU ranks with graphfuse, save and reload both checkpoint modes")
    demo.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    demo.add_argument("--layers", type=int, default=2, help="transformer blocks")
    demo.add_argument("--d-model", type=int, default=64, help="embedding width")
    demo.add_argument("--bucket-mb", type=float, default=0.25, help="bucket size cap in MiB")
    demo.add_argument("--steps", type=int, default=30, help="training steps")
    demo.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank, NCCL)")
    demo.add_argument("--compile", default="eager", choices=("eager", "inductor"), help="how the program runs")
    demo.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one)")

    ckpt = sub.add_parser("ckpt", help="inspect or convert a checkpoint")
    ck = ckpt.add_subparsers(dest="ckpt_command", required=True)
    info = ck.add_parser("info", help="mode, world size, layout fingerprint, tensors and bytes")
    info.add_argument("path")
    conv = ck.add_parser("convert", help="convert an unbalanced checkpoint to a balanced one (one process)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--to", default="balanced", choices=("balanced",))

    prog = sub.add_parser("program", help="inspect a saved program")
    pg = prog.add_subparsers(dest="program_command", required=True)
    pinfo = pg.add_parser("info", help="passes, layout, signature and op counts of a program file")
    pinfo.add_argument("path")
    pinfo.add_argument("--code", action="store_true", help="also print the graph's Python code")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from graphfuse.errors import GraphfuseError

    try:
        if args.command == "demo":
            from graphfuse.demo import run_demo

            return run_demo(args)
        if args.command == "ckpt":
            from graphfuse import checkpoint_cli

            if args.ckpt_command == "info":
                return checkpoint_cli.cli_info(args.path)
            return checkpoint_cli.cli_convert(args.src, args.dst, args.to)
        if args.command == "program":
            from graphfuse.program_files.info import cli_info

            return cli_info(args.path, code=args.code)
    except GraphfuseError as e:
        print(f"graphfuse: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
