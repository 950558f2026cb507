"""Capture time and graph size of one GPT training step (forward, backward, AdamW) at 12, 24
and 48 layers (n_embd=256) on CPU: gf.capture alone, and the whole gf.compile pipeline.

    python tools/bench_capture.py [--layers 12 24 48] [--repeat 2]
    python tools/bench_capture.py --llama-1b   # a 1.1B Llama-shaped step on the meta device
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _bench import machine_facts, print_report  # tools/_bench.py: what the benches share
from rich.table import Table

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens


def setup(n_layer: int) -> tuple[GPT, torch.optim.Optimizer, tuple]:
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=n_layer, n_head=8, n_embd=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4
    )
    return model, optimizer, synthetic_tokens(cfg, 2, 1, seed=0)[0]


def best_of(repeat: int, fn) -> tuple[float, float, object]:
    """Best wall-clock and best CPU (process) time of `repeat` calls, and the last result.
    CPU time is the steadier of the two when the machine is shared."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu, out


def llama_1b() -> dict:
    """Capture and gf.compile (world size 1) of a TinyLlama-1.1B-shaped step (22 layers, hidden
    2048, GQA 32/4 heads, vocab 32000, AdamW, batch 1 x 128 tokens). Parameters live on the
    meta device and capture traces with fake tensors, so no parameter memory is allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        use_cache=False,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")

    def loss_fn(m, b):
        return m(input_ids=b[0], labels=b[1]).loss

    capture_s, capture_cpu, program = best_of(1, lambda: gf.capture(model, optimizer, loss_fn, (ids, ids)))
    compile_s, compile_cpu, dm = best_of(1, lambda: gf.compile(model, optimizer, loss_fn, (ids, ids)))
    return {
        "model": "llama-1.1b (meta)",
        "params": sum(p.numel() for p in model.parameters()),
        "nodes": len(program.graph.nodes),
        "capture_s": round(capture_s, 2),
        "capture_cpu_s": round(capture_cpu, 2),
        "compile_s": round(compile_s, 2),
        "compile_cpu_s": round(compile_cpu, 2),
        "compiled_nodes": len(dm.program.graph.nodes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    ap.add_argument("--repeat", type=int, default=2, help="report the best of this many runs")
    ap.add_argument("--llama-1b", action="store_true", help="only the 1.1B Llama-shaped row (meta device)")
    args = ap.parse_args()
    if args.llama_1b:
        print(json.dumps({"bench": "capture", "machine": machine_facts(), "row": llama_1b()}))
        return

    machine = machine_facts()
    rows = []
    for n_layer in args.layers:
        model, optimizer, batch = setup(n_layer)
        gf.capture(*setup(2)[:2], gpt_loss, batch)  # warm torch's dispatch caches once
        capture_s, capture_cpu, program = best_of(args.repeat, lambda: gf.capture(model, optimizer, gpt_loss, batch))  # noqa: B023
        nodes = len(program.graph.nodes)

        def full(n_layer=n_layer):
            m, o, b = setup(n_layer)
            return gf.compile(m, o, gpt_loss, b)

        compile_s, compile_cpu, dm = best_of(args.repeat, full)
        rows.append(
            {
                "n_layer": n_layer,
                "params": sum(p.numel() for p in model.parameters()),
                "nodes": nodes,
                "capture_s": round(capture_s, 3),
                "capture_cpu_s": round(capture_cpu, 3),
                "capture_us_per_node": round(capture_s / nodes * 1e6, 1),
                "compile_s": round(compile_s, 3),
                "compile_cpu_s": round(compile_cpu, 3),
                "compiled_nodes": len(dm.program.graph.nodes),
            }
        )
    base = rows[0]
    for r in rows:
        r["per_node_vs_first"] = round(r["capture_us_per_node"] / base["capture_us_per_node"], 3)
        r["cpu_per_node_vs_first"] = round(
            (r["capture_cpu_s"] / r["nodes"]) / (base["capture_cpu_s"] / base["nodes"]), 3
        )

    table = Table(
        title=f"gf.capture / gf.compile of a GPT step (n_embd=256, AdamW), {machine['cpus']} CPUs, torch "
        f"{machine['torch']}"
    )
    columns = [
        ("layers", "n_layer"),
        ("params", "params"),
        ("nodes", "nodes"),
        ("capture s", "capture_s"),
        ("capture cpu s", "capture_cpu_s"),
        ("µs/node", "capture_us_per_node"),
        (f"per node vs {base['n_layer']}", "per_node_vs_first"),
        (f"cpu per node vs {base['n_layer']}", "cpu_per_node_vs_first"),
        ("compile s", "compile_s"),
        ("compile cpu s", "compile_cpu_s"),
        ("compiled nodes", "compiled_nodes"),
    ]
    for title, _ in columns:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for _, k in columns))
    print_report(
        [table, f"machine: {machine['platform']}, {machine['cpu']}, python {machine['python']}"],
        {"bench": "capture", "machine": machine, "rows": rows},
        width=160,
    )


if __name__ == "__main__":
    main()
