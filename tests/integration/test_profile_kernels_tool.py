"""tools/profile_kernels.py: CUDA only. Here (no GPU) it must stop at once with a message saying
why and what to do; the kernel-kind classification it tables is checked on real kernel names."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests._common import ROOT

TOOL = ROOT / "tools" / "profile_kernels.py"


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA; this one has a GPU"
)
def test_without_cuda_it_exits_with_a_clear_message():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, str(TOOL), "--layers", "1"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "has no CUDA device" in done.stderr and "run it on a machine with an NVIDIA GPU" in done.stderr


def test_kernels_are_classified_by_kind():
    sys.path.insert(0, str(TOOL.parent))  # the tool imports tools/_bench.py as a sibling
    try:
        spec = importlib.util.spec_from_file_location("profile_kernels", TOOL)
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
    finally:
        sys.path.remove(str(TOOL.parent))
    names = {
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>": "attention",
        "triton_red_fused__log_softmax_backward_data_0": "triton",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "nccl",
        "Memcpy DtoD (Device -> Device)": "memcpy/set",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }
    assert {n: tool.kind_of(n) for n in names} == names
    assert set(names.values()) == set(tool.KINDS)
