"""The compile settings a worker process (graphfuse/compiler/workers.py) must share with the
main process for its compiles to land under the cache keys the main process looks up:
inductor's and functorch's configs, the inductor settings graphfuse adds for its programs
(graphfuse.compiler.inductor's COMPILE_SPEED and FIRST_STEP, as this process has them), torch's
precision and determinism flags and thread count (C++ kernels are generated for it), and
inductor's cache directory."""

from __future__ import annotations

import os

import torch

from graphfuse.compiler import inductor


def caches_on() -> bool:
    """Whether a compile in another process reaches this one (inductor's FX graph cache and
    AOTAutograd's cache are on)."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._functorch.config as fconfig
    import torch._inductor.config as config

    return bool(config.fx_graph_cache and fconfig.enable_autograd_cache and not config.force_disable_caches)


def settings() -> dict:
    """What changes a compile's cache key and lives in this process: inductor's and functorch's
    configs, the float32 precision, reduced-precision and determinism flags, the thread count,
    the cache directory."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._functorch.config as fconfig
    import torch._inductor.config as config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {
        "inductor": config.save_config(),
        "programs": {"COMPILE_SPEED": dict(inductor.COMPILE_SPEED), "FIRST_STEP": dict(inductor.FIRST_STEP)},
        "functorch": fconfig.save_config(),
        "flags": _flags(),
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
        "threads": torch.get_num_threads(),  # C++ kernels are generated for this many
        "cache_dir": cache_dir(),
    }


# torch's global flags that reach the generated code or the cache key (where this torch has
# them): the legacy ones first, then their newer forms, which read whatever the legacy ones set
# (reading a legacy one after setting a newer one raises).
FLAGS = (
    ("torch.backends.cuda.matmul", "allow_tf32"),
    ("torch.backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("torch.backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    ("torch.backends.cudnn", "allow_tf32"),
    ("torch.backends", "fp32_precision"),
    ("torch.backends.cuda.matmul", "fp32_precision"),
    ("torch.backends.cudnn", "fp32_precision"),
)


def _flags() -> dict:
    out = {}
    for owner, name in FLAGS:
        try:
            out[f"{owner}.{name}"] = getattr(_owner(owner), name)
        except (AttributeError, RuntimeError):  # not in this torch, or a legacy flag after the newer API set it
            pass
    return out


def _owner(path: str):
    """The object a dotted path from `torch` names (torch.backends.cuda.matmul is not a module)."""
    owner = torch
    for part in path.split(".")[1:]:
        owner = getattr(owner, part)
    return owner


def apply(s: dict) -> None:
    """Take the main process's `settings()`. A flag is set only where it differs: setting one
    of torch's precision flags to its own value can change how the others read."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._functorch.config as fconfig
    import torch._inductor.config as config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = s["cache_dir"]
    config.load_config(s["inductor"])
    # compile_graph reads these at every compile: a process that changed them (to tune pointwise
    # kernels again, say) has its workers compile as it does, not under graphfuse's defaults.
    inductor.COMPILE_SPEED, inductor.FIRST_STEP = (
        dict(s["programs"]["COMPILE_SPEED"]),
        dict(s["programs"]["FIRST_STEP"]),
    )
    fconfig.load_config(s["functorch"])
    for key, value in s["flags"].items():  # in FLAGS' order
        owner, name = key.rsplit(".", 1)
        if _flags().get(key) != value:
            setattr(_owner(owner), name, value)
    if [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()] != s[
        "deterministic"
    ]:
        torch.use_deterministic_algorithms(s["deterministic"][0], warn_only=s["deterministic"][1])
    torch.set_num_threads(s["threads"])
