"""gptq.py, its kernel and the full-Hessian observer: GPTQ rounds a layer with less output error
than round-to-nearest with the same scales, stays valid NVFP4, reduces to round-to-nearest under
an identity Hessian, refuses bad input, and its converted models save and load like the others.
The Triton kernel of one block (kernels/gptq_block.py) equals ``references.gptq_block`` bit for
bit, under Triton's interpreter on CPU (``LAUNCHES``, run in one child process) and on CUDA."""

import pytest
import torch

from conftest import (
    DIM, calibration_batches, convert, make, prepare, quantized, reference_refused, requires_cuda, torch_threads,
)
from models import MLP
from triton_interpreter import run_interpreted

from nvfp4_static import NVFP4StaticActivationConfig, NVFP4StaticLinear, kernels, load_quantized, references
from nvfp4_static.gptq import damped_inverse_hessian_cholesky, gptq_quantize_nvfp4
from nvfp4_static.numerics import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e4m3_positive_values,
    per_tensor_amax_to_scale,
    quantize_nvfp4_unpacked,
    times_block_scales,
)
from nvfp4_static.observers import BlockHessianAccumulator, FullHessianAccumulator
from nvfp4_static.observers.full_hessian import block_diagonal
from nvfp4_static.observers.nvfp4_mse import GlobalAmaxTooSmallError
from nvfp4_static.references import fp8_scale_sweep, sweep_candidate_factors

GPTQ_BLOCK = "nvfp4_static.kernels.gptq_block:launch_gptq_block"
# Every interpreted launch of this file, by name: (launcher, args).
LAUNCHES: dict[str, tuple[str, tuple]] = {}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(LAUNCHES)


def correlated_layer(n: int = 32, k: int = 64, tokens: int = 256, seed: int = 0, device: str = "cpu"):
    """A weight ``[n, k]`` and inputs ``[tokens, k]`` whose features are correlated (a random
    mixing of Gaussian features plus the identity), as a real layer's inputs are: GPTQ's gain
    over round-to-nearest comes from the Hessian's off-diagonal."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(k, k, generator=generator) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=generator) @ mixing
    weight = torch.randn(n, k, generator=generator)
    return weight.to(device), x.to(device)


def dequantized(values, block_scales_e4m3, global_amax):
    return times_block_scales(values, per_tensor_amax_to_scale(global_amax) * block_scales_e4m3.float())


def output_error(x, weight, approximation) -> float:
    x, weight, approximation = x.double(), weight.double(), approximation.double()
    return float((x @ weight.T - x @ approximation.T).norm())


def round_to_nearest(weight, global_amax, block_scales_e4m3):
    values, _ = quantize_nvfp4_unpacked(weight, per_tensor_amax_to_scale(global_amax), block_scales_e4m3)
    return values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_has_less_output_error_than_round_to_nearest_on_the_calibration_data(seed):
    weight, x = correlated_layer(seed=seed)
    global_amax = weight.abs().amax()
    result = gptq_quantize_nvfp4(weight, x.T @ x, global_amax)
    gptq_error = output_error(x, weight, dequantized(*result, global_amax))
    same_scales = round_to_nearest(weight, global_amax, result.block_scales_e4m3)
    rtn_error = output_error(x, weight, dequantized(same_scales, result.block_scales_e4m3, global_amax))
    # The recipe GPTQ competes with: round to nearest with scales swept under the block Hessians.
    swept = fp8_scale_sweep(weight, global_amax, block_diagonal(x.T @ x))
    swept_error = output_error(x, weight, dequantized(round_to_nearest(weight, global_amax, swept), swept, global_amax))
    # On these inputs GPTQ removes about a third of the error (0.6-0.7x); 0.85 leaves room.
    assert gptq_error < 0.85 * rtn_error
    assert gptq_error < 0.85 * swept_error


def test_values_are_e2m1_and_scales_finite_positive_fp8():
    weight, x = correlated_layer(n=48, k=80, seed=3)
    weight[5, 17] = 40.0  # one outlier: later columns must saturate, not overflow the grid
    result = gptq_quantize_nvfp4(weight, x.T @ x, weight.abs().amax())
    grid = torch.tensor(E2M1_VALUES)
    assert result.values.shape == weight.shape and result.values.dtype == torch.float32
    assert torch.isin(result.values.abs(), grid).all()
    assert result.block_scales_e4m3.shape == (48, 5)
    assert result.block_scales_e4m3.dtype == torch.float8_e4m3fn
    assert torch.isin(result.block_scales_e4m3.float(), e4m3_positive_values()).all()


@pytest.mark.parametrize("scale", [1.0, 3e-4, 7e5], ids=["identity", "small", "large"])
def test_a_multiple_of_the_identity_hessian_gives_round_to_nearest_with_the_chosen_scales(scale):
    weight, _ = correlated_layer(n=24, k=160, seed=4)
    global_amax = weight.abs().amax()
    result = gptq_quantize_nvfp4(weight, scale * torch.eye(160), global_amax)
    assert torch.equal(result.values, round_to_nearest(weight, global_amax, result.block_scales_e4m3))


def test_an_all_zero_hessian_is_taken_as_the_identity():
    weight, _ = correlated_layer(n=16, k=32, seed=5)
    global_amax = weight.abs().amax()
    zero = gptq_quantize_nvfp4(weight, torch.zeros(32, 32), global_amax)
    identity = gptq_quantize_nvfp4(weight, torch.eye(32), global_amax)
    assert torch.equal(zero.values, identity.values)
    assert torch.equal(zero.block_scales_e4m3.view(torch.uint8), identity.block_scales_e4m3.view(torch.uint8))


def test_gptq_is_deterministic():
    weight, x = correlated_layer(n=40, k=272, seed=6)  # K over the 128-column lazy batch, not a multiple
    first = gptq_quantize_nvfp4(weight, x.T @ x, weight.abs().amax())
    second = gptq_quantize_nvfp4(weight.clone(), (x.T @ x).clone(), weight.abs().amax())
    assert torch.equal(first.values, second.values)
    assert torch.equal(first.block_scales_e4m3.view(torch.uint8), second.block_scales_e4m3.view(torch.uint8))


def test_the_weight_is_not_changed():
    weight, x = correlated_layer(n=16, k=64, seed=7)
    before = weight.clone()
    gptq_quantize_nvfp4(weight, x.T @ x, weight.abs().amax())
    assert torch.equal(weight, before)


def test_inverse_hessian_factor_is_upper_and_inverts_the_damped_hessian():
    _, x = correlated_layer(k=48, seed=8)
    hessian = (x.T @ x).double()
    upper = damped_inverse_hessian_cholesky(hessian.float(), dampening=0.05).double()
    assert torch.equal(upper, upper.triu())
    damped = hessian + 0.05 * hessian.diagonal().mean() * torch.eye(48, dtype=torch.float64)
    assert torch.allclose(upper.T @ upper @ damped, torch.eye(48, dtype=torch.float64), atol=1e-4)


def test_an_all_zero_weight_gives_zero_values_and_the_smallest_normal_scale():
    result = gptq_quantize_nvfp4(torch.zeros(16, 32), torch.eye(32), torch.tensor(0.0))
    assert torch.equal(result.values, torch.zeros(16, 32))
    assert (result.block_scales_e4m3.float() == 2.0**-6).all()


def test_a_global_amax_too_small_for_fp8_scales_is_refused():
    with pytest.raises(GlobalAmaxTooSmallError, match="too small"):
        gptq_quantize_nvfp4(torch.full((16, 16), 1e-34), torch.eye(16), torch.tensor(1e-34))


def _weight_and_hessian(k=32):
    weight, x = correlated_layer(n=16, k=k, seed=9)
    return weight, x.T @ x


def _bad_calls():
    weight, hessian = _weight_and_hessian()
    amax = weight.abs().amax()
    nan_hessian = hessian.clone()
    nan_hessian[3, 4] = float("nan")
    inf_hessian = hessian.clone()
    inf_hessian[0, 0] = float("inf")
    negative_diagonal = hessian.clone()
    negative_diagonal[7, 7] = -1.0
    indefinite = 2 * torch.ones(32, 32) - torch.eye(32)  # diagonal 1, eigenvalue -1
    nan_weight = weight.clone()
    nan_weight[0, 0] = float("nan")
    return {
        "hessian-too-small": ((weight, hessian[:16, :16], amax), {}, "does not match"),
        "hessian-not-square": ((weight, hessian[:, :16], amax), {}, "does not match"),
        "hessian-3d": ((weight, hessian.unsqueeze(0), amax), {}, "does not match"),
        "hessian-nan": ((weight, nan_hessian, amax), {}, "NaN or Inf"),
        "hessian-inf": ((weight, inf_hessian, amax), {}, "NaN or Inf"),
        "negative-diagonal": ((weight, negative_diagonal, amax), {}, "negative diagonal.*column 7"),
        "not-positive-definite": ((weight, indefinite, amax), {}, "not positive definite"),
        "k-not-multiple-of-16": ((weight[:, :24], hessian[:24, :24], amax), {}, "multiple of 16"),
        "weight-1d": ((weight[0], hessian, amax), {}, "multiple of 16"),
        "weight-nan": ((nan_weight, hessian, amax), {}, "weight holds NaN"),
        "amax-negative": ((weight, hessian, -amax), {}, "finite and >= 0"),
        "amax-nan": ((weight, hessian, torch.tensor(float("nan"))), {}, "finite and >= 0"),
        "dampening-zero": ((weight, hessian, amax), {"dampening": 0.0}, "dampening"),
        "dampening-inf": ((weight, hessian, amax), {"dampening": float("inf")}, "dampening"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_is_refused_with_a_message_naming_the_layer(case):
    args, kwargs, message = _bad_calls()[case]
    copies = [a.clone() for a in args]
    with pytest.raises(ValueError, match=message) as raised:
        gptq_quantize_nvfp4(*args, **kwargs, name="blocks.0.mlp")
    assert "blocks.0.mlp" in str(raised.value)
    for argument, copy in zip(args, copies):
        torch.testing.assert_close(argument, copy, rtol=0, atol=0, equal_nan=True)


# --- the observer -------------------------------------------------------------------------------


def test_full_hessian_sums_x_transpose_x_over_every_token():
    batches = [torch.randn(2, 5, 48), torch.randn(7, 48), torch.randn(1, 3, 2, 48)]
    accumulator = FullHessianAccumulator(48, name="layer")
    for batch in batches:
        accumulator.collect(batch)
    tokens = torch.cat([b.reshape(-1, 48) for b in batches]).double()
    assert accumulator.num_tokens == 23
    torch.testing.assert_close(accumulator.hessian.double(), tokens.T @ tokens, rtol=1e-5, atol=1e-4)


def test_its_diagonal_blocks_are_the_block_hessian():
    x = torch.randn(4, 30, 64)
    full, blocks = FullHessianAccumulator(64), BlockHessianAccumulator(64)
    full.collect(x)
    blocks.collect(x)
    assert block_diagonal(full.hessian).shape == (4, 16, 16)
    torch.testing.assert_close(block_diagonal(full.hessian), blocks.hessian, rtol=1e-5, atol=1e-4)


def test_a_non_finite_batch_is_refused_and_leaves_the_hessian_as_it_was():
    accumulator = FullHessianAccumulator(32, name="layers.3.down")
    accumulator.collect(torch.randn(8, 32))
    before = accumulator.hessian.clone()
    for bad in (float("nan"), float("inf"), 1e30):  # 1e30: finite, but its square overflows
        x = torch.randn(8, 32)
        x[2, 5] = bad
        with pytest.raises(ValueError, match="layers.3.down"):
            accumulator.collect(x)
        assert torch.equal(accumulator.hessian, before)
    assert accumulator.num_tokens == 8


def test_a_hessian_read_before_any_tokens_is_refused():
    with pytest.raises(RuntimeError, match=r"FullHessianAccumulator\('layers.0.q'\).*before any collect"):
        FullHessianAccumulator(32, name="layers.0.q").hessian


def test_merged_hessians_add_up():
    first, second, both = (FullHessianAccumulator(16) for _ in range(3))
    a, b = torch.randn(6, 16), torch.randn(9, 16)
    first.collect(a)
    second.collect(b)
    both.collect(a)
    both.collect(b)
    first.merge(second)
    assert first.num_tokens == 15
    torch.testing.assert_close(first.hessian, both.hessian)
    with pytest.raises(ValueError, match="cannot merge"):
        first.merge(BlockHessianAccumulator(16))


# --- the recipe ---------------------------------------------------------------------------------


def test_prepare_gives_each_layer_a_full_hessian_and_convert_stores_gptqs_codes():
    model = prepare(make(MLP), weight_scale="gptq")
    with torch.no_grad():
        for batch in calibration_batches():
            model(batch)
    observed = {name: model.get_submodule(name) for name in ("up", "down")}
    expected = {}
    for name, layer in observed.items():
        assert isinstance(layer.hessian_accumulator, FullHessianAccumulator)
        weight = layer.weight.detach()
        expected[name] = gptq_quantize_nvfp4(weight, layer.hessian_accumulator.hessian, weight.abs().amax())
    convert(model, weight_scale="gptq")
    for name, (values, scales) in expected.items():
        stored = model.get_submodule(name).weight
        assert stored.scale.view(torch.uint8).equal(scales.view(torch.uint8))
        assert torch.equal(dequantize_nvfp4(stored.qdata, stored.scale), times_block_scales(values, scales.float()))


def test_a_layer_prepared_without_a_full_hessian_is_refused_by_gptq_convert():
    model = prepare(make(MLP), weight_scale="hessian_mse")
    with torch.no_grad():
        model(calibration_batches(1)[0])
    with pytest.raises(ValueError, match="layer 'up' was prepared without a full input Hessian"):
        convert(model, weight_scale="gptq")


def test_a_gptq_prepared_layer_converts_with_hessian_mse_from_its_diagonal_blocks():
    model = prepare(make(MLP), weight_scale="gptq")
    with torch.no_grad():
        for batch in calibration_batches():
            model(batch)
    layer = model.get_submodule("down")
    weight = layer.weight.detach()
    expected = fp8_scale_sweep(weight, weight.abs().amax(), block_diagonal(layer.hessian_accumulator.hessian))
    convert(model, weight_scale="hessian_mse")
    assert model.down.weight.scale.view(torch.uint8).equal(expected.view(torch.uint8))


@pytest.mark.parametrize("dampening", [0.0, -0.01, float("nan"), float("inf")])
def test_config_refuses_a_dampening_that_is_not_positive_and_finite(dampening):
    with pytest.raises(ValueError, match="gptq_dampening"):
        NVFP4StaticActivationConfig(weight_scale="gptq", gptq_dampening=dampening)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_gptq_model_saves_and_loads_into_a_fresh_float_model(tmp_path, dtype):
    model = quantized(make(MLP, dtype), dtype, weight_scale="gptq")
    assert model.up.weight.dtype == dtype and model.up.recipe["weight_scale"] == "gptq"
    path = tmp_path / "gptq.pt"
    torch.save(model.state_dict(), path)
    fresh = make(MLP, dtype, seed=1)
    load_quantized(fresh, path)
    assert isinstance(fresh.up, NVFP4StaticLinear) and fresh.up.recipe == model.up.recipe
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


@requires_cuda
def test_gptq_on_cuda_beats_round_to_nearest_and_converts():
    weight, x = correlated_layer(n=64, k=256, seed=10, device="cuda")
    global_amax = weight.abs().amax()
    result = gptq_quantize_nvfp4(weight, x.T @ x, global_amax)
    assert result.values.is_cuda
    same_scales = round_to_nearest(weight, global_amax, result.block_scales_e4m3)
    rtn = dequantized(same_scales, result.block_scales_e4m3, global_amax)
    assert output_error(x, weight, dequantized(*result, global_amax)) < 0.85 * output_error(x, weight, rtn)
    model = quantized(make(MLP).cuda(), batches=[b.cuda() for b in calibration_batches()], weight_scale="gptq")
    assert model.up.weight.qdata.is_cuda


# --- the kernel of one block --------------------------------------------------------------------


def block_operands(n_rows: int, seed: int, block_index: int = 1, candidates=slice(None), device: str = "cpu"):
    """``references.gptq_block``'s operands for block ``block_index`` of a ``[n_rows, 48]``
    correlated layer: the block as a strided view of the weight (rows 48 apart), its 16x16 block
    of ``U``, and the factors of the FP8 candidates ``candidates`` (a slice keeps interpreted
    runs short). Some rows are edge cases: an outlier (later columns saturate), zeros of both
    signs (every candidate ties: the first wins), tiny values."""
    weight, x = correlated_layer(n=n_rows, k=48, seed=seed)
    weight[1, 16:24] *= 50.0
    weight[2, 16:32] = 0.0
    weight[3, 16:32:2] = -0.0
    weight[4, 16:32] *= 1e-6
    global_amax = weight[:, 20:].abs().amax()  # some rows of the block lie above it and clip
    upper = damped_inverse_hessian_cholesky(x.T @ x)
    start = 16 * block_index
    reciprocals, dequant_scales = sweep_candidate_factors(global_amax, torch.device(device))
    return (weight.to(device)[:, start : start + 16], upper[start : start + 16, start : start + 16].to(device),
            reciprocals[candidates], dequant_scales[candidates])


# name: (rows, seed, block, candidates): all 126 candidates on one program; 24 of them on two
# programs, the second partial, in the last block. (The interpreter takes about 0.05 s per
# candidate and program.)
BLOCK_CASES = {
    "6-rows-all-candidates": (6, 11, 1, slice(None)),
    "37-rows-last-block": (37, 13, 2, slice(80, 104)),
}
LAUNCHES.update({f"gptq-block-{name}": (GPTQ_BLOCK, block_operands(*case)) for name, case in BLOCK_CASES.items()})


def assert_same_block_result(got, expected):
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        # bit for bit: -0.0 and +0.0 are different E2M1 codes
        assert torch.equal(ours.view(torch.int32) if ours.is_floating_point() else ours,
                           theirs.view(torch.int32) if theirs.is_floating_point() else theirs)


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_gptq_block_kernel_equals_the_reference_interpreted(interpreted, case):
    launched = interpreted[f"gptq-block-{case}"]
    expected = references.gptq_block(*launched.args)
    assert len(set(expected[2].tolist())) > 1  # rows choose different scales
    assert_same_block_result(launched.returned, expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, block_index", [(6, 1), (37, 2), (200, 0)], ids=str)
def test_gptq_block_op_on_a_cpu_takes_its_c_kernel_equal_to_the_reference(monkeypatch, rows, block_index, threads):
    """The op's CPU kernel (backends/cpu_gptq.c), in 16-row tiles and, with 200 rows, in pieces
    on torch's threads; the torch reference made to fail inside the op, so the kernel ran."""
    from nvfp4_static.backends import cpu_gptq

    operands = block_operands(rows, seed=rows, block_index=block_index)
    expected = references.gptq_block(*operands)
    assert len(set(expected[2].tolist())) > 1  # rows choose different scales
    reference_refused(monkeypatch, "gptq_block")
    monkeypatch.setattr(cpu_gptq, "ROWS_PER_PIECE", 32)
    with torch_threads(threads):
        assert_same_block_result(kernels.gptq_block(*operands), expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ops: (ops[0].to(torch.bfloat16), *ops[1:]), r"block must be float32 \[N, 16\], got torch.bfloat16 \(6, 16\)"),
        (lambda ops: (ops[0][:, :8], *ops[1:]), r"block must be float32 \[N, 16\], got torch.float32 \(6, 8\)"),
        (lambda ops: (ops[0], ops[1][:8], *ops[2:]), r"the U block must be \[16, 16\], got \(8, 16\)"),
        (lambda ops: (*ops[:3], ops[3][:5]), r"two 1-D tensors of one length, got \(126,\) and \(5,\)"),
    ],
    ids=["bf16 block", "8 columns", "U of 8 rows", "factors of two lengths"],
)
def test_gptq_block_op_refuses_operands_it_would_misread(change, message):
    with pytest.raises(ValueError, match=message):
        kernels.gptq_block(*change(block_operands(6, seed=6)))


@requires_cuda
def test_gptq_block_op_equals_the_reference_on_cuda():
    for rows in (37, 1000, 4100):
        operands = block_operands(rows, seed=14, device="cuda")
        assert_same_block_result(kernels.gptq_block(*operands), references.gptq_block(*operands))
