"""graphfuse.analysis.kernels (tools/kernel_launches.py prints it): kernels defined and launched in
inductor's output code."""

from __future__ import annotations

import torch

from graphfuse import analysis as kl

# The shape of a CUDA output module (abridged): two kernel families, one launched per block.
MODULE = '''
triton_poi_fused_cat_view_86 = async_compile.triton('triton_poi_fused_cat_view_86', """
def triton_poi_fused_cat_view_86(in_ptr0, out_ptr0, xnumel, XBLOCK):
    pass
""", device_str='cuda')

triton_poi_fused_cat_view_87 = async_compile.triton('triton_poi_fused_cat_view_87', """
""", device_str='cuda')

triton_per_fused_native_layer_norm_backward_view_78 = async_compile.triton('triton_per_fused_native_layer_norm_backward_view_78', """
""", device_str='cuda')


class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        # Topologically Sorted Source Nodes: [mm]; triton_poi_fused_cat_view_86.run(never)
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        buf1 = torch.ops.aten._scaled_dot_product_efficient_attention.default(arg0_1, arg0_1, arg0_1)
        triton_poi_fused_cat_view_86.run(buf0, buf2, 64, stream=stream0)
        triton_poi_fused_cat_view_87.run(buf0, buf2, 64, stream=stream0)
        triton_poi_fused_cat_view_86.run(buf0, buf3, 64, stream=stream0)
        triton_per_fused_native_layer_norm_backward_view_78.run(buf3, buf4, 768, 64, stream=stream0)
        extern_kernels.mm(buf4, arg1_1, out=buf5)
        return (buf5, )


def benchmark_compiled_module(args, times=10, repeat=10):
    triton_poi_fused_cat_view_86.run(not_a_launch_of_the_step)
'''


def test_counts_definitions_launches_and_calls_of_the_step_only():
    m = kl.analyse(MODULE)
    assert m["kernels"] == 3 and m["kinds"] == {"poi": 2, "per": 1}
    # Launches inside `call` only: not in comments, not in the benchmark helper after it.
    assert m["launches"] == 4
    assert m["families"] == {"triton_poi_fused_cat_view": 3, "triton_per_fused_native_layer_norm_backward_view": 1}
    assert m["extern_calls"] == {"mm": 2}
    assert m["aten_calls"] == {"aten._scaled_dot_product_efficient_attention": 1}


def test_reads_the_cpu_code_inductor_writes(tmp_path):
    from torch._inductor.utils import run_and_get_code

    def f(a, b, c, d, e):
        return torch.cat([(a @ b).view(-1), (c @ d).view(-1), e.sum(0)])

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(f), *(torch.randn(16, 16) for _ in range(5)))
    module = tmp_path / "out.py"
    module.write_text(code[0])
    [found] = kl.output_modules(tmp_path)
    m = kl.analyse(found.read_text())
    assert m["extern_calls"] == {"mm": 2}  # the two matrix products; the cat and sum are C++ kernels
    assert m["kernels"] >= 1 and m["kinds"] == {"cpp": m["kernels"]}
    assert m["launches"] == m["kernels"] == sum(m["families"].values())
