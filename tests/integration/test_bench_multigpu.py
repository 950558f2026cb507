"""tools/bench_multigpu.py end to end on 2 Gloo ranks with a tiny GPT: every code path but the
NCCL/CUDA specifics (kernel names, max_memory_allocated, inductor), asserted on the JSON line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests._common import ROOT

TINY = [
    "--device",
    "cpu",
    "--world-size",
    "2",
    "--layers",
    "1",
    "--embd",
    "32",
    "--heads",
    "2",
    "--vocab",
    "64",
    "--block",
    "16",
    "--batch",
    "2",
]


def bench(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, os.path.join(str(ROOT), "tools", "bench_multigpu.py"), *args, *TINY],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["world_size"] == 2 and record["device"] == "cpu" and "Gloo" in record["machine"]
    return record


def test_correctness_matches_eager_data_parallel_and_shards_state():
    r = bench("correctness", "--steps", "4")["results"]
    for variant in ("fp32", "bf16_master"):
        v = r[variant]
        assert len(v["loss_diff_per_step"]) == 4
        assert v["max_loss_diff"] <= 1e-6, v  # eager on CPU at 2 ranks: bitwise (0.0) when measured
        assert v["param_diff"] <= 1e-6, v
        assert len(v["state_bytes_per_rank"]) == 2
        # 1/N of AdamW's state (and of the fp32 masters), plus this tiny model's alignment padding.
        assert 0.5 <= v["state_ratio"] <= 0.56, v
    # bf16 + master: the reference's unsharded total counts its fp32 masters besides AdamW's
    # two fp32 states (graphfuse's third shard; its bf16 bucket pads to more elements, as the
    # alignment is in bytes, so its per-rank bytes are not exactly 3/2 of fp32's).
    assert r["bf16_master"]["unsharded_state_bytes"] == r["fp32"]["unsharded_state_bytes"] * 3 // 2
    assert r["bf16_master"]["state_bytes_per_rank"][0] >= r["fp32"]["state_bytes_per_rank"][0] * 3 // 2


def test_comm_reports_bytes_and_a_bandwidth_ratio():
    # bf16 + fp32 master: the reduce-scatter and the all-gather move different dtypes.
    record = bench(
        "comm", "--steps", "2", "--warmup", "1", "--iters", "3", "--bucket-mb", "0.02", "0.1", "--dtype", "bf16"
    )
    r = record["results"]
    assert set(r) == {"0.02", "0.1"}
    for mb, res in r.items():
        rs, ag = res["reduce_scatter"], res["all_gather"]
        assert rs["dtype"] == "float32" and ag["dtype"] == "bfloat16"  # fp32 reduce, bf16 parameters
        assert rs["collectives_per_step"] == ag["collectives_per_step"] == len(rs["bytes"]) == len(ag["bytes"])
        # The reduce-scatter moves each bucket in fp32, the all-gather in bf16: twice the bytes.
        assert rs["bytes"] == [2 * b for b in ag["bytes"]]
        # Every parameter's bytes are in some bucket (plus padding), no bucket passes the size.
        assert res["param_bytes"] <= sum(ag["bytes"]) <= res["param_bytes"] * 1.2
        assert all(b <= float(mb) * 2**20 for b in ag["bytes"]) or len(ag["bytes"]) == 1
        for k in (rs, ag):
            assert k["events_expected"] == 2 * k["collectives_per_step"]
            assert all(n > 0 for n in k["events_seen_per_rank"])
            assert math.isfinite(k["ratio"]) and k["ratio"] > 0
            assert k["busbw_in_step_GBps"] > 0 and k["busbw_alone_GBps"] > 0
    assert r["0.02"]["all_gather"]["collectives_per_step"] > r["0.1"]["all_gather"]["collectives_per_step"] == 1


def test_step_compares_three_methods():
    record = bench("step", "--models", "gpt2-small", "1b", "--steps", "2", "--warmup", "1", "--profile-steps", "1")
    for preset in ("gpt2-small", "1b"):
        r = record["results"][preset]
        assert set(r["methods"]) == {"graphfuse", "ddp_zero", "fsdp2"}
        for m in r["methods"].values():
            assert m["tokens_per_s"] > 0 and m["median_step_ms"] > 0
            assert m["peak_bytes_per_rank"] is None  # not measured on CPU
        g = r["methods"]["graphfuse"]
        assert g["tokens_per_s_vs_graphfuse"] == 1.0
        assert g["exposed_comm_share"] is not None and g["exposed_comm_share"] >= 0
        assert r["graphfuse_vs_best_peer"] > 0
        assert r["config"]["n_layer"] == 1 and r["config"]["batch_per_rank"] == 2
