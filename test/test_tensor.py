"""NVFP4StaticTensor: torchao layout, type preservation, and the static-activation linear."""

import io
import multiprocessing
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from torch._dynamo.testing import CompileCounter
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.utils import TorchAOBaseTensor

from nvfp4_static.backends import resolve_backend
from nvfp4_static.numerics import dequantize_nvfp4, quantize_nvfp4
from nvfp4_static.tensor import NVFP4StaticTensor

ACT_AMAX = torch.tensor(5.0)


def make_weight(dtype=torch.bfloat16, shape=(64, 128), seed=0):
    torch.manual_seed(seed)
    return torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_from_float_matches_torchao_to_nvfp4(dtype):
    w = make_weight(dtype)
    ours = NVFP4StaticTensor.from_float(w, ACT_AMAX)
    theirs = NVFP4Tensor.to_nvfp4(
        w,
        per_tensor_scale=per_tensor_amax_to_scale(w.abs().amax()),
        act_per_tensor_scale=per_tensor_amax_to_scale(ACT_AMAX),
    )
    assert torch.equal(ours.qdata, theirs.qdata)
    assert torch.equal(ours.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(ours.per_tensor_scale, theirs.per_tensor_scale)
    assert torch.equal(ours.act_per_tensor_scale, theirs.act_per_tensor_scale)
    assert torch.equal(ours.dequantize(), theirs.dequantize())


@pytest.mark.parametrize("amax", [1e-35, 0.0, -5.0, float("inf"), float("nan")],
                         ids=["overflowing reciprocals", "zero", "negative", "inf", "nan"])
def test_from_float_refuses_an_activation_amax_nvfp4_cannot_quantize_with(amax):
    with pytest.raises(ValueError, match=f"activation global amax {amax:.3g} is below what NVFP4 can quantize"):
        NVFP4StaticTensor.from_float(make_weight(), torch.tensor(amax))


@pytest.mark.parametrize(
    "amax", [float("nan"), float("inf"), -1.0, 0.0, 0.5],
    ids=["nan", "inf", "negative", "zero", "under max |w|"],
)
def test_from_float_refuses_a_weight_amax_that_would_not_quantize_the_weight_given(amax):
    """NaN or Inf quantized to NaN outputs; a negative one flipped signs; zero or one under the
    weight's max |w| saturated block scales (relative output error near 1)."""
    weight = make_weight()
    message = rf"weight global amax {amax:.6g} cannot quantize a weight whose max \|w\| is"
    with pytest.raises(ValueError, match=message):
        NVFP4StaticTensor.from_float(weight, ACT_AMAX, weight_global_amax=torch.tensor(amax))


@pytest.mark.parametrize(
    "amax", [torch.tensor([1.0, 2.0]), torch.ones(1, 2), torch.tensor(True), "5.0"],
    ids=["two elements", "two by one", "bool", "string"],
)
@pytest.mark.parametrize("argument", ["act_global_amax", "weight_global_amax"])
def test_from_float_refuses_an_amax_that_is_not_one_number(argument, amax):
    amaxes = {"act_global_amax": ACT_AMAX, argument: amax}
    with pytest.raises(ValueError, match=f"from_float takes {argument} as one real number"):
        NVFP4StaticTensor.from_float(make_weight(), **amaxes)


def test_from_float_takes_amaxes_as_python_numbers_or_larger_than_the_weight():
    """A tied group's amax is at least each member's max |w|; numbers are the same amax."""
    weight = make_weight()
    own = NVFP4StaticTensor.from_float(weight, ACT_AMAX)
    as_numbers = NVFP4StaticTensor.from_float(weight, 5.0, weight_global_amax=float(weight.abs().amax()))
    assert torch.equal(as_numbers.qdata, own.qdata) and torch.equal(as_numbers.per_tensor_scale, own.per_tensor_scale)
    larger = NVFP4StaticTensor.from_float(weight, ACT_AMAX, weight_global_amax=3 * weight.abs().amax())
    reference = dequantize_nvfp4(own.qdata, own.scale, own.per_tensor_scale).float()
    assert (larger.dequantize().float() - reference).norm() / reference.norm() < 0.2


def check_all_zero_weight_quantized_to_zeros(weight_global_amax, device):
    """Its block max under a zero global scale is 0 / 0, and each element 0 times an infinite
    reciprocal, NaN: its codes are zeros on every device, not the device's code for NaN."""
    weight = torch.zeros(64, 128, dtype=torch.bfloat16, device=device)
    q = NVFP4StaticTensor.from_float(weight, ACT_AMAX, weight_global_amax=weight_global_amax)
    out = F.linear(torch.randn(3, 128, dtype=torch.bfloat16, device=device), q)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(q.qdata, torch.zeros(64, 64, dtype=torch.uint8, device=device))
    assert torch.equal(q.scale.float().cpu(), torch.full((64, 8), 2.0**-6))


@pytest.mark.parametrize("weight_global_amax", [None, 0.0], ids=["its own", "zero given"])
def test_from_float_quantizes_an_all_zero_weight_to_zeros(weight_global_amax):
    check_all_zero_weight_quantized_to_zeros(weight_global_amax, "cpu")


@requires_cuda
@pytest.mark.parametrize("weight_global_amax", [None, 0.0], ids=["its own", "zero given"])
def test_gpu_from_float_quantizes_an_all_zero_weight_to_zeros(weight_global_amax):
    check_all_zero_weight_quantized_to_zeros(weight_global_amax, "cuda")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_from_float_refuses_a_weight_with_non_finite_values(value):
    weight = make_weight()
    weight[3, 5] = value
    with pytest.raises(ValueError, match="from_float needs a finite weight"):
        NVFP4StaticTensor.from_float(weight, ACT_AMAX)


def constructor_variants():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)

    def built(**changes):
        fields = dict(qdata=q.qdata, scale=q.scale, block_size=16, orig_dtype=torch.bfloat16,
                      per_tensor_scale=q.per_tensor_scale, act_per_tensor_scale=q.act_per_tensor_scale)
        fields.update(changes)
        return NVFP4StaticTensor(**fields)

    return {
        "e5m2 scales": lambda: built(scale=q.scale.view(torch.float8_e5m2)),
        "uint8 scales": lambda: built(scale=q.scale.view(torch.uint8)),
        "int8 codes": lambda: built(qdata=q.qdata.view(torch.int8)),
        "scales of half the blocks": lambda: built(scale=q.scale[:, :4]),
        "scales of other rows": lambda: built(scale=q.scale[:32]),
        "1-d scales": lambda: built(scale=q.scale.reshape(-1)),
        "an int8 weight": lambda: built(orig_dtype=torch.int8),
        "a float64 weight": lambda: built(orig_dtype=torch.float64),
        "no weight scale": lambda: built(per_tensor_scale=None),
        "no activation scale": lambda: built(act_per_tensor_scale=None),
        "a float activation scale": lambda: built(act_per_tensor_scale=0.5),
        "a weight scale per row": lambda: built(per_tensor_scale=q.per_tensor_scale.expand(64).clone()),
        "an empty activation scale": lambda: built(act_per_tensor_scale=torch.ones(0)),
    }


@pytest.mark.parametrize("variant", constructor_variants().keys())
def test_codes_and_scales_that_do_not_describe_one_weight_are_refused(variant):
    with pytest.raises(ValueError, match="an NVFP4StaticTensor (holds uint8 codes|stands for a weight of dtype|holds its)"):
        constructor_variants()[variant]()


TYPE_PRESERVING_OPS = {
    "t": lambda w: w.t(),
    "t_t": lambda w: w.t().t(),
    "transpose": lambda w: w.transpose(0, 1),
    "view": lambda w: w.view(2, 32, 128),
    "to_dtype": lambda w: w.to(torch.float32),
    "to_device": lambda w: w.to("cpu"),
    "to_meta": lambda w: w.to("meta"),
    "slice_rows": lambda w: w[16:48],
    "slice_cols": lambda w: w[:, 32:96],
    "detach": lambda w: w.detach(),
    "clone": lambda w: w.clone(),
}


@pytest.mark.parametrize("op", TYPE_PRESERVING_OPS.values(), ids=TYPE_PRESERVING_OPS.keys())
def test_ops_keep_the_subclass_and_its_attributes(op):
    w = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX, backend_override="cpu")
    out = op(w)
    assert type(out) is NVFP4StaticTensor
    assert out.backend_override == "cpu"
    assert out.act_per_tensor_scale is not None
    assert out.output_scale == w.output_scale


def test_output_scale_is_the_fp32_product_of_both_global_scales():
    w = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    product = w.act_per_tensor_scale.float() * w.per_tensor_scale.float()
    assert w.output_scale == product.item() and w.output_scale > 0
    assert NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX).to("meta").output_scale == w.output_scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory_keeps_the_subclass():
    w = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    pinned = w.pin_memory()
    assert type(pinned) is NVFP4StaticTensor and pinned.is_pinned()


def test_module_to_meta_keeps_the_subclass():
    linear = torch.nn.Linear(128, 64)
    linear.weight = torch.nn.Parameter(
        NVFP4StaticTensor.from_float(linear.weight, ACT_AMAX), requires_grad=False
    )
    linear.to("meta")
    assert type(linear.weight) is NVFP4StaticTensor
    assert linear.weight.device.type == "meta"


def test_shape_and_dtype_present_as_the_float_weight():
    w = make_weight(torch.bfloat16, (48, 256))
    q = NVFP4StaticTensor.from_float(w, ACT_AMAX)
    assert q.shape == w.shape and q.dtype == w.dtype
    assert q.to(torch.float16).dequantize().dtype == torch.float16


def test_transpose_then_dequantize_equals_dequantize_then_transpose():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    assert torch.equal(q.t().dequantize(), q.dequantize().t())


@pytest.mark.parametrize("rows, cols", [((0, 64), (16, 48)), ((8, 40), (0, 128))], ids=["cols", "rows"])
def test_aligned_slice_equals_sliced_dequantize(rows, cols):
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    sliced = q[rows[0] : rows[1], cols[0] : cols[1]]
    assert torch.equal(sliced.dequantize(), q.dequantize()[rows[0] : rows[1], cols[0] : cols[1]])


@pytest.mark.parametrize("index", [lambda w: w[0], lambda w: w[-1], lambda w: w.select(0, 3), lambda w: w[:, 5]],
                         ids=["first row", "last row", "select", "one column"])
def test_indexing_down_to_one_dim_is_refused_naming_the_shape(index):
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    with pytest.raises(NotImplementedError, match=r"NVFP4StaticTensor of shape \(64, 128\) cannot be indexed down"):
        index(q)


def test_unaligned_column_slice_is_an_error():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    with pytest.raises(ValueError, match="multiples of 16"):
        q[:, 8:40]


def unflattened(q, **metadata_changes):
    """``q`` rebuilt from its own flatten (its inner tensors, not copies), as a trace or an
    unwrapped model rebuilds it, with ``metadata_changes`` applied to the metadata."""
    names, metadata = q.__tensor_flatten__()
    inner = {name: getattr(q, name) for name in names}
    return NVFP4StaticTensor.__tensor_unflatten__(inner, {**metadata, **metadata_changes}, q.shape, q.stride())


def layout_variants():
    """Ways to build an NVFP4StaticTensor from a valid one's data with one layout field changed."""
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    data = (q.qdata, q.scale)

    def built(block_size=16, is_swizzled_scales=False):
        return NVFP4StaticTensor(
            *data, block_size, q.orig_dtype, q.per_tensor_scale, q.act_per_tensor_scale,
            is_swizzled_scales=is_swizzled_scales,
        )

    return {
        "block_size 32": (lambda: built(block_size=32), "block_size=32"),
        "block_size 8": (lambda: built(block_size=8), "block_size=8"),
        "swizzled": (lambda: built(is_swizzled_scales=True), "is_swizzled_scales=True"),
        "swizzled, rebuilt from a flatten": (lambda: unflattened(q, is_swizzled_scales=True), "is_swizzled_scales=True"),
        "block_size 32, rebuilt from a flatten": (lambda: unflattened(q, block_size=32), "block_size=32"),
    }


@pytest.mark.parametrize("variant", layout_variants().keys())
def test_a_layout_the_backends_would_misread_is_refused(variant):
    """The backends read 16-element blocks and row-major block scales; another layout of the
    same tensors would give wrong outputs with no error."""
    build, message = layout_variants()[variant]
    with pytest.raises(ValueError, match=message):
        build()


def test_flatten_unflatten_round_trip():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    reshaped = q.view(4, 16, 128).view(64, 128)
    assert torch.equal(reshaped.dequantize(), q.dequantize())


def torchaos_flatten(q):
    """torchao's flatten of ``q`` less ``output_scale``, which ours leaves out."""
    names, metadata = TorchAOBaseTensor.__tensor_flatten__(q)
    return names, {name: value for name, value in metadata.items() if name != "output_scale"}


FIELD_SETS = {
    "backend_override": lambda q: setattr(q, "backend_override", "cpu"),
    "per_tensor_scale dropped": lambda q: setattr(q, "per_tensor_scale", None),
    "block_size": lambda q: setattr(q, "block_size", 32),
    "orig_dtype": lambda q: setattr(q, "orig_dtype", torch.float16),
}


@pytest.mark.parametrize("set_field", FIELD_SETS.values(), ids=FIELD_SETS.keys())
def test_flatten_is_torchaos_after_a_field_is_set(set_field):
    """The kept flatten follows every change; the dict handed out before is left as it was, so a
    guard holding it tells the old metadata from the new."""
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    names, metadata = q.__tensor_flatten__()
    assert (names, metadata) == torchaos_flatten(q)
    kept = dict(metadata)
    set_field(q)
    assert q.__tensor_flatten__() == torchaos_flatten(q)
    assert q.__tensor_flatten__() != (names, kept)
    assert metadata == kept


def test_the_flatten_leaves_out_the_host_copy_of_the_scales_product():
    """A traced graph is built from the flatten: without ``output_scale`` it cannot hold the
    product as a constant, and other global scales copied in place leave the metadata as it was."""
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    before = q.output_scale
    names, metadata = q.__tensor_flatten__()
    assert "output_scale" not in metadata and before not in metadata.values()
    q.copy_(NVFP4StaticTensor.from_float(make_weight(seed=1), ACT_AMAX * 3))
    assert q.output_scale != before
    assert q.__tensor_flatten__() == (names, metadata)


def test_a_weight_rebuilt_from_its_flatten_leaves_the_product_unread():
    """A rebuild (tracing, or each call of a model torchao unwrapped) does not read the scales,
    which would sync a GPU; its linear scales by the scale tensors and gives the same output."""
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    names, _ = q.__tensor_flatten__()
    rebuilt = unflattened(q)
    assert rebuilt.output_scale is None and q.output_scale is not None
    assert all(getattr(rebuilt, name) is getattr(q, name) for name in names)
    x = make_weight(shape=(4, 128), seed=2)
    assert torch.equal(F.linear(x, rebuilt), F.linear(x, q))


def test_a_compiled_call_recompiles_when_the_weights_metadata_changes():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    counter = CompileCounter()
    compiled = torch.compile(lambda x, w: F.linear(x, w), backend=counter, fullgraph=True)
    x = make_weight(shape=(4, 128), seed=2)
    compiled(x, q)
    compiled(x, q)
    assert counter.frame_count == 1
    q.backend_override = "cpu"
    compiled(x, q)
    assert counter.frame_count == 2


def test_a_compiled_call_takes_other_global_scales_copied_in_place_without_recompiling():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    counter = CompileCounter()
    compiled = torch.compile(lambda x, w: F.linear(x, w), backend=counter, fullgraph=True)
    x = make_weight(shape=(4, 128), seed=2)
    before = compiled(x, q)
    q.copy_(NVFP4StaticTensor.from_float(make_weight(seed=1), ACT_AMAX * 3))
    out = compiled(x, q)
    assert counter.frame_count == 1
    assert not torch.equal(out, before)
    assert torch.equal(out, F.linear(x, q))


def test_a_pickled_weight_carries_no_flatten_cache():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    q.__tensor_flatten__()
    buffer = io.BytesIO()
    torch.save(q, buffer)
    assert b"_flattened" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert loaded.__tensor_flatten__() == torchaos_flatten(q)


def zero_the_codes_in_a_child_process(model):
    process = multiprocessing.get_context("fork").Process(target=lambda: model[0].weight.qdata.zero_())
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "not shared"])
def test_share_memory_shares_every_inner_tensor_with_child_processes(shared):
    """torch's own sharing of the wrapper's (empty) storage crashed the process."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    model[0].weight = torch.nn.Parameter(NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX), requires_grad=False)
    weight = model[0].weight
    assert not weight.is_shared()
    if shared:
        assert model.share_memory() is model and model[0].weight is weight
        assert weight.is_shared() and all(getattr(weight, name).is_shared() for name in weight.__tensor_flatten__()[0])
    zero_the_codes_in_a_child_process(model)
    assert bool((weight.qdata == 0).all()) == shared  # the child's write is seen here only if shared


def reference_linear(x, q, bias):
    """fp64 product of the dequantized operands (global scales applied after), cast like ours."""
    act_q, act_s = quantize_nvfp4(x.reshape(-1, x.shape[-1]), q.act_per_tensor_scale)
    act = dequantize_nvfp4(act_q, act_s).double()
    weight = dequantize_nvfp4(q.qdata, q.scale).double()
    out = act @ weight.t() * (q.act_per_tensor_scale.double() * q.per_tensor_scale.double())
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], -1)


LINEAR_CALLS = {
    "F.linear": lambda x, q, b: F.linear(x, q, b),
    "matmul": lambda x, q, b: x @ q.t() + (0 if b is None else b),
    "mm": lambda x, q, b: torch.mm(x.reshape(-1, x.shape[-1]), q.t()).reshape(*x.shape[:-1], -1)
    + (0 if b is None else b),
    "addmm": lambda x, q, b: torch.addmm(
        torch.zeros(q.shape[0], dtype=x.dtype) if b is None else b, x.reshape(-1, x.shape[-1]), q.t()
    ).reshape(*x.shape[:-1], -1),
}


@pytest.mark.parametrize("call", LINEAR_CALLS.values(), ids=LINEAR_CALLS.keys())
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("x_shape", [(6, 128), (2, 5, 128)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_is_the_faithful_nvfp4_gemm(call, with_bias, x_shape, dtype):
    torch.manual_seed(1)
    q = NVFP4StaticTensor.from_float(make_weight(dtype), ACT_AMAX)
    x = torch.randn(x_shape, dtype=dtype)
    bias = torch.randn(64, dtype=dtype) if with_bias else None
    out = call(x, q, bias)
    ref = reference_linear(x, q, bias)
    assert out.shape == ref.shape and out.dtype == dtype
    # fp32: only summation order differs; bf16: the output's own rounding (2^-8), plus one more
    # rounding when the test adds the bias outside the op.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (out.double() - ref).norm() / ref.norm() <= tolerance


WRONG_ORIENTATION_CALLS = {
    "matmul": (lambda x, q: x @ q, "mm multiplies by an NVFP4StaticTensor only as x @ w.t()"),
    "mm": (lambda x, q: torch.mm(x, q), "mm multiplies by an NVFP4StaticTensor only as x @ w.t()"),
    "addmm": (lambda x, q: torch.addmm(torch.zeros(64), x, q), "addmm multiplies by an NVFP4StaticTensor only"),
    "F.linear of w.t()": (lambda x, q: F.linear(x, q.t()), "linear takes an NVFP4StaticTensor weight as"),
    "F.linear of w.mT": (lambda x, q: F.linear(x, q.mT), "linear takes an NVFP4StaticTensor weight as"),
    "F.linear of w.transpose": (lambda x, q: F.linear(x, q.transpose(0, 1)), "linear takes an NVFP4StaticTensor"),
}


@pytest.mark.parametrize("call, message", WRONG_ORIENTATION_CALLS.values(), ids=WRONG_ORIENTATION_CALLS.keys())
def test_a_square_weight_in_the_orientation_the_gemm_cannot_multiply_by_is_refused(call, message):
    """On a square weight every orientation has matching shapes: x @ w is not x @ w.t()."""
    q = NVFP4StaticTensor.from_float(make_weight(torch.float32, shape=(64, 64)), ACT_AMAX)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(torch.randn(3, 64), q)


def test_a_transposed_weight_made_contiguous_or_cloned_stays_the_same_matrix():
    q = NVFP4StaticTensor.from_float(make_weight(torch.float32, shape=(64, 32)), ACT_AMAX)
    x = torch.randn(3, 32)
    expected = F.linear(x, q)
    for transposed in (q.t().contiguous(), q.t().clone()):
        assert transposed.shape == (32, 64) and transposed.is_transposed()
        assert torch.equal(x @ transposed, expected)
        assert torch.equal(transposed.t().dequantize(torch.float32), q.dequantize(torch.float32))
    copy = q.clone()
    copy.act_per_tensor_scale.mul_(2)  # a clone shares no tensor with the original
    assert torch.equal(F.linear(x, q), expected)


def test_f_linear_is_handled_whole_without_transposing_the_weight(monkeypatch):
    """F.linear reaches the subclass's own handler (one call, any leading dims) rather than its
    decomposition into a transpose, which builds a new weight object on every call."""
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    expected = reference_linear(x, q, None)

    def no_rewrap(*args, **kwargs):
        raise AssertionError("F.linear rewrapped (transposed) the weight")

    monkeypatch.setattr(NVFP4StaticTensor, "_rewrap", no_rewrap)
    out = F.linear(x, q)
    assert (out.double() - expected).norm() / expected.norm() <= 8e-3


def test_linear_under_inference_mode_equals_no_grad():
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = F.linear(x, q)
    with torch.inference_mode():
        assert torch.equal(F.linear(x, q), expected)


def test_activation_is_quantized_with_the_static_scale_not_a_dynamic_one():
    """Scaling the input up 4x must clip at the calibrated range, as static NVFP4 does."""
    q = NVFP4StaticTensor.from_float(make_weight(torch.float32), torch.tensor(1.0))
    x = torch.randn(8, 128)
    x = x / x.abs().amax()
    small, large = F.linear(x, q), F.linear(4 * x, q)
    assert not torch.allclose(large, 4 * small, rtol=1e-2)
    assert torch.allclose(large.double(), reference_linear(4 * x, q, None), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "shape", [(2, 64), (2, 3, 256), (64,), ()], ids=["2d", "3d", "1d", "0d"]
)
def test_an_activation_of_the_wrong_width_is_a_clear_error(shape):
    q = NVFP4StaticTensor.from_float(make_weight(), ACT_AMAX)
    with pytest.raises(ValueError, match=rf"shape {re.escape(str(shape))} .*in_features 128"):
        F.linear(torch.randn(shape, dtype=torch.bfloat16), q)


def test_backend_override_and_env_var(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend(cpu) == "cpu"
    assert resolve_backend(cpu, "triton") == "triton"
    monkeypatch.setenv("NVFP4_STATIC_BACKEND", "blackwell")
    assert resolve_backend(cpu) == "blackwell"
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        resolve_backend(cpu, "cuda")
