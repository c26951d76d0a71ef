"""kernels/act_quantize.py and its ops: the Triton activation quantizer is bit-identical to
numerics.quantize_nvfp4.

On CPU the kernel runs under the Triton interpreter (in a child process, see triton_interpreter);
on a CUDA machine the same checks run compiled, at real sizes.
"""

import pytest
import torch
from conftest import DTYPE_IDS, DTYPES, requires_cuda, smallest_accepted_per_tensor_scale
from triton_interpreter import run_interpreted

from nvfp4_static.kernels.act_quantize import launch_activation_quantize
from nvfp4_static.kernels.ops import (
    deinterleave_blocks,
    gemm_activation_operand,
    quantize_activation_nvfp4,
    runs_eagerly,
)
from nvfp4_static.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    dequantize_nvfp4,
    e4m3_positive_values,
    quantize_nvfp4,
    scale_reciprocal_overflows,
)

LAUNCHER = "nvfp4_static.kernels.act_quantize:launch_activation_quantize"


def wide_range_activation(M: int, K: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks spanning 2^-20 .. 2^12 around a global scale set at a quarter of the amax, so that
    the largest blocks saturate (scale clamped at 448, codes at +-6) and the smallest hit the
    2^-6 scale floor; plus an all-zero and an all-(-0.0) block where K leaves room for them."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=generator) * torch.exp2(torch.linspace(-20, 12, K))
    if K >= 48:
        x[:, :16] = 0.0
        x[:, 16:32] = -0.0
    x = x.to(dtype)
    per_tensor_scale = x.abs().max().float() / (E4M3_MAX * E2M1_MAX) / 4
    return x, per_tensor_scale


def rounding_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks whose scale, or whose scaled elements, fall exactly halfway between two
    representable values (per-tensor scale 1, so the arithmetic is exact): one block per pair of
    neighbouring normal FP8 scales, then one block of every E2M1 midpoint, both signs."""
    normals = e4m3_positive_values()[7:]
    midpoints = (normals[:-1] + normals[1:]) / 2
    scale_ties = torch.zeros(len(midpoints), 16)
    scale_ties[:, 0] = 6.0 * midpoints
    scale_ties[:, 1] = 0.3
    e2m1_midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    element_ties = torch.cat([torch.tensor([6.0]), e2m1_midpoints, -e2m1_midpoints, torch.tensor([-0.0])])
    return torch.cat([scale_ties, element_ties[None, :]]), torch.tensor(1.0)


OPERAND_DTYPES = (torch.float16, torch.bfloat16)


def empty_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Packed codes, FP8 scales, and a GEMM operand of each dtype, all pre-filled with garbage."""
    M, K = x.shape
    return (
        torch.full((M, K // 2), 0xAB, dtype=torch.uint8, device=x.device),
        torch.full((M, K // 16), 0xAB, dtype=torch.uint8, device=x.device).view(torch.float8_e4m3fn),
        [torch.full((M, K), float("nan"), dtype=dtype, device=x.device) for dtype in OPERAND_DTYPES],
    )


def smallest_accepted_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """A zero block beside a 1e-30 one under the smallest global scale the tensor accepts:
    the zero block's scale is clamped up to 2^-6, whose reciprocal is then just below float32's
    max, so the kernel's reciprocal multiply meets the largest finite value it can."""
    per_tensor_scale = smallest_accepted_per_tensor_scale()
    x = torch.cat([torch.zeros(2, 16), torch.full((2, 16), 1e-30)], dim=1)
    return x, per_tensor_scale


def assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands):
    expected_qdata, expected_scales = quantize_nvfp4(x.cpu(), per_tensor_scale.cpu())
    assert torch.equal(qdata.cpu(), expected_qdata)
    assert torch.equal(block_scales.cpu().view(torch.uint8), expected_scales.view(torch.uint8))
    for operand in operands:
        expected = deinterleave_blocks(dequantize_nvfp4(expected_qdata, expected_scales, output_dtype=operand.dtype))
        assert torch.equal(operand.cpu().view(torch.int16), expected.view(torch.int16)), operand.dtype


CASES = {
    f"{dtype_id}-{M}x{K}": (M, K, dtype)
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)
    for M, K in [(1, 16), (5, 48), (6, 1040)]
}


@pytest.fixture(scope="module")
def interpreted_results():
    """Every case's inputs and kernel outputs, from one interpreted child process."""
    inputs = {name: wide_range_activation(M, K, dtype, seed) for seed, (name, (M, K, dtype)) in enumerate(CASES.items())}
    inputs["ties"] = rounding_ties()
    inputs["smallest_accepted_scale"] = smallest_accepted_scale()
    launches = {}
    for name, (x, per_tensor_scale) in inputs.items():
        qdata, block_scales, operands = empty_outputs(x)
        launches[f"{name}-packed"] = (LAUNCHER, (x, per_tensor_scale, qdata, block_scales, None))
        for operand in operands:
            launches[f"{name}-{operand.dtype}"] = (LAUNCHER, (x, per_tensor_scale, None, None, operand))
    results = run_interpreted(launches)
    outputs = {}
    for name, (x, per_tensor_scale) in inputs.items():
        _, _, qdata, block_scales, _ = results[f"{name}-packed"].args
        operands = [results[f"{name}-{dtype}"].args[4] for dtype in OPERAND_DTYPES]
        outputs[name] = (x, per_tensor_scale, qdata, block_scales, operands)
    return outputs


@pytest.mark.parametrize("case", list(CASES) + ["ties", "smallest_accepted_scale"])
def test_interpreted_kernel_matches_reference_bit_for_bit(interpreted_results, case):
    assert_quantized_like_reference(*interpreted_results[case])


def test_smallest_accepted_scale_case_sits_at_the_overflow_edge():
    """Guards the case above: one float32 step below its scale the reciprocal overflows."""
    _, per_tensor_scale = smallest_accepted_scale()
    assert scale_reciprocal_overflows(torch.nextafter(per_tensor_scale, torch.tensor(0.0)))


def test_deinterleave_blocks_puts_even_elements_first():
    x = torch.arange(32.0).reshape(1, 32)
    expected = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert deinterleave_blocks(x)[0].tolist() == [float(i) for i in expected + [16 + i for i in expected]]


def test_ops_route_cpu_tensors_to_the_reference():
    x, per_tensor_scale = wide_range_activation(3, 64, torch.bfloat16, seed=0)
    qdata, block_scales = quantize_activation_nvfp4(x, per_tensor_scale)
    operands = [gemm_activation_operand(x, per_tensor_scale, dtype) for dtype in OPERAND_DTYPES]
    assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands)


def test_operand_of_another_dtype_is_an_error():
    x, per_tensor_scale = wide_range_activation(3, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        gemm_activation_operand(x, per_tensor_scale, torch.float32)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M,K", [(1, 8192), (37, 4096), (4096, 8192), (3, 16)], ids=str)
def test_gpu_kernel_matches_reference_bit_for_bit(dtype, M, K):
    x, per_tensor_scale = wide_range_activation(M, K, dtype, seed=M + K)
    x, per_tensor_scale = x.cuda(), per_tensor_scale.cuda()
    qdata, block_scales, operands = empty_outputs(x)
    launch_activation_quantize(x, per_tensor_scale, qdata, block_scales, None)
    for operand in operands:
        launch_activation_quantize(x, per_tensor_scale, None, None, operand)
    assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands)


@requires_cuda
@pytest.mark.parametrize("case", [rounding_ties, smallest_accepted_scale], ids=["ties", "smallest_accepted_scale"])
def test_gpu_corner_cases_match_reference_bit_for_bit(case):
    x, per_tensor_scale = (t.cuda() for t in case())
    qdata, block_scales = quantize_activation_nvfp4(x, per_tensor_scale)
    operands = [gemm_activation_operand(x, per_tensor_scale, dtype) for dtype in OPERAND_DTYPES]
    assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands)


def test_traced_ops_are_graph_nodes_under_compile_and_equal_in_eager():
    """``ops.traced_op``: dynamo records the custom op (what Inductor needs to see the
    kernels); the eager call, which skips the op's dispatch, returns the same values."""
    targets = []

    def recording_backend(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    torch._dynamo.reset()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    scale = x.abs().max() / (6 * 448)
    compiled = torch.compile(gemm_activation_operand, backend=recording_backend, fullgraph=True)
    assert torch.equal(compiled(x, scale), gemm_activation_operand(x, scale))
    assert torch.ops.nvfp4_static.gemm_activation_operand.default in targets


def test_eager_calls_skip_the_op_dispatch():
    """Eagerly, on real tensors, the body runs without going through the custom op (its
    dispatch is host overhead); the op itself is still registered and callable."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    scale = x.abs().max() / (6 * 448)
    op_name = "nvfp4_static::gemm_activation_operand"
    for call, goes_through_op in ((gemm_activation_operand, False), (gemm_activation_operand.op, True)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            call(x, scale)
        assert any(event.name == op_name for event in profile.events()) == goes_through_op


def test_only_real_tensors_outside_of_tracing_skip_the_ops():
    """Fake tensors (how dynamo runs a tensor subclass's ops) and make_fx must take the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.ones(2, 16)
    assert runs_eagerly(x, 3, torch.float16)
    with FakeTensorMode():
        assert not runs_eagerly(torch.ones(2, 16))
    seen = []
    make_fx(lambda a: seen.append(runs_eagerly(a)) or a + 1)(x)
    assert seen == [False]
