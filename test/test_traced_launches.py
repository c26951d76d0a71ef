"""kernels/launch.py: a traced launch adds its kernel to torch's Triton kernel side table once,
and a launch on real tensors never does.

Inductor walks that global table, parsing every kernel's source, at each graph it compiles, so
an entry per traced launch would make a model's compile slower with its number of linears and
with every compile before it. The launchers are traced here as Inductor traces a ``triton_op``'s
body (make_fx over fake tensors): no kernel runs, so CPU tensors do.
"""

import pytest
import torch
from conftest import linear_operands
from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper, kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from nvfp4_static.kernels.act_quantize import NUM_WARPS, _activation_quantize_kernel, launch_activation_quantize
from nvfp4_static.kernels.gemm import GemmConfig, launch_nvfp4_gemm
from nvfp4_static.kernels.launch import traceable

CONFIGS = [GemmConfig(16, 32, 64, num_warps=4, num_stages=2), GemmConfig(32, 64, 64, num_warps=8, num_stages=3)]


def operand_then_gemm(config):
    """The Triton route's two launches for one table entry, as a function make_fx can trace."""

    def route(x, weight_qdata, weight_block_scales, act_scale, weight_scale):
        operand = torch.empty(x.shape, dtype=torch.float16)
        launch_activation_quantize(x, act_scale, None, None, operand)
        out = torch.empty(x.shape[0], weight_qdata.shape[0], dtype=x.dtype)
        launch_nvfp4_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, None, out, config)
        return out

    return route


def traced_kernels(config, inputs):
    """The side-table entries the traced route's launches name, and the table's size after."""
    graph = make_fx(operand_then_gemm(config), tracing_mode="fake")(*inputs)
    indices = [
        node.kwargs["kernel_idx"]
        for node in graph.graph.nodes
        if node.op == "call_function" and "kernel_idx" in node.kwargs
    ]
    return [kernel_side_table.get_kernel(index) for index in indices], len(kernel_side_table.id_to_kernel)


@pytest.fixture
def inputs():
    operands = linear_operands(4, 64, 128, seed=0)
    return (operands.x, operands.weight_qdata, operands.weight_block_scales, operands.act_scale, operands.weight_scale)


def test_tracing_a_launch_again_adds_nothing_to_the_kernel_side_table(inputs):
    first, size_after_first = traced_kernels(CONFIGS[0], inputs)
    for _ in range(3):
        again, size = traced_kernels(CONFIGS[0], inputs)
        assert size == size_after_first
        assert [id(kernel) for kernel in again] == [id(kernel) for kernel in first]


def test_each_traced_launch_carries_its_own_launch_options(inputs):
    """The options leave the launch's arguments for the kernel object: one object per kernel and
    options, holding exactly those."""
    seen = {}
    for config in CONFIGS:
        (quantize, gemm), _ = traced_kernels(config, inputs)
        assert [c.num_warps for c in quantize.configs] == [NUM_WARPS]
        assert [(c.num_warps, c.num_stages) for c in gemm.configs] == [(config.num_warps, config.num_stages)]
        seen[config] = (quantize, gemm)
    (quantize_a, gemm_a), (quantize_b, gemm_b) = seen.values()
    assert quantize_a is quantize_b
    assert gemm_a is not gemm_b


def test_a_launch_on_real_tensors_hands_triton_the_kernel_itself():
    """Outside tracing, torch's wrapper would route each launch through its tracing machinery,
    adding a kernel object to the side table at every launch (each weight quantized at convert,
    an opaque op's kernels at every call of a compiled graph)."""
    kernel = _activation_quantize_kernel
    assert traceable(kernel) is kernel
    with FakeTensorMode():
        assert isinstance(traceable(kernel), TraceableTritonKernelWrapper)
    assert traceable(kernel) is kernel
