"""Overlap report: where a graphfuse step issues and waits for each collective, the compute time
between the two, and the communication exposed at N GPUs as modelled from a bus-bandwidth table;
the same model applied to a DDP + ZeroRedundancyOptimizer schedule and an FSDP2-like schedule.

    python tools/overlap_report.py --device cpu --preset tiny            # a small GPT, both gather modes
    python tools/overlap_report.py --device cuda --preset gpt2 --executor inductor --json out.json
    python tools/overlap_report.py --program prog_dir --device cpu        # a saved program
    python tools/overlap_report.py --replay out.json --busbw all_gather=360  # predict again from a report

How it measures. The step runs on the local device under a fake process group of the traced
world size (torch's "fake" backend: collectives return at once), so the time measured is pure
compute. With `--executor inductor` the schedule is read from inductor's generated wrapper code
(the order of kernels, collective calls and wait_tensor calls; each call is matched to its FX
node through the "Topologically Sorted Source Nodes" comment) and a timing mark (device
synchronise + clock) is inserted before each issue and after each wait; with `--executor eager`
the FX graph's order is the schedule and an fx.Interpreter takes the same marks. The step is
also timed without marks, and the marks' mean cost is taken off each time for every mark before
it (`without_mark_cost`): synchronising stalls the device, which mattered at 190 marks. Plain FX
traversal is all the dependency analysis needs (which node is a collective, its bucket, its
wait), so no graph library is used. The model and the measuring live in graphfuse.analysis
(tests/passes/test_overlap_report.py pins them); this file is its command line and its printing.

How it models. A collective of S bytes (the whole bucket: reduce-scatter input, all-gather
output) at N GPUs takes latency + S·(N−1)/N / busbw (all-gather, reduce-scatter) or
latency + 2·S·(N−1)/N / busbw (all-reduce): NCCL-tests' definition of bus bandwidth. Collectives
run one at a time in issue order on one communication stream; a wait stalls compute until its
collective ends. Exposed communication = the sum of stalls; predicted step = compute + exposed.
The update's compute (after the last reduce-scatter issue) is scaled by traced_world/N, as it
runs on a 1/N shard; the spans that follow an all-gather's issue or wait (issuing it, copying
the gathered buckets into the parameters: N-independent) are not.

Bus bandwidth defaults (GB/s, `--busbw`), for one 8-GPU NVLink/NVSwitch host (H100/H200 SXM;
both have NVLink 4 at 450 GB/s per direction per GPU):
- all_reduce 470: the middle of the 460-480 GB/s busbw that "NCCL-tests in practice"
  (docs.alayanew.com tech blog, 2026-05-06) gives for all_reduce_perf on 8xH100 SXM5 at large sizes.
- all_gather and reduce_scatter 450: no published all_gather_perf/reduce_scatter_perf figure was
  at hand; 450 GB/s is NVLink 4's per-direction limit, an upper bound, so their modelled times are
  lower bounds (pass measured figures with --busbw).
The same figures are used at N = 2 and 4 (on an NVSwitch host busbw varies little with N for
large messages: an assumption). Latency: 10 us per collective (an assumption, --latency-us).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

import graphfuse as gf
from graphfuse import analysis
from graphfuse.passes import run_pipeline
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

PRESETS = {
    "tiny": dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64),
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def trace_gpt(args, group: str) -> dict[str, object]:
    """A GPT's step captured once and rewritten with and without the deferred all-gather."""
    cfg = GPTConfig(
        **{
            **PRESETS[args.preset],
            **{k: v for k, v in vars(args).items() if k in GPTConfig.__dataclass_fields__ and v is not None},
        }
    )
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device, torch.bfloat16 if args.master else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    batch = tuple(x.to(args.device) for x in synthetic_tokens(cfg, args.batch, 1, seed=0)[0])
    programs = {}
    for mode, deferred in (("end_of_step_gather", False), ("deferred_gather", True)):
        strategy = gf.Strategy(
            bucket_size_mb=args.bucket_mb,
            master_dtype=torch.float32 if args.master else None,
            max_inflight_collectives=None,
            stage_collectives_on_host=False,
            overlap_param_gather=deferred,
        )
        program = gf.capture(model, opt, gpt_loss, batch, strategy).with_(
            world_size=args.world, rank=0, group_name=group
        )
        programs[mode] = run_pipeline(
            program.with_(graph_module=torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph)))
        )
    return programs


def print_report(out: dict) -> None:
    for mode, r in out["modes"].items():
        print(f"\n{mode}: compute {r['compute_ms']:.2f} ms per step (no communication)")
        print(
            f"  {'bucket':8} {'op':15} {'MB':>8} {'issue ms':>9} {'wait ms':>9} {'between':>9} {'issue@':>7} "
            f"{'wait@':>7}  modelled ms at N=" + ",".join(out["ns"])
        )
        for b in r["buckets"]:
            for c in b["collectives"]:
                model = " ".join(f"{c['modelled_ms'][n]:.2f}" for n in out["ns"])
                where = f"{c['issue_position']:>7} {c['wait_position']:>7}"
                print(
                    f"  {b['bucket']:8} {c['op']:15} {c['bytes'] / 2**20:8.1f} {c['issue_ms']:9.2f} "
                    f"{c['wait_ms']:9.2f} {c['compute_between_ms']:9.2f} {where}  {model}"
                )
        print(
            f"  (issue@/wait@: {'kernels' if out['executor'] == 'inductor' else 'FX ops'} before it, of "
            f"{r['schedule_length']})"
        )
        if r.get("timing_marks"):
            m = r["timing_marks"]
            print(
                f"  (timing marks: {m['marks']} marks took {m['mark_cost_us']:.0f} us each, taken off the times above; "
                f"the step ran {m['marked_ms']:.2f} ms with them, {m['plain_ms']:.2f} ms without)"
            )
    print(
        f"\npredicted step ms / exposed communication ms (busbw GB/s {out['busbw_GBps']}, latency "
        f"{out['latency_us']} us)"
    )
    print(f"  {'schedule':20} " + " ".join(f"{'N=' + n:>16}" for n in out["ns"]))
    for name, by_n in out["predicted"].items():
        print(f"  {name:20} " + " ".join(f"{by_n[n]['step_ms']:8.2f}/{by_n[n]['exposed_ms']:7.2f}" for n in out["ns"]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", help="a saved program (gf.save_program) instead of tracing a GPT")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for flag in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--master", action="store_true", help="bf16 parameters with fp32 master shards")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--executor", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--world", type=int, default=8, help="world size the step is traced and timed at")
    ap.add_argument("--ns", default="2,4,8", help="world sizes to model")
    ap.add_argument("--busbw", default="", help="e.g. all_gather=360,reduce_scatter=360,all_reduce=470 (GB/s)")
    ap.add_argument("--latency-us", type=float, default=analysis.LATENCY_US)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument(
        "--replay",
        help="a report written with --json: predict again from its measured schedules "
        "(other --busbw, --latency-us or --ns, or a changed model) without tracing or running anything",
    )
    ap.add_argument("--code-dir", help="write the code the schedule was read from here, one file per mode")
    args = ap.parse_args(argv)
    busbw = {**analysis.BUSBW_GBPS, **{k: float(v) for k, v in (kv.split("=") for kv in args.busbw.split(",") if kv)}}
    ns = [int(n) for n in args.ns.split(",")]
    if args.replay:
        with open(args.replay) as f:
            saved = json.load(f)
        return finish(
            {k: saved[k] for k in ("device", "executor", "traced_world")},
            analysis.measured_from_report(saved),
            args,
            ns,
            busbw,
        )
    torch.set_flush_denormal(True)  # random weights must not run into slow denormal arithmetic
    if args.program:
        program = analysis.on_fake_group(gf.load_program(args.program))
        programs = {
            "deferred_gather" if program.strategy.overlap_param_gather is True else "end_of_step_gather": program
        }
    else:
        programs = trace_gpt(args, analysis.fake_group(args.world))
    measured = {}
    for mode, program in programs.items():
        measured[mode], code = analysis.measure(program, args.device, args.executor, args.reps)
        if args.code_dir:  # the schedule as read: inductor's wrapper code with the marks, or the FX code
            os.makedirs(args.code_dir, exist_ok=True)
            with open(os.path.join(args.code_dir, f"{mode}.py"), "w") as f:
                f.write(code)
    header = {
        "device": args.device,
        "executor": args.executor,
        "traced_world": next(iter(programs.values())).world_size,
    }
    return finish(header, measured, args, ns, busbw)


def finish(header: dict, measured: dict[str, analysis.Measured], args, ns: list[int], busbw: dict) -> dict:
    """The report of `measured` under the model's settings: printed, written to --json, returned."""
    out = {
        **header,
        "config": vars(args),
        "ns": [str(n) for n in ns],
        "busbw_GBps": busbw,
        "latency_us": args.latency_us,
        **analysis.report(measured, ns, busbw, args.latency_us * 1e-6),
    }
    print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
