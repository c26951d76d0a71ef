"""numerics.py against torchao's NVFP4Tensor: bit-identical codes, scales and dequantized values."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from conftest import requires_cuda, smallest_accepted_per_tensor_scale
from nvfp4_static import numerics

DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.is_floating_point:
        view = _INT_VIEW.get(actual.dtype, torch.uint8)
        actual, expected = actual.view(view), expected.view(view)
    mismatches = (actual != expected).sum().item()
    assert mismatches == 0, f"{mismatches} of {actual.numel()} elements differ"


def assert_matches_torchao(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> None:
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale)
    qdata, scales = numerics.quantize_nvfp4(x, per_tensor_scale)
    assert_bitwise_equal(qdata, reference.qdata)
    assert_bitwise_equal(scales.view(torch.uint8), reference.scale.view(torch.uint8))
    expected = reference.dequantize(torch.float32)
    assert_bitwise_equal(numerics.dequantize_nvfp4(qdata, scales, per_tensor_scale), expected)
    assert_bitwise_equal(
        numerics.fake_quantize_nvfp4(x, per_tensor_scale), reference.dequantize(x.dtype)
    )


def test_e4m3_positive_values_are_the_126_finite_fp8_values():
    values = numerics.e4m3_positive_values()
    assert values.shape == (126,)
    assert bool((values[1:] > values[:-1]).all())
    assert values[0] == 2.0**-9 and values[-1] == 448.0
    # Seven subnormals (m * 2^-9, m = 1..7) sit below the smallest normal 2^-6.
    assert int((values < numerics.E4M3_MIN_NORMAL).sum()) == 7
    roundtrip = values.to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(roundtrip, values)
    assert torch.equal(numerics.fp8_scale_candidates() * 448.0, values)


def _midpoint_probes() -> torch.Tensor:
    grid = torch.tensor(numerics.E2M1_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    below = torch.nextafter(midpoints, torch.zeros_like(midpoints))
    above = torch.nextafter(midpoints, torch.full_like(midpoints, 7.0))
    tiny = torch.tensor([1e-30, 1e-45, 0.0])
    magnitudes = torch.cat([grid, midpoints, below, above, tiny, torch.linspace(0, 6, 20001)])
    return torch.cat([magnitudes, -magnitudes])


def test_round_to_e2m1_matches_torchao_cast_around_every_midpoint():
    x = _midpoint_probes()
    expected = f4_unpacked_to_f32(f32_to_f4_unpacked(x))
    assert_bitwise_equal(numerics.round_to_e2m1(x), expected)


def test_round_to_e2m1_keeps_the_sign_of_negative_zero_results():
    x = torch.tensor([-0.0, -0.1, -0.25])
    assert bool(torch.signbit(numerics.round_to_e2m1(x)).all())


def _blocky_tensor(
    generator: torch.Generator, shape: tuple, log2_magnitude: int, zero_block_fraction: float
) -> torch.Tensor:
    """Normal data whose blocks differ in scale by up to 2^20 (pushing the smaller block scales
    toward and below FP8's normal range), with some blocks zeroed."""
    *lead, k = shape
    blocks = torch.randn(*lead, k // 16, 16, generator=generator)
    gains = 2.0 ** torch.randint(-20, 1, (*lead, k // 16, 1), generator=generator).float()
    keep = (torch.rand(*lead, k // 16, 1, generator=generator) >= zero_block_fraction).float()
    return (blocks * gains * keep * 2.0**log2_magnitude).reshape(shape)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    log2_magnitude=st.integers(-100, 100),
    log2_scale_ratio=st.integers(-12, 20),
    zero_block_fraction=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_quantize_is_bit_identical_to_torchao(
    seed, rows, blocks, dtype, log2_magnitude, log2_scale_ratio, zero_block_fraction
):
    """Static scales from far below the data's amax (saturation) to far above it (block scales
    clamped at FP8's smallest normal), magnitudes from 2^-100 to 2^100, all-zero blocks."""
    generator = torch.Generator().manual_seed(seed)
    x = _blocky_tensor(generator, (rows, blocks * 16), log2_magnitude, zero_block_fraction)
    x = x.to(dtype)
    amax = x.abs().max().float()
    amax = amax * 2.0**log2_scale_ratio if amax > 0 else torch.tensor(1.0)
    assert_matches_torchao(x, per_tensor_amax_to_scale(amax))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    log2_magnitude=st.integers(-100, 100),
    log2_scale_ratio=st.integers(-12, 20),
    zero_block_fraction=st.sampled_from([0.0, 0.3]),
)
def test_unpacked_quantize_gives_exactly_the_values_the_packed_codes_decode_to(
    seed, dtype, log2_magnitude, log2_scale_ratio, zero_block_fraction
):
    """The CPU linear uses q from ``quantize_nvfp4_unpacked`` in place of decoding the packed
    codes: same bits, -0.0 included, and the same block scales."""
    generator = torch.Generator().manual_seed(seed)
    x = _blocky_tensor(generator, (3, 64), log2_magnitude, zero_block_fraction).to(dtype)
    x[0, :16] = -1e-30  # rounds to -0.0, which the packed codes keep as code 8
    amax = x.abs().max().float()
    scale = per_tensor_amax_to_scale(amax * 2.0**log2_scale_ratio if amax > 0 else torch.tensor(1.0))
    q, block_scales = numerics.quantize_nvfp4_unpacked(x, scale)
    qdata, packed_block_scales = numerics.quantize_nvfp4(x, scale)
    assert_bitwise_equal(block_scales, packed_block_scales)
    decoded = numerics.dequantize_nvfp4(qdata, torch.ones_like(packed_block_scales))
    assert_bitwise_equal(q, decoded)


def _e2m1_midpoints_tensor() -> torch.Tensor:
    """One block per midpoint: a 6 (so that under the global amax 448 * 6, i.e. per-tensor
    scale 1, the block scale is exactly 1) and 15 copies of the midpoint, signs alternating."""
    grid = torch.tensor(numerics.E2M1_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    rows = torch.cat([torch.full((len(midpoints), 1), 6.0), midpoints[:, None].expand(-1, 15)], 1)
    return rows * torch.tensor([1.0, -1.0]).repeat(8)


ADVERSARIAL = {
    "all_zero": (torch.zeros(4, 32), 1.0),
    "one_zero_block": (torch.cat([torch.zeros(2, 16), torch.ones(2, 16)], dim=1), None),
    "fp8_subnormal_block_scales": (
        torch.cat([torch.full((2, 16), 1e-5), torch.full((2, 16), 3.0)], dim=1),
        None,
    ),
    "saturating": (torch.linspace(-50, 50, 64).reshape(2, 32), 5.0),
    "e2m1_midpoints": (_e2m1_midpoints_tensor(), 448.0 * 6.0),
    "huge": (torch.linspace(-3e37, 3e37, 64).reshape(2, 32), None),
    "tiny": (torch.linspace(-1e-36, 1e-36, 64).reshape(2, 32), None),
    # A zero block's scale is clamped up to 2^-6, whose reciprocal under this global scale
    # overflows: 0 * inf is NaN, which torchao's cast turns into +-1.5.
    "zero_block_whose_reciprocal_overflows": (
        torch.cat([torch.zeros(2, 16), torch.full((2, 16), 1e-30)], dim=1),
        1e-34,
    ),
    "three_dims": (torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0)), None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_quantize_is_bit_identical_to_torchao_on_adversarial_inputs(case, dtype):
    x, amax = case
    x = x.to(dtype)
    amax = x.abs().max().float() if amax is None else torch.tensor(amax)
    assert_matches_torchao(x, per_tensor_amax_to_scale(amax))


def test_scale_reciprocal_overflows_exactly_where_zero_blocks_turn_nan():
    """Past the edge a zero block quantizes through 0 * inf (code 1.5 or 2.0 by device); one
    float32 step inside it the block is exact zeros."""
    x = torch.cat([torch.zeros(1, 16), torch.ones(1, 16)], dim=1)
    edge = smallest_accepted_per_tensor_scale()
    outside = torch.nextafter(edge, torch.tensor(0.0))
    assert numerics.scale_reciprocal_overflows(outside)
    assert numerics.quantize_nvfp4(x, edge)[0][0, :8].tolist() == [0] * 8
    assert (numerics.quantize_nvfp4(x, outside)[0][0, :8] & 0x77).tolist() == [0x33] * 8


def test_e2m1_midpoints_case_really_lands_on_midpoints():
    """Guards the adversarial case above: every block scale is exactly 1, so x / scale is x."""
    x = _e2m1_midpoints_tensor()
    scales = numerics.compute_block_scales(x, per_tensor_amax_to_scale(torch.tensor(448.0 * 6.0)))
    assert bool((scales.to(torch.float32) == 1.0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_with_given_block_scales_uses_them(dtype):
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    per_tensor_scale = per_tensor_amax_to_scale(x.abs().max().float())
    given = torch.full((3, 3), 2.0).to(torch.float8_e4m3fn)
    qdata, scales = numerics.quantize_nvfp4(x, per_tensor_scale, given)
    assert scales is given
    deq = numerics.dequantize_nvfp4(qdata, scales, per_tensor_scale)
    # Every element is an E2M1 value times the one block scale 2 * per_tensor_scale.
    codes = deq / (2.0 * per_tensor_scale)
    assert bool(torch.isin(codes.abs(), torch.tensor(numerics.E2M1_VALUES)).all())
    assert_bitwise_equal(numerics.fake_quantize_nvfp4(x, per_tensor_scale, given), deq.to(dtype))


def test_block_amax_zero_pads_a_ragged_last_dim():
    x = torch.arange(20, dtype=torch.float32).reshape(1, 20) - 10
    assert torch.equal(numerics.block_amax(x), torch.tensor([[10.0, 9.0]]))


def test_quantize_rejects_a_last_dim_not_divisible_by_16():
    with pytest.raises(ValueError, match=r"last dim 20 .* multiple of the NVFP4 block size 16"):
        numerics.quantize_nvfp4(torch.ones(2, 20), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["fp64", "int32"])
def test_check_dtype_rejects_unsupported_dtypes(dtype):
    with pytest.raises(TypeError, match="supported dtypes"):
        numerics.check_dtype(torch.ones(2, dtype=dtype))


def test_e2m1_table_equals_torchaos_decoding_of_every_code():
    ours = numerics.e2m1_values_by_code(torch.device("cpu"))
    theirs = f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # -0.0 included


def test_byte_table_decodes_every_packed_byte_as_torchao_does():
    """Every byte value, low nibble first, under leading dims (an expert stack's shape): the
    bfloat16 values equal torchao's decoding of the unpacked nibbles, -0.0 included."""
    qdata = torch.arange(256, dtype=torch.uint8).reshape(2, 8, 16).flip(-1)
    theirs = f4_unpacked_to_f32(unpack_uint4(qdata.reshape(-1, 16))).reshape(2, 8, 32)
    words = numerics.e2m1_byte_words(torch.device("cpu"))
    for ours in (numerics.e2m1_values_by_byte(qdata), numerics.e2m1_values_by_byte(qdata, words)):
        assert ours.dtype == torch.bfloat16 and ours.shape == (2, 8, 32)
        assert torch.equal(ours.float().view(torch.int32), theirs.view(torch.int32))


def test_dequantize_equals_the_codes_decoded_one_by_one_times_their_block_scales():
    weight = torch.randn(3, 40, 64) * torch.rand(3, 40, 1)
    qdata, block_scales = numerics.quantize_nvfp4(weight, torch.tensor(0.01))
    codes = torch.stack((qdata & 0xF, qdata >> 4), dim=-1).reshape(3, 40, 64).to(torch.int64)
    values = numerics.e2m1_values_by_code(torch.device("cpu"))[codes]
    expected = (values.reshape(3, 40, 4, 16) * block_scales.to(torch.float32)[..., None]).reshape(3, 40, 64)
    cpu = torch.device("cpu")
    tables = {"byte_words": numerics.e2m1_byte_words(cpu), "scale_values": numerics.e4m3_values_by_code(cpu)}
    for output_dtype in (torch.float32, torch.bfloat16):
        for given_tables in ({}, tables):  # the tables built inside, or given
            got = numerics.dequantize_nvfp4(qdata, block_scales, output_dtype=output_dtype, **given_tables)
            assert got.dtype == output_dtype and got.shape == (3, 40, 64)
            assert torch.equal(got.float().view(torch.int32), expected.to(output_dtype).float().view(torch.int32))


def test_e4m3_table_holds_torchs_value_of_every_fp8_code():
    codes = torch.arange(256).to(torch.uint8)
    theirs = codes.view(torch.float8_e4m3fn).to(torch.float32)
    ours = numerics.e4m3_values_by_code(torch.device("cpu"))
    assert ours.dtype == torch.float32 and ours.shape == (256,)
    nan = theirs.isnan()
    assert nan.sum() == 2 and torch.equal(ours.isnan(), nan)  # 0x7F and 0xFF
    assert torch.equal(ours[~nan].view(torch.int32), theirs[~nan].view(torch.int32))  # -0.0 included


# A block amax and a global scale (float32 bit patterns) whose block scale the quotient's last
# bit decides: amax / 6 correctly rounded, then / p, rounds to FP8 1.0; amax times the float32
# reciprocal of 6 (how torch on CUDA divides by a Python number) is one bit larger and gives 1.125.
QUOTIENT_DECIDES_AMAX_BITS, QUOTIENT_DECIDES_SCALE_BITS = 1086277499, 1064307042


def quotient_decides_block(device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One 16-element float32 block with that amax (its first element, the rest smaller and of
    both signs), and that global scale, on ``device``."""
    amax = torch.tensor(QUOTIENT_DECIDES_AMAX_BITS, dtype=torch.int32).view(torch.float32)
    block = torch.linspace(-0.9, 0.9, 16) * amax
    block[0] = amax
    scale = torch.tensor(QUOTIENT_DECIDES_SCALE_BITS, dtype=torch.int32).view(torch.float32)
    return block.reshape(1, 16).to(device), scale.to(device)


def test_the_quotient_decides_blocks_scale_is_one_step_apart_under_the_reciprocal_multiply():
    """The case the next tests rest on: exact arithmetic in float64 rounds to 1.0, the
    reciprocal multiply to 1.125."""
    block, scale = quotient_decides_block()
    amax = block.abs().amax()
    correctly_rounded = (amax.double() / 6).float()
    assert correctly_rounded == amax / 6.0  # on a CPU torch divides
    by_reciprocal = amax * torch.tensor(1 / 6, dtype=torch.float32)
    assert by_reciprocal != correctly_rounded
    assert (correctly_rounded / scale).to(torch.float8_e4m3fn).float() == 1.0
    assert (by_reciprocal / scale).to(torch.float8_e4m3fn).float() == 1.125


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=requires_cuda)]
)
def test_block_scales_divide_correctly_rounded_on_every_device(device):
    """The reference's block scale is the correctly rounded quotients' (1.0), on a GPU too,
    where torch's division by a Python number would give 1.125; the codes follow it."""
    block, scale = quotient_decides_block(device)
    assert numerics.compute_block_scales(block, scale).float().item() == 1.0
    qdata, scales = numerics.quantize_nvfp4(block, scale)
    cpu_qdata, cpu_scales = numerics.quantize_nvfp4(*quotient_decides_block())
    assert torch.equal(qdata.cpu(), cpu_qdata) and torch.equal(scales.cpu().view(torch.uint8), cpu_scales.view(torch.uint8))
