"""kernels/act_quantize.py and its ops: the Triton activation quantizer is bit-identical to
numerics.quantize_nvfp4.

On CPU the kernel runs under the Triton interpreter (in a child process, see triton_interpreter);
on a CUDA machine the same checks run compiled, at real sizes.
"""

import contextlib

import pytest
import torch
from conftest import DTYPE_IDS, DTYPES, PassThrough, requires_cuda, smallest_accepted_per_tensor_scale
from triton_interpreter import run_interpreted

from nvfp4_static.kernels import act_quantize
from nvfp4_static.kernels.act_quantize import _activation_quantize_kernel, launch_activation_quantize
from nvfp4_static.kernels.launch import KernelCall, overlaps_kernels, recording_launches
from nvfp4_static.kernels.ops import (
    deinterleave_blocks,
    fp8_scale_sweep,
    gemm_activation_operand,
    in_mma_order,
    quantize_activation_nvfp4,
    quantize_weight_nvfp4,
    runs_eagerly,
)
from nvfp4_static.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    compute_block_scales,
    dequantize_nvfp4,
    e4m3_positive_values,
    per_tensor_amax_to_scale,
    quantize_nvfp4,
    scale_reciprocal_overflows,
)
from nvfp4_static.tensor import NVFP4StaticTensor

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
    neighbouring normal FP8 scales, then one block of every E2M1 midpoint, both signs, and one of
    the fp32 values next to each midpoint, below it and above it. The 120 blocks lie in two rows
    of 60, each one program of the kernel (which takes a row of up to 64 blocks per program)."""
    normals = e4m3_positive_values()[7:]
    midpoints = (normals[:-1] + normals[1:]) / 2
    scale_ties = torch.zeros(len(midpoints), 16)
    scale_ties[:, 0] = 6.0 * midpoints
    scale_ties[:, 1] = 0.3
    e2m1_midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    element_ties = torch.cat([torch.tensor([6.0]), e2m1_midpoints, -e2m1_midpoints, torch.tensor([-0.0])])
    below = torch.nextafter(e2m1_midpoints, torch.zeros(()))
    above = torch.nextafter(e2m1_midpoints, torch.tensor(float("inf")))
    neighbours = torch.cat([torch.tensor([6.0]), below, -above, torch.tensor([0.0])])
    blocks = torch.cat([scale_ties, element_ties[None, :], neighbours[None, :]])
    return blocks.reshape(2, -1), torch.tensor(1.0)


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


def assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands, mma_order=False):
    expected_qdata, expected_scales = quantize_nvfp4(x.cpu(), per_tensor_scale.cpu())
    assert torch.equal(qdata.cpu(), expected_qdata)
    assert torch.equal(block_scales.cpu().view(torch.uint8), expected_scales.view(torch.uint8))
    assert_operands_like_reference(x, per_tensor_scale, operands, mma_order)


def assert_operands_like_reference(x, per_tensor_scale, operands, mma_order=False):
    """Each operand is the reference's ``q * s_b`` in its dtype, block-deinterleaved or in the MMA order."""
    expected_qdata, expected_scales = quantize_nvfp4(x.cpu(), per_tensor_scale.cpu())
    for operand in operands:
        values = dequantize_nvfp4(expected_qdata, expected_scales, output_dtype=operand.dtype)
        expected = in_mma_order(values) if mma_order else deinterleave_blocks(values)
        assert torch.equal(operand.cpu().view(torch.int16), expected.view(torch.int16)), operand.dtype


# Operands in the MMA order: K a multiple of 32, below and past the kernel's 1024-column tile.
MMA_ORDER_CASES = {"bf16-3x96": (3, 96, torch.bfloat16), "fp32-2x1056": (2, 1056, torch.float32)}


CASES = {
    f"{dtype_id}-{M}x{K}": (M, K, dtype)
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)
    for M, K in [(1, 16), (5, 48), (6, 1040)]
}

# Weights quantized under given scales: K below, at and past the kernel's 1024-column tile.
GIVEN_SCALES_CASES = {
    f"{dtype_id}-{M}x{K}": (M, K, dtype)
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)
    for M, K in [(1, 1040), (5, 48), (3, 2048)]
}

# Every FP8 subnormal code and the largest scale, 448.
SUBNORMAL_AND_MAX_CODES = torch.tensor([0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x7E], dtype=torch.uint8)


def sweep_like_scales(x: torch.Tensor, per_tensor_scale: torch.Tensor, seed: int) -> torch.Tensor:
    """FP8 block scales as a weight sweep gives them: each block's max-based scale moved a few
    codes down or up (into the subnormals for the smallest blocks; a block whose scale went down
    clips at +-6), with the first blocks set to every subnormal code and to 448."""
    generator = torch.Generator().manual_seed(seed)
    codes = compute_block_scales(x, per_tensor_scale).view(torch.uint8).to(torch.int32)
    codes = (codes + torch.randint(-4, 4, codes.shape, generator=generator)).clamp(1, 0x7E).to(torch.uint8)
    flat = codes.view(-1)
    count = min(flat.numel(), len(SUBNORMAL_AND_MAX_CODES))
    flat[:count] = SUBNORMAL_AND_MAX_CODES[:count]
    return codes.view(torch.float8_e4m3fn)


E2M1_TIE_BLOCK = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])


def given_scale_ties() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 blocks of every E2M1 midpoint (both signs, and -0.0) times their given scale, for
    power-of-two scales from the smallest subnormal (2^-9) to 256, and -1 (the sign bit decodes
    too), per-tensor scale 1: each scaled element lands exactly halfway between two E2M1 values."""
    codes = [0x01, 0x02, 0x04, 0x08, 0x38, 0x78, 0xB8]
    scales = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = E2M1_TIE_BLOCK[None, :] * scales.to(torch.float32)[:, None]
    return x, torch.tensor(1.0), scales[:, None].clone()


def given_scale_near_ties() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under per-tensor scale 0.1, for every FP8 scale: the E2M1 midpoints times scale and
    per-tensor scale in fp32, and one float32 step either side, so that which element rounds
    which way depends on the reciprocal's two roundings (``(1 / 0.1) / s``, not ``1 / (0.1 s)``)."""
    per_tensor_scale = torch.tensor(0.1)
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    near = (E2M1_TIE_BLOCK[None, :] * scales.to(torch.float32)[:, None] * per_tensor_scale).reshape(1, -1)
    x = torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near / 2)])
    return x, per_tensor_scale, scales.expand(3, -1).clone()


def given_scales_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    inputs = {}
    for seed, (name, (M, K, dtype)) in enumerate(GIVEN_SCALES_CASES.items()):
        x, per_tensor_scale = wide_range_activation(M, K, dtype, seed=100 + seed)
        inputs[name] = (x, per_tensor_scale, sweep_like_scales(x, per_tensor_scale, seed))
    inputs["ties"] = given_scale_ties()
    inputs["near_ties"] = given_scale_near_ties()
    return inputs


def assert_quantized_under_given_scales(x, per_tensor_scale, scales, qdata, scales_after):
    expected_qdata, _ = quantize_nvfp4(x.cpu(), per_tensor_scale.cpu(), scales.cpu())
    assert torch.equal(qdata.cpu(), expected_qdata)
    assert torch.equal(scales_after.cpu().view(torch.uint8), scales.cpu().view(torch.uint8))


@pytest.fixture(scope="module")
def interpreted_results():
    """Every case's inputs and kernel outputs, from one interpreted child process: the
    activation cases (computed scales, both output forms) and, under ``given:<name>``, the
    weight cases quantized under given scales."""
    inputs = {name: wide_range_activation(M, K, dtype, seed) for seed, (name, (M, K, dtype)) in enumerate(CASES.items())}
    inputs["ties"] = rounding_ties()
    inputs["smallest_accepted_scale"] = smallest_accepted_scale()
    launches = {}
    for name, (x, per_tensor_scale) in inputs.items():
        qdata, block_scales, operands = empty_outputs(x)
        launches[f"{name}-packed"] = (LAUNCHER, (x, per_tensor_scale, qdata, block_scales, None))
        for operand in operands:
            launches[f"{name}-{operand.dtype}"] = (LAUNCHER, (x, per_tensor_scale, None, None, operand))
    given = given_scales_inputs()
    for name, (x, per_tensor_scale, scales) in given.items():
        qdata = torch.full((x.shape[0], x.shape[1] // 2), 0xAB, dtype=torch.uint8)
        launches[f"given:{name}"] = (LAUNCHER, (x, per_tensor_scale, qdata, scales.clone(), None, True))
    mma_inputs = {name: wide_range_activation(M, K, dtype, seed=7) for name, (M, K, dtype) in MMA_ORDER_CASES.items()}
    for name, (x, per_tensor_scale) in mma_inputs.items():
        for operand in empty_outputs(x)[2]:
            launches[f"mma:{name}-{operand.dtype}"] = (LAUNCHER, (x, per_tensor_scale, None, None, operand, False, True))
    results = run_interpreted(launches)
    outputs = {}
    for name, (x, per_tensor_scale) in inputs.items():
        _, _, qdata, block_scales, _ = results[f"{name}-packed"].args
        operands = [results[f"{name}-{dtype}"].args[4] for dtype in OPERAND_DTYPES]
        outputs[name] = (x, per_tensor_scale, qdata, block_scales, operands)
    for name, (x, per_tensor_scale, scales) in given.items():
        _, _, qdata, scales_after, _, _ = results[f"given:{name}"].args
        outputs[f"given:{name}"] = (x, per_tensor_scale, scales, qdata, scales_after)
    for name, (x, per_tensor_scale) in mma_inputs.items():
        operands = [results[f"mma:{name}-{dtype}"].args[4] for dtype in OPERAND_DTYPES]
        outputs[f"mma:{name}"] = (x, per_tensor_scale, operands)
    return outputs


@pytest.mark.parametrize("case", list(MMA_ORDER_CASES))
def test_interpreted_operand_in_mma_order_matches_reference_bit_for_bit(interpreted_results, case):
    assert_operands_like_reference(*interpreted_results[f"mma:{case}"], mma_order=True)


@pytest.mark.parametrize("case", list(CASES) + ["ties", "smallest_accepted_scale"])
def test_interpreted_kernel_matches_reference_bit_for_bit(interpreted_results, case):
    assert_quantized_like_reference(*interpreted_results[case])


@pytest.mark.parametrize("case", list(GIVEN_SCALES_CASES) + ["ties", "near_ties"])
def test_interpreted_kernel_under_given_scales_matches_reference_bit_for_bit(interpreted_results, case):
    """The packed codes equal the reference's under the same scales, which stay as they were."""
    assert_quantized_under_given_scales(*interpreted_results[f"given:{case}"])


def test_given_scales_cases_cover_subnormal_max_clipping_zero_and_negative_zero_blocks():
    """Guards the cases above: they hold what they are meant to test."""
    inputs = given_scales_inputs()
    codes = torch.cat([scales.view(torch.uint8).flatten() for _, _, scales in inputs.values()])
    assert set(SUBNORMAL_AND_MAX_CODES.tolist()) <= set(codes.tolist())
    x, per_tensor_scale, scales = inputs["fp32-3x2048"]
    reciprocal = (1.0 / per_tensor_scale) / scales.to(torch.float32)
    scaled = x.reshape(3, -1, 16) * reciprocal[..., None]
    assert (scaled > E2M1_MAX).any() and (scaled < -E2M1_MAX).any()
    assert (x[:, :16] == 0).all() and torch.signbit(x[:, 16:32]).all()


def test_smallest_accepted_scale_case_sits_at_the_overflow_edge():
    """Guards the case above: one float32 step below its scale the reciprocal overflows."""
    _, per_tensor_scale = smallest_accepted_scale()
    assert scale_reciprocal_overflows(torch.nextafter(per_tensor_scale, torch.tensor(0.0)))


def test_mma_order_puts_each_threads_4_bytes_where_its_wgmma_registers_read_them():
    """Position 16c + 8h + 2t + i of a 32-group holds element 8t + 4c + 2i + h (written out)."""
    x = torch.arange(64.0).reshape(1, 64)
    expected = [0, 2, 8, 10, 16, 18, 24, 26, 1, 3, 9, 11, 17, 19, 25, 27]
    expected += [4, 6, 12, 14, 20, 22, 28, 30, 5, 7, 13, 15, 21, 23, 29, 31]
    assert in_mma_order(x)[0].tolist() == [float(i) for i in expected + [32 + i for i in expected]]


def test_operand_in_mma_order_refuses_partial_groups_and_the_packed_form():
    x, per_tensor_scale = wide_range_activation(3, 48, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="32-element groups, got K = 48"):
        gemm_activation_operand(x, per_tensor_scale, mma_order=True)
    qdata, block_scales, operands = empty_outputs(x)
    with pytest.raises(ValueError, match="32-element groups; got K = 48"):
        launch_activation_quantize(x, per_tensor_scale, None, None, operands[0], mma_order=True)
    x, per_tensor_scale = wide_range_activation(3, 64, torch.bfloat16, seed=0)
    qdata, block_scales, _ = empty_outputs(x)
    with pytest.raises(ValueError, match="got the packed form"):
        launch_activation_quantize(x, per_tensor_scale, qdata, block_scales, None, mma_order=True)


def test_deinterleave_blocks_puts_even_elements_first():
    x = torch.arange(32.0).reshape(1, 32)
    expected = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert deinterleave_blocks(x)[0].tolist() == [float(i) for i in expected + [16 + i for i in expected]]


@pytest.mark.parametrize("mma_order", [False, True], ids=["deinterleaved", "mma_order"])
def test_ops_route_cpu_tensors_to_the_reference(mma_order):
    x, per_tensor_scale = wide_range_activation(3, 64, torch.bfloat16, seed=0)
    with recording_launches() as launches:
        qdata, block_scales = quantize_activation_nvfp4(x, per_tensor_scale)
        operands = [gemm_activation_operand(x, per_tensor_scale, dtype, mma_order) for dtype in OPERAND_DTYPES]
    assert launches == []
    assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands, mma_order)


@pytest.mark.parametrize("given", [False, True], ids=["computed_scales", "given_scales"])
def test_weight_quantize_routes_cpu_tensors_to_the_reference(given):
    x, per_tensor_scale = wide_range_activation(4, 64, torch.bfloat16, seed=1)
    scales = sweep_like_scales(x, per_tensor_scale, seed=1) if given else None
    with recording_launches() as launches:
        qdata, block_scales = quantize_weight_nvfp4(x, per_tensor_scale, scales)
    expected_qdata, expected_scales = quantize_nvfp4(x, per_tensor_scale, scales)
    assert launches == []
    assert torch.equal(qdata, expected_qdata)
    assert torch.equal(block_scales.view(torch.uint8), expected_scales.view(torch.uint8))


def _scales(shape, dtype=torch.float8_e4m3fn, device="cpu"):
    return torch.ones(shape, device=device).to(dtype)


@pytest.mark.parametrize(
    "weight_shape,scales,message",
    [
        ((8, 64), _scales((8, 3)), r"weight of shape \(8, 64\) must be float8_e4m3fn of shape \(8, 4\).*shape \(8, 3\)"),
        ((8, 64), _scales((4, 8)), r"shape \(8, 64\).*shape \(4, 8\)"),
        ((8, 64), _scales((8, 64)), r"shape \(8, 64\).*shape \(8, 64\)"),
        ((8, 64), _scales((8, 4, 1)), r"shape \(8, 64\).*shape \(8, 4, 1\)"),
        ((8, 64), _scales((1, 4)), r"shape \(8, 64\).*shape \(1, 4\)"),
        ((8, 64), _scales((8, 4), torch.float32), r"shape \(8, 64\).*got torch.float32"),
        ((8, 64), _scales((8, 4), torch.uint8), r"shape \(8, 64\).*got torch.uint8"),
        ((2, 4, 64), _scales((8, 4)), r"shape \(2, 4, 64\) must be float8_e4m3fn of shape \(2, 4, 4\)"),
        ((8, 64), _scales((8, 4), device="meta"), r"block scales on meta for a weight on cpu"),
    ],
    ids=["too_few_blocks", "transposed", "per_element", "extra_dim", "one_row", "float32", "uint8", "3d_weight", "device"],
)
def test_weight_quantize_refuses_wrong_block_scales(weight_shape, scales, message):
    """Refused before anything runs, naming the weight's shape and what the scales should be."""
    weight = torch.randn(weight_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        quantize_weight_nvfp4(weight, torch.tensor(0.01), scales)


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
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M,K", [(1, 8192), (37, 4096), (3, 32)], ids=str)
def test_gpu_operand_in_mma_order_matches_reference_bit_for_bit(dtype, M, K):
    x, per_tensor_scale = wide_range_activation(M, K, dtype, seed=M + K)
    x, per_tensor_scale = x.cuda(), per_tensor_scale.cuda()
    operands = [gemm_activation_operand(x, per_tensor_scale, operand_dtype, True) for operand_dtype in OPERAND_DTYPES]
    assert_operands_like_reference(x, per_tensor_scale, operands, mma_order=True)


@requires_cuda
@pytest.mark.parametrize("case", [rounding_ties, smallest_accepted_scale], ids=["ties", "smallest_accepted_scale"])
def test_gpu_corner_cases_match_reference_bit_for_bit(case):
    x, per_tensor_scale = (t.cuda() for t in case())
    qdata, block_scales = quantize_activation_nvfp4(x, per_tensor_scale)
    operands = [gemm_activation_operand(x, per_tensor_scale, dtype) for dtype in OPERAND_DTYPES]
    assert_quantized_like_reference(x, per_tensor_scale, qdata, block_scales, operands)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N,K", [(4096, 14336), (14336, 4096), (1, 1040)], ids=str)
def test_gpu_weight_quantize_matches_reference_bit_for_bit(dtype, N, K):
    """At real shapes, under the weight sweep's own scales and under computed ones: the kernel
    runs (one launch) and its codes and scales equal the reference's."""
    generator = torch.Generator(device="cuda").manual_seed(N + K)
    weight = (torch.randn(N, K, device="cuda", generator=generator) * 0.02).to(dtype)
    weight[0, :16] = 0.0
    weight[0, 16:32] = -0.0
    global_amax = weight.abs().amax().float()
    per_tensor_scale = per_tensor_amax_to_scale(global_amax)
    swept = fp8_scale_sweep(weight, global_amax)
    for given in (swept, None):
        scales_before = None if given is None else given.clone()
        with recording_launches() as launches:
            qdata, block_scales = quantize_weight_nvfp4(weight, per_tensor_scale, given)
        assert [call.kernel for call in launches] == [_activation_quantize_kernel]
        expected_qdata, expected_scales = quantize_nvfp4(weight, per_tensor_scale, given)
        assert torch.equal(qdata, expected_qdata)
        assert torch.equal(block_scales.view(torch.uint8), expected_scales.view(torch.uint8))
        if given is not None:
            assert torch.equal(given.view(torch.uint8), scales_before.view(torch.uint8))


@requires_cuda
def test_gpu_weight_quantize_of_other_ranks_takes_the_reference():
    x, per_tensor_scale = wide_range_activation(6, 32, torch.float32, seed=2)
    x = x.reshape(2, 3, 32)
    scales = sweep_like_scales(x, per_tensor_scale, seed=2)
    x, per_tensor_scale, scales = x.cuda(), per_tensor_scale.cuda(), scales.cuda()
    with recording_launches() as launches:
        qdata, block_scales = quantize_weight_nvfp4(x, per_tensor_scale, scales)
    assert launches == []
    assert torch.equal(qdata, quantize_nvfp4(x, per_tensor_scale, scales)[0])
    assert block_scales is scales


@requires_cuda
def test_gpu_given_scales_corner_cases_match_reference_bit_for_bit():
    inputs = given_scales_inputs()
    for name, (x, per_tensor_scale, scales) in inputs.items():
        x, per_tensor_scale, scales = x.cuda(), per_tensor_scale.cuda(), scales.cuda()
        qdata, scales_after = quantize_weight_nvfp4(x, per_tensor_scale, scales)
        assert_quantized_under_given_scales(x, per_tensor_scale, scales, qdata, scales_after)


@requires_cuda
def test_gpu_from_float_quantizes_with_the_kernel_like_the_reference():
    weight = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    global_amax = weight.abs().amax().float()
    swept = fp8_scale_sweep(weight, global_amax)
    with recording_launches() as launches:
        tensor = NVFP4StaticTensor.from_float(weight, torch.tensor(3.0, device="cuda"), swept)
    assert _activation_quantize_kernel in [call.kernel for call in launches]
    expected_qdata, _ = quantize_nvfp4(weight, per_tensor_amax_to_scale(global_amax), swept)
    assert torch.equal(tensor.qdata, expected_qdata)


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


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dispatch-mode"])
def test_the_kernel_lets_the_next_one_start_early_only_eagerly_where_kernels_overlap(traced, monkeypatch):
    """Where kernels can overlap (sm_90 onwards), an eager launch lets the kernel after it start
    early; a launch under a dispatch mode (as in tracing) never does, since a traced Triton
    kernel's mutation analysis cannot read that instruction; nor does a launch where kernels
    cannot overlap. The launches are recorded, not run."""
    launched = []
    monkeypatch.setattr(KernelCall, "launch", lambda call: launched.append(call))
    x = torch.randn(4, 64)
    for overlap in (True, False):
        monkeypatch.setattr(act_quantize, "overlaps_kernels", lambda device: overlap)
        for mma_order in (False, True):
            operand = torch.empty(4, 64, dtype=torch.float16)
            with PassThrough() if traced else contextlib.nullcontext():
                launch_activation_quantize(x, torch.ones(()), None, None, operand, mma_order=mma_order)
    assert [call.meta["RELEASE_DEPENDENTS"] for call in launched] == [not traced] * 2 + [False] * 2


def test_kernels_overlap_only_on_cuda_devices():
    assert not overlaps_kernels(torch.device("cpu"))
    assert not overlaps_kernels(torch.device("meta"))


@pytest.mark.parametrize("release", [True, False])
def test_sm90a_build_lets_the_next_kernel_start_before_any_load(release, monkeypatch, tmp_path):
    """Built for sm_90a, the kernel asked to release the kernel after it does so once, before
    its first global load; otherwise never."""
    from test_gemm_hopper_code import ptxas_report_for_sm90

    launched = []
    monkeypatch.setattr(KernelCall, "launch", lambda call: launched.append(call))
    monkeypatch.setattr(act_quantize, "overlaps_kernels", lambda device: release)
    x = torch.randn(16, 1024, dtype=torch.bfloat16)
    launch_activation_quantize(x, torch.ones(()), None, None, torch.empty(16, 1024, dtype=torch.float16), mma_order=True)
    (call,) = launched
    ptx = ptxas_report_for_sm90(call, tmp_path).ptx
    assert ptx.count("griddepcontrol.launch_dependents") == int(release)
    if release:
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")


@requires_cuda
def test_gpu_the_kernel_and_the_reference_round_the_block_scales_quotient_alike():
    """The block whose FP8 scale the quotient's last bit decides (``test_numerics``): the
    kernel, quantizing it as a weight and as an activation, gives the correctly rounded
    quotient's scale (1.0), as the reference does on the GPU and on the CPU."""
    from test_numerics import quotient_decides_block

    block, scale = quotient_decides_block("cuda")
    expected_qdata, expected_scales = quantize_nvfp4(*quotient_decides_block())
    assert expected_scales.float().item() == 1.0
    for quantize in (quantize_weight_nvfp4, quantize_activation_nvfp4, quantize_nvfp4):
        qdata, scales = quantize(block, scale)
        assert torch.equal(qdata.cpu(), expected_qdata), quantize.__name__
        assert torch.equal(scales.cpu().view(torch.uint8), expected_scales.view(torch.uint8)), quantize.__name__


@requires_cuda
def test_gpu_float32_weights_quantize_on_the_gpu_as_on_the_cpu():
    """A float32 Llama-8B MLP-shaped weight under its own global scale: the kernel's codes and
    scales equal the reference's on the CPU, bit for bit."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(4096, 14336, device="cuda", generator=generator) * 0.02
    per_tensor_scale = per_tensor_amax_to_scale(weight.abs().amax())
    qdata, block_scales = quantize_weight_nvfp4(weight, per_tensor_scale)
    expected_qdata, expected_scales = quantize_nvfp4(weight.cpu(), per_tensor_scale.cpu())
    assert torch.equal(block_scales.cpu().view(torch.uint8), expected_scales.view(torch.uint8))
    assert torch.equal(qdata.cpu(), expected_qdata)
