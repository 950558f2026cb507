"""List the operators the tests' training steps contain after every pass, by namespace and
name: the source of the program-file op allowlist (graphfuse/program_files/ops.py).

Builds each model of the tests (MLPs, GPT, the checkpoint tests' net, conv + BatchNorm,
transformers Llama and BERT, and the zoo's models whose program files are tested: T5, GRU,
Mixtral) with
each supported optimizer and the strategies that add ops (world size 2, gradient clipping,
accumulation, fp32 master weights for bf16 parameters), runs the pass pipeline without a
process group, and prints the operator names as JSON. Compare with ops.admitted_names() (the explicit names plus the
op families):

    python tools/list_program_ops.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test models: tests.capture.test_capture, ...

import graphfuse as gf  # noqa: E402
from graphfuse import passes  # noqa: E402


def _models(quick: bool) -> dict:
    import tests.capture.test_capture as tc
    import tests.checkpoint.test_checkpoint as tck
    import tests.program_files.test_program_io as tpi
    import tests.runtime.test_zero1 as tz
    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    xy = (torch.randn(6, 8), torch.randn(6, 4))
    relu_mlp = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))  # noqa: E731
    models = {
        "mlp": (tc.MLP, tc.mlp_loss, tc.mlp_batches(1)[0]),
        "mlp_mse": (tpi.mlp, tpi.mse, xy),  # test_program_io, and test_runtime/test_backend with ReLU
        "relu_mlp_mse": (relu_mlp, tpi.mse, xy),
        "zero1_mlp": (tz.MLP, tz.mlp_loss, tz.mlp_batches(0, torch.float32)[0]),
        "checkpoint_net": (tck.Net, tck.loss_fn, tck.batch(0, 0)),
        "gpt": (lambda: GPT(cfg), gpt_loss, synthetic_tokens(cfg, 2, 1, seed=0)[0]),
        "convnet": (tc.ConvNet, tc.mlp_loss, tc.conv_batches(1)[0]),
    }
    if not quick:
        models["llama"] = (tc.tiny_llama, tc.hf_lm_loss, tc.token_batches(1)[0])
        models["bert"] = (_bert, tc.hf_lm_loss, tc.token_batches(1)[0])
        import tests.integration.test_zoo as tzoo

        for name in tzoo.SAVED_PROGRAMS:
            make, loss_fn, batch_of = tzoo.ZOO[name]
            models[name] = (make, loss_fn, batch_of(0, 0))
    return models


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return BertForMaskedLM(cfg)


def _ops(program: gf.Program) -> set[str]:
    return {
        f"{n.target.namespace}.{n.target._opname}"
        if isinstance(n.target, torch._ops.OpOverload)
        else f"{n.target.__module__}.{n.target.__name__}"
        for n in program.graph.nodes
        if n.op == "call_function"
    }


def _to(batch, device: str, dtype: torch.dtype | None = None):
    return tuple(
        b.to(device=device, dtype=dtype if dtype is not None and b.is_floating_point() else b.dtype) for b in batch
    )


def collect(quick: bool = False, device: str = "cpu") -> set[str]:
    import tests.capture.test_capture as tc

    found: set[str] = set()
    strategies = [dict(), dict(max_grad_norm=1.0, grad_accumulation=2), dict(master_dtype=torch.float32)]
    for name, (make_model, loss_fn, batch) in _models(quick).items():
        for make_optim in (tc.adamw, tc.adam_amsgrad, tc.sgd_nesterov, tc.sgd_dampening):
            for strategy in strategies:
                torch.manual_seed(0)
                model, inputs = make_model().to(device), _to(batch, device)
                if "master_dtype" in strategy:
                    model = model.to(torch.bfloat16)
                    inputs = _to(batch, device, torch.bfloat16)
                opt = make_optim(model)
                program = gf.capture(model, opt, loss_fn, inputs, gf.Strategy(bucket_size_mb=0.01, **strategy))
                found |= _ops(program)
                program = program.with_(world_size=2, rank=0, group_name="fake")
                found |= _ops(passes.run_pipeline(program))
            print(f"{name} {make_optim.__name__}: {len(found)} ops so far", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the MLPs, GPT and conv net (no transformers)")
    parser.add_argument("--device", default="cpu", help="where the models and batches live (cpu, cuda)")
    args = parser.parse_args()
    found = collect(args.quick, args.device)
    by_namespace: dict[str, list[str]] = {}
    for op in sorted(found):
        namespace, _, name = op.rpartition(".")
        by_namespace.setdefault(namespace, []).append(name)
    print(json.dumps(by_namespace, indent=1))


if __name__ == "__main__":
    main()
