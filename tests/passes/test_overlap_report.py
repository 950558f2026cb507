"""The overlap model (graphfuse.analysis) and tools/overlap_report.py over it: the model's arithmetic
on hand-made cases, the instrumentation of inductor-style wrapper code, and the JSON of a run on a
tiny GPT (CPU, eager executor, in a subprocess: the tool initialises a fake process group)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import graphfuse as gf
from graphfuse import analysis as report
from graphfuse.passes import run_pipeline
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from tests._common import ROOT

BUSBW = {"all_gather": 100.0, "reduce_scatter": 100.0, "all_reduce": 200.0}


def test_collective_seconds_follow_the_bus_bandwidth_definition():
    # 1 GB at 4 GPUs, 100 GB/s bus bandwidth: an all-gather moves 3/4 GB per GPU -> 7.5 ms.
    assert report.collective_seconds("all_gather", 10**9, 4, BUSBW, 0.0) == pytest.approx(7.5e-3)
    assert report.collective_seconds("reduce_scatter", 10**9, 2, BUSBW, 1e-5) == pytest.approx(1e-5 + 5e-3)
    # all-reduce: 2 (N-1)/N of the bytes, here at 200 GB/s -> 1.5 * 1e9 / 2e11 = 7.5 ms.
    assert report.collective_seconds("all_reduce", 10**9, 4, BUSBW, 0.0) == pytest.approx(7.5e-3)


def test_simulate_stalls_at_waits_and_runs_collectives_one_at_a_time():
    collectives = [
        {"issue": 1.0, "wait": 3.0, "seconds": 5.0},  # ends at 6: the wait at 3 stalls 3
        {"issue": 2.0, "wait": 9.0, "seconds": 1.0},  # queued behind the first: 6..7; wait at 9+3: no stall
        {"issue": 10.0, "wait": 10.5, "seconds": 2.0},  # issued at 13 (shifted), ends 15, wait at 13.5: stalls 1.5
    ]
    step, exposed = report.simulate(12.0, collectives)
    assert exposed == pytest.approx(4.5)
    assert step == pytest.approx(16.5)
    assert report.simulate(12.0, []) == (12.0, 0.0)


WRAPPER = """
class Runner:
    def call(self, args):
        arg0_1, = args
        # Topologically Sorted Source Nodes: [addmm], Original ATen: [aten.addmm]
        extern_kernels.addmm(arg0_1, out=buf0)
        # Topologically Sorted Source Nodes: [mm_1, t_3], Original ATen: [aten.mm]
        extern_kernels.mm(buf0, out=buf1)
        # Topologically Sorted Source Nodes: [reduce_scatter_tensor_default], Original ATen: [_c10d_functional.reduce_scatter_tensor]
        buf2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf1, 'avg', 2, '0')
        # Topologically Sorted Source Nodes: [mm_2], Original ATen: [aten.mm]
        extern_kernels.mm(buf0, out=buf3)
        # Topologically Sorted Source Nodes: [wait_tensor_default], Original ATen: [_c10d_functional.wait_tensor]
        torch.ops._c10d_functional.wait_tensor.default(buf2)
        return (buf3,)
"""


def test_instrument_marks_issue_wait_and_backward_with_kernel_positions():
    phase = {"addmm": "forward", "mm_1": "backward", "t_3": "backward", "mm_2": "backward"}
    code = report.instrument(WRAPPER, {"reduce_scatter_tensor_default"}, phase)
    lines = [line.strip() for line in code.splitlines()]
    i_backward = lines.index("_gf_mark('backward')")
    i_issue = lines.index("_gf_mark('issue', 'reduce_scatter_tensor_default', 2)")
    i_wait = lines.index("_gf_mark('wait', 'reduce_scatter_tensor_default', 3)")
    assert lines[i_backward + 1].startswith("# Topologically Sorted Source Nodes: [mm_1")
    assert lines[i_issue + 1].startswith("buf2 = torch.ops._c10d_functional.reduce_scatter_tensor")
    assert lines[i_wait - 1].startswith("torch.ops._c10d_functional.wait_tensor.default(buf2)")
    assert i_backward < i_issue < i_wait and lines[-1] == "_GF_KERNELS = 3"


CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BUCKET_MB = 0.02


def expected_layout() -> gf.BucketLayout:
    """The layout the tool plans for the same GPT at world size 8 (planning needs no group)."""
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    batch = synthetic_tokens(cfg, 2, 1, seed=0)[0]
    program = gf.capture(model, opt, gpt_loss, batch, gf.Strategy(bucket_size_mb=BUCKET_MB))
    return run_pipeline(program.with_(world_size=8, rank=0, group_name="g")).layout


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("overlap") / "report.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in copy.deepcopy(CFG).items()]
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "overlap_report.py"),
        "--device=cpu",
        "--executor=eager",
        "--world=8",
        f"--bucket-mb={BUCKET_MB}",
        "--reps=1",
        "--busbw=all_gather=100,reduce_scatter=100,all_reduce=200",
        "--latency-us=5",
        f"--json={out}",
        *flags,
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    assert (
        "predicted step ms" in done.stdout and "end_of_step_gather: compute" in done.stdout
    )  # the tool prints its tables
    return json.loads(out.read_text())


def test_report_has_one_entry_per_bucket_with_the_bucket_bytes(tiny_report):
    layout = expected_layout()
    assert len(layout.buckets) > 2
    for mode in ("end_of_step_gather", "deferred_gather"):
        buckets = tiny_report["modes"][mode]["buckets"]
        assert [(b["bucket"], b["bytes"]) for b in buckets] == [(b.name, b.nbytes) for b in layout.buckets]
        for b in buckets:
            assert sorted(c["op"] for c in b["collectives"]) == ["all_gather", "reduce_scatter"]
            for c in b["collectives"]:
                assert c["bytes"] == b["bytes"]  # fp32 without master weights: the bucket itself
                assert c["wait_ms"] >= c["issue_ms"] and c["compute_between_ms"] == pytest.approx(
                    c["wait_ms"] - c["issue_ms"]
                )
                for n in ("2", "4", "8"):
                    assert c["modelled_ms"][n] == pytest.approx(
                        1e3 * (5e-6 + (int(n) - 1) / int(n) * c["bytes"] / 100e9)
                    )


def test_report_positions_show_where_each_mode_gathers(tiny_report):
    def positions(mode: str, op: str, key: str) -> list[int]:
        return [c[key] for b in tiny_report["modes"][mode]["buckets"] for c in b["collectives"] if c["op"] == op]

    # End of step: every all-gather after every reduce-scatter; deferred: every all-gather is
    # issued before any op of the step but the slices of the shards it gathers, and waited for
    # before any reduce-scatter.
    assert min(positions("end_of_step_gather", "all_gather", "issue_position")) > max(
        positions("end_of_step_gather", "reduce_scatter", "issue_position")
    )
    deferred = positions("deferred_gather", "all_gather", "issue_position")
    assert sorted(deferred) == list(range(1, len(deferred) + 1))
    assert max(positions("deferred_gather", "all_gather", "wait_position")) < min(
        positions("deferred_gather", "reduce_scatter", "issue_position")
    )
    # The reduce-scatters are issued inside the backward, not all at its end.
    rs = sorted(positions("end_of_step_gather", "reduce_scatter", "issue_position"))
    assert rs[0] < rs[-1]


def test_report_predicts_every_schedule_at_2_4_8(tiny_report):
    predicted = tiny_report["predicted"]
    assert set(predicted) == {"graphfuse", "graphfuse_deferred", "ddp_zero", "fsdp2"}
    for rows in predicted.values():
        assert set(rows) == {"2", "4", "8"}
        for r in rows.values():
            assert r["step_ms"] == pytest.approx(r["compute_ms"] + r["exposed_ms"])
            assert 0 <= r["exposed_ms"] <= r["comm_ms"] + 1e-9
    # At the traced world size (8) the timeline is used as measured: the prediction is the
    # simulation of the per-bucket entries, for both graphfuse modes.
    for mode, name in (("end_of_step_gather", "graphfuse"), ("deferred_gather", "graphfuse_deferred")):
        r = tiny_report["modes"][mode]
        # In the schedule's issue order, as the tool lists them: collectives issued at one time
        # (the marks' cost correction can make times equal) run in the order they were issued.
        issue_order = {e["node"]: i for i, e in enumerate(r["schedule"]) if e["kind"] == "issue"}
        entries = sorted((c for b in r["buckets"] for c in b["collectives"]), key=lambda c: issue_order[c["node"]])
        colls = [{"issue": c["issue_ms"], "wait": c["wait_ms"], "seconds": c["modelled_ms"]["8"]} for c in entries]
        step, exposed = report.simulate(r["compute_ms"], colls)
        assert predicted[name]["8"]["step_ms"] == pytest.approx(step) and predicted[name]["8"][
            "exposed_ms"
        ] == pytest.approx(exposed)
    # DDP + ZeRO's parameter exchange after the update is waited for where it is issued: its
    # modelled time (all parameters, as one all-gather) is exposed in full.
    params = sum(b["bytes"] for b in tiny_report["modes"]["end_of_step_gather"]["buckets"])
    assert (
        predicted["ddp_zero"]["8"]["exposed_ms"]
        >= 1e3 * report.collective_seconds("all_gather", params, 8, BUSBW, 5e-6) - 1e-9
    )


def test_the_timing_marks_cost_is_taken_off_every_event_after_them():
    # 3 inner marks; with marks the step took 10 s, without 7: each mark cost 1 s.
    events = [("start", "", 0.0), ("backward", "", 2.0), ("issue", "a", 4.0), ("wait", "a", 8.0), ("end", "", 10.0)]
    moved, cost = report.without_mark_cost(events, 7.0)
    assert [t for _, _, t in moved] == pytest.approx([0.0, 1.0, 2.0, 5.0, 7.0])
    assert cost == pytest.approx({"marked_ms": 1e4, "plain_ms": 7e3, "mark_cost_us": 1e6, "marks": 3})
    # Marks that cost nothing measurable (the plain run was as slow) move nothing; no event
    # moves before the one that precedes it.
    assert report.without_mark_cost(events, 11.0)[0] == events
    tight = [("start", "", 0.0), ("issue", "a", 0.5), ("wait", "a", 0.6), ("end", "", 3.0)]
    assert [t for _, _, t in report.without_mark_cost(tight, 1.0)[0]] == pytest.approx([0.0, 0.0, 0.0, 1.0])


def test_report_states_the_timing_marks_cost(tiny_report):
    for mode, r in tiny_report["modes"].items():
        m = r["timing_marks"]
        assert m["marks"] == len(r["schedule"]) - 2 > 0, mode
        assert m["plain_ms"] > 0 and m["mark_cost_us"] >= 0
        # The step's end moves to the unmarked time, or less far when the last marks are dense.
        assert min(m["plain_ms"], m["marked_ms"]) - 1e-6 <= r["compute_ms"] <= m["marked_ms"] + 1e-6


def test_only_the_update_is_scaled_to_another_world_size():
    # Traced at 8: the update runs from the last reduce-scatter issue (4 s) to the first
    # all-gather issue (6 s); at N = 2 it takes 4x as long (8 s). The all-gather's copies
    # after it (6 -> 9 s) cover whole buckets at any N: they move, unscaled.
    ops = {"rs": "reduce_scatter", "ag": "all_gather"}
    events = [
        ("start", "", 0.0),
        ("issue", "rs", 4.0),
        ("wait", "rs", 5.0),
        ("issue", "ag", 6.0),
        ("wait", "ag", 8.0),
        ("end", "", 9.0),
    ]
    moved = report.scale_update(events, ops, 8, 2)
    assert [t for _, _, t in moved] == pytest.approx([0.0, 4.0, 8.0, 12.0, 14.0, 15.0])
    assert report.scale_update(events, ops, 8, 8) == events
    # Interleaved, as inductor schedules it: bucket a's update (its reduce-scatter's wait to its
    # all-gather's issue) is scaled, the issue that follows is not, and so on; the tail after the
    # gathers' waits (their copies) is not.
    two = [
        ("start", "", 0.0),
        ("issue", "rs_a", 4.0),
        ("issue", "rs_b", 5.0),
        ("wait", "rs_a", 6.0),
        ("issue", "ag_a", 7.0),
        ("wait", "rs_b", 8.0),
        ("issue", "ag_b", 9.0),
        ("wait", "ag_a", 10.0),
        ("wait", "ag_b", 10.0),
        ("end", "", 11.0),
    ]
    ops2 = {"rs_a": "reduce_scatter", "rs_b": "reduce_scatter", "ag_a": "all_gather", "ag_b": "all_gather"}
    assert [t for _, _, t in report.scale_update(two, ops2, 8, 4)] == pytest.approx([0, 4, 5, 7, 9, 10, 12, 13, 13, 14])
    # Deferred gathers (issued at the head, before the reduce-scatters): the whole tail is the update.
    deferred = [
        ("start", "", 0.0),
        ("issue", "ag", 0.0),
        ("wait", "ag", 1.0),
        ("issue", "rs", 4.0),
        ("wait", "rs", 5.0),
        ("end", "", 6.0),
    ]
    assert [t for _, _, t in report.scale_update(deferred, ops, 8, 4)] == pytest.approx([0.0, 0.0, 1.0, 4.0, 6.0, 8.0])


def replay(saved: dict, busbw: dict[str, float], latency_us: float) -> dict:
    """The report of a saved run predicted again, as `overlap_report.py --replay` computes it
    (the latency from microseconds as the tool converts it, so that the floats are the same)."""
    ns = [int(n) for n in saved["ns"]]
    return report.report(report.measured_from_report(saved), ns, busbw, latency_us * 1e-6)


def test_replay_predicts_again_from_a_saved_report_without_running(tiny_report):
    saved = json.loads(json.dumps(tiny_report))  # through JSON, as --replay reads it
    same = replay(saved, BUSBW, 5)
    for name, rows in tiny_report["predicted"].items():
        for n, r in rows.items():
            assert same["predicted"][name][n] == pytest.approx(r), (name, n)
    assert same["modes"] == tiny_report["modes"]  # per-bucket entries rebuilt as measured
    # Other bandwidths: the same schedules, each collective modelled again (the tiny buckets'
    # times are mostly the 5 us latency, so a tenth of the bandwidth adds little).
    slower = replay(saved, {"all_gather": 10.0, "reduce_scatter": 10.0, "all_reduce": 20.0}, 5)
    for r in slower["modes"].values():
        for b in r["buckets"]:
            for c in b["collectives"]:
                assert c["modelled_ms"]["8"] == pytest.approx(
                    1e3
                    * report.collective_seconds(
                        c["op"], c["bytes"], 8, {c["op"]: 10.0 if c["op"] != "all_reduce" else 20.0}, 5e-6
                    )
                )
    for name in tiny_report["predicted"]:
        assert slower["predicted"][name]["8"]["comm_ms"] > tiny_report["predicted"][name]["8"]["comm_ms"]
        assert slower["predicted"][name]["8"]["exposed_ms"] >= tiny_report["predicted"][name]["8"]["exposed_ms"]
    # A replay measures nothing: it leaves the process's float state alone (a measuring run
    # flushes denormals, which broke later hypothesis tests when a replay ran in-process).
    assert torch.tensor(1e-40).item() != 0.0


def test_the_tool_replays_a_saved_report_from_the_command_line(tiny_report, tmp_path):
    saved, again = tmp_path / "report.json", tmp_path / "again.json"
    saved.write_text(json.dumps(tiny_report))
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "overlap_report.py"),
        "--replay",
        str(saved),
        f"--json={again}",
        "--busbw=all_gather=100,reduce_scatter=100,all_reduce=200",
        "--latency-us=5",
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    assert "predicted step ms" in done.stdout
    replayed = json.loads(again.read_text())
    for name, rows in tiny_report["predicted"].items():
        for n, r in rows.items():
            assert replayed["predicted"][name][n] == pytest.approx(r), (name, n)
