"""A weight's quantize on a CPU through the C kernel (backends/cpu_quantize.c) against its
definition, ``numerics.quantize_nvfp4``: the same codes and block scales bit for bit, and the
definition itself where the kernel cannot give them."""

import math
import re

import pytest
import torch
from conftest import DTYPE_IDS, DTYPES, torch_threads

from nvfp4_static import kernels, numerics
from nvfp4_static.backends import cpu_kernel, cpu_quantize

reference = numerics.quantize_nvfp4


@pytest.fixture
def kernel_only(monkeypatch):
    """The definition made to fail, so that a call that returns took the kernel. A test machine
    has a C compiler: a kernel that was not built fails here rather than skipping."""
    assert cpu_kernel.library() is not None, "the CPU kernel was not built"

    def refuse(*args):
        raise AssertionError("took the torch reference")

    monkeypatch.setattr(numerics, "quantize_nvfp4", refuse)


def assert_same(got, expected):
    assert got[0].dtype == torch.uint8 and got[1].dtype == torch.float8_e4m3fn
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1].view(torch.uint8), expected[1].view(torch.uint8))


def weight_of(shape, dtype, seed):
    """Values over six decades along K, so blocks' scales span FP8's range."""
    generator = torch.Generator().manual_seed(seed)
    gains = torch.logspace(-3, 3, shape[-1])
    return (torch.randn(shape, generator=generator) * gains).to(dtype)


# Global scales: the weight's own, one that leaves most blocks at the smallest scale, and one
# that saturates the largest blocks at 448 and clips their elements to +-6.
GLOBAL_SCALE_FACTORS = {"own": 1.0, "larger": 1e4, "clipping": 0.05}


@pytest.mark.parametrize("factor", GLOBAL_SCALE_FACTORS.values(), ids=GLOBAL_SCALE_FACTORS.keys())
@pytest.mark.parametrize("scales", ["from maxes", "given"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 16), (37, 160), (3, 5, 48), (130, 256)], ids=str)
def test_the_kernel_quantizes_as_the_definition(monkeypatch, kernel_only, shape, dtype, scales, factor):
    weight = weight_of(shape, dtype, seed=shape[-1])
    global_scale = weight.float().abs().amax() / (448 * 6) * factor
    given = None
    if scales == "given":  # other scales than the maxes' own: the next FP8 code up
        codes = numerics.compute_block_scales(weight, global_scale).view(torch.uint8)
        given = torch.clamp(codes.to(torch.int32) + 1, max=0x7E).to(torch.uint8).view(torch.float8_e4m3fn)
    expected = reference(weight, global_scale, given)
    got = kernels.quantize_weight_nvfp4(weight, global_scale, given)
    assert_same(got, expected)
    if given is not None:
        assert got[1] is given


def test_the_kernel_rounds_every_midpoint_and_its_neighbours_as_the_definition(kernel_only):
    """Each block leads with 6 under a global scale of 1: its scale is 1 and the others are
    coded as they are. Every E2M1 midpoint (ties to even), one float32 step each side, grid
    points, both zeros, both signs."""
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    probes = torch.cat([midpoints, torch.nextafter(midpoints, torch.zeros(7)),
                        torch.nextafter(midpoints, torch.full((7,), 9.0)),
                        torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 1e-30])])
    probes = torch.cat([probes, -probes, torch.tensor([-0.0])])
    probes = torch.cat([probes, torch.zeros(-len(probes) % 15)]).reshape(-1, 15)
    weight = torch.cat([torch.full((len(probes), 1), 6.0), probes], dim=1)
    global_scale = torch.tensor(1.0)
    expected = reference(weight, global_scale)
    assert bool((expected[1].float() == 1.0).all())
    assert_same(kernels.quantize_weight_nvfp4(weight, global_scale), expected)


def test_the_kernel_scales_elements_on_midpoints_by_the_definitions_reciprocal(kernel_only):
    """Elements at E2M1 midpoints times their block's scale under odd global scales: one bit
    more or less in ``(1 / global) / block scale`` moves such an element off its midpoint."""
    generator = torch.Generator().manual_seed(5)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                              6.0, 0.5], dtype=torch.float64)
    for _ in range(20):
        global_scale = torch.rand((), generator=generator, dtype=torch.float64) * 1e-2 + 1e-4
        codes = torch.randint(0x20, 0x50, (64, 4), generator=generator, dtype=torch.uint8)
        scales = codes.view(torch.float8_e4m3fn)
        block_values = scales.double() * global_scale.float().double()
        weight = (midpoints.repeat(64, 4) * block_values.repeat_interleave(16, dim=1)).float()
        global_scale = global_scale.float()
        expected = reference(weight, global_scale, scales)
        assert_same(kernels.quantize_weight_nvfp4(weight, global_scale, scales), expected)


@pytest.mark.parametrize("layout", ["rows apart", "transposed", "expanded"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_reads_strided_weights_in_pieces_on_threads(monkeypatch, kernel_only, layout, threads):
    full = weight_of((96, 256), torch.bfloat16, seed=4)
    weight = {
        "rows apart": full[:, 64:224],
        "transposed": full[:80, :96].t(),
        "expanded": full[:1, :64].expand(40, 64),
    }[layout]
    global_scale = weight.float().abs().amax() / (448 * 6)
    monkeypatch.setattr(cpu_quantize, "ELEMENTS_PER_PIECE", 16 * weight.shape[1] + 5)  # pieces of 16 rows
    with torch_threads(threads):
        got = kernels.quantize_weight_nvfp4(weight, global_scale)
    monkeypatch.undo()
    assert_same(got, reference(weight, global_scale))


def weight_with(bad):
    weight = weight_of((8, 64), torch.float32, seed=2)
    weight[3, 17] = bad
    return weight


def given_scale_codes(*codes):
    """Block scales of ``weight_of((8, 64))`` with the first blocks' codes replaced."""
    weight = weight_of((8, 64), torch.float32, seed=2)
    scales = numerics.compute_block_scales(weight, weight.abs().amax() / (448 * 6)).view(torch.uint8).clone()
    for i, code in enumerate(codes):
        scales[i, i] = code
    return weight, scales.view(torch.float8_e4m3fn)


# Operands the kernel cannot code as the definition does: torchao's code for a NaN depends on its
# bits. The definition's answer is the call's.
NOT_CODED = {
    "NaN element": lambda: (weight_with(math.nan), None, None),
    "Inf element": lambda: (weight_with(math.inf), None, None),
    "-Inf element": lambda: (weight_with(-math.inf), None, None),
    "zero scale given": lambda: (*given_scale_codes(0x00), None),
    "negative zero scale given": lambda: (*given_scale_codes(0x80), None),
    "NaN scales given": lambda: (*given_scale_codes(0x7F, 0xFF), None),
    "reciprocal overflows": lambda: (torch.cat([torch.full((2, 1), 1e-36), torch.zeros(2, 31)], 1), None,
                                     torch.tensor(1e-36 / 2688)),
}


@pytest.mark.parametrize("case", NOT_CODED.values(), ids=NOT_CODED.keys())
def test_where_the_kernel_cannot_code_an_element_the_definition_answers(case):
    weight, given, global_scale = case()
    if global_scale is None:
        global_scale = torch.nan_to_num(weight.abs().amax(), posinf=1.0) / (448 * 6)
    assert cpu_kernel.library() is not None
    expected = reference(weight, global_scale, given)
    got = kernels.quantize_weight_nvfp4(weight, global_scale, given)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1].view(torch.uint8), expected[1].view(torch.uint8))


@pytest.mark.parametrize(
    "global_scale", [0.0, -1.0, math.inf, math.nan, [1.0, 1.0]], ids=["zero", "negative", "inf", "nan", "two values"]
)
def test_a_global_scale_the_kernel_does_not_take_goes_to_the_definition(monkeypatch, global_scale):
    calls = []
    monkeypatch.setattr(numerics, "quantize_nvfp4", lambda *args: calls.append(args) or "definition")
    weight = weight_of((4, 32), torch.float32, seed=1)
    assert cpu_quantize.quantize_nvfp4(weight, torch.tensor(global_scale)) == "definition"
    assert len(calls) == 1


def test_without_the_built_kernel_the_definition_runs(monkeypatch):
    monkeypatch.setenv(cpu_kernel.SWITCH_ENV_VAR, "0")
    monkeypatch.setattr(numerics, "quantize_nvfp4", lambda *args: "definition")
    assert kernels.quantize_weight_nvfp4(weight_of((4, 32), torch.float32, seed=1), torch.tensor(1.0)) == "definition"


@pytest.mark.parametrize(
    "weight, error, message",
    [
        (torch.ones(4, 24), ValueError, r"last dim 24 of shape \(4, 24\) is not a multiple of the NVFP4 block size 16"),
        (torch.ones(4, 40, dtype=torch.bfloat16), ValueError, r"last dim 40 of shape \(4, 40\)"),
        (torch.ones(4, 32, dtype=torch.int32), TypeError, r"torch.int32"),
        (torch.ones(4, 32, dtype=torch.float64), TypeError, r"torch.float64"),
    ],
    ids=["K of 24", "K of 40 in bfloat16", "int32", "float64"],
)
def test_weights_the_kernel_would_misread_are_refused_as_the_definition_refuses_them(weight, error, message):
    with pytest.raises(error, match=message):
        kernels.quantize_weight_nvfp4(weight, torch.tensor(1.0))


@pytest.mark.parametrize(
    "scales_shape", [(4, 1), (4, 3), (2, 2), (8,)], ids=["one block short", "one block over", "rows short", "1-D"]
)
def test_given_block_scales_of_another_shape_are_refused_naming_both(scales_shape):
    scales = torch.ones(scales_shape).to(torch.float8_e4m3fn)
    message = f"weight of shape (4, 32) must be float8_e4m3fn of shape (4, 2); got torch.float8_e4m3fn of shape {scales_shape}"
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.quantize_weight_nvfp4(torch.ones(4, 32), torch.tensor(1.0), scales)
