"""bench_multigpu.py correctness
graphfuse vs an eager data-parallel reference on the same model, initial weights and
per-rank batches over --steps steps, in two variants:
- fp32: the reference is DDP + torch.optim.AdamW(foreach=False);
- bf16 params + Strategy(master_dtype=torch.float32): the reference keeps the model in
  bf16 and fp32 master copies that AdamW updates; its bf16 gradients are cast to fp32 and
  all-reduced (AVG) per parameter, and the masters are copied back into the bf16 model
  (DDP would all-reduce in bf16, which is not what graphfuse does).
Reports the max |loss diff| per step (max over ranks), the parameters' max |diff| after
the last step, and the optimizer state bytes per rank (graphfuse's shard tensors: AdamW's
exp_avg/exp_avg_sq and, with a master dtype, the fp32 master shard) against the
reference's unsharded state (its exp_avg/exp_avg_sq, plus the fp32 masters; the 0-d
`step` counters are left out). The ratio should be about 1/N (plus alignment padding).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from rich.table import Table

import graphfuse as gf
from graphfuse.testing.models import gpt_loss
from multigpu.common import LR, WD, batches_for, compile_mode, device_of, fresh_model, gpt_config, nbytes


def shard_bytes(dm: gf.DistModel) -> int:
    shards = {s.name for s in dm.program.signature.inputs if s.role == "shard"}
    return nbytes(t for n, t in dm.tensors.items() if n in shards)


def correctness_variant(args, master: bool) -> dict:
    device = device_of(args)
    cfg = gpt_config(args, "small")
    dtype = torch.bfloat16 if master else torch.float32
    batches = batches_for(cfg, args.batch or 8, args.steps, device)
    base = fresh_model(cfg, device, dtype)
    ref_model = copy.deepcopy(base)

    if master:
        masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
        ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, foreach=False)

        def ref_step(batch):
            ref_opt.zero_grad(set_to_none=True)
            ref_model.zero_grad(set_to_none=True)
            loss = gpt_loss(ref_model, batch)
            loss.backward()
            for p, m in zip(ref_model.parameters(), masters):
                m.grad = p.grad.float()
                dist.all_reduce(m.grad, op=dist.ReduceOp.AVG)
            ref_opt.step()
            with torch.no_grad():
                for p, m in zip(ref_model.parameters(), masters):
                    p.copy_(m)
            return loss.detach()

        ref_params = ref_model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        masters = []
        ddp = DDP(ref_model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
        ref_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD, foreach=False)

        def ref_step(batch):
            ref_opt.zero_grad(set_to_none=True)
            loss = gpt_loss(ddp, batch)
            loss.backward()
            ref_opt.step()
            return loss.detach()

        ref_params = ddp.module

    model = base
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    strategy = gf.Strategy(
        bucket_size_mb=args.bucket_mb, compile=compile_mode(args), master_dtype=torch.float32 if master else None
    )
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)

    diffs = []
    for batch in batches:
        ref_loss = ref_step(batch)
        loss = dm(batch)
        diffs.append((loss.double() - ref_loss.double()).abs().item())
    ref_named = dict(ref_params.named_parameters())
    param_diff = max((p.double() - ref_named[n].double()).abs().max().item() for n, p in model.named_parameters())

    state = [t for s in ref_opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
    unsharded = nbytes(state) + nbytes(masters)
    return {
        "loss_diffs": diffs,
        "param_diff": param_diff,
        "state_bytes": shard_bytes(dm),
        "unsharded_state_bytes": unsharded,
        "params": sum(p.numel() for p in model.parameters()),
        "buckets": len(dm.layout.buckets),
    }


def correctness(args) -> dict:
    return {"fp32": correctness_variant(args, master=False), "bf16_master": correctness_variant(args, master=True)}


def report_correctness(args, results: list[dict], where: str) -> tuple[dict, list]:
    n = args.world_size
    rows = {}
    for variant in ("fp32", "bf16_master"):
        per_rank = [r[variant] for r in results]
        per_step = [max(r["loss_diffs"][i] for r in per_rank) for i in range(args.steps)]
        state = [r["state_bytes"] for r in per_rank]
        unsharded = per_rank[0]["unsharded_state_bytes"]
        rows[variant] = {
            "max_loss_diff": max(per_step),
            "loss_diff_per_step": per_step,
            "param_diff": max(r["param_diff"] for r in per_rank),
            "state_bytes_per_rank": state,
            "unsharded_state_bytes": unsharded,
            "state_ratio": max(state) / unsharded,
            "one_over_n": 1 / n,
            "params": per_rank[0]["params"],
            "buckets": per_rank[0]["buckets"],
        }
    table = Table(
        title=f"correctness: graphfuse vs eager data parallel, {args.steps} steps, {n} ranks, {args.device} ({where})"
    )
    for col in (
        "variant",
        "params",
        "buckets",
        "max |loss diff|",
        "params max |diff|",
        "state B / rank",
        "unsharded B",
        "ratio",
        "1/N",
    ):
        table.add_column(col, justify="right")
    for variant, r in rows.items():
        table.add_row(
            variant,
            f"{r['params']:,}",
            str(r["buckets"]),
            f"{r['max_loss_diff']:.2e}",
            f"{r['param_diff']:.2e}",
            f"{max(r['state_bytes_per_rank']):,}",
            f"{r['unsharded_state_bytes']:,}",
            f"{r['state_ratio']:.4f}",
            f"{1 / n:.4f}",
        )
    return rows, [table]
