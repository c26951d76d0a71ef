"""kernels/histogram.py, scale_sweep.py, block_hessian.py and their ops, and the sweep's C kernel
on a CPU (backends/cpu_sweep.c): each kernel equals its reference.

On CPU the kernels run under Triton's interpreter: ``LAUNCHES`` gathers every launch the
``_interpreted`` tests check, each beside its test, and the ``interpreted`` fixture runs them all
in one ``TRITON_INTERPRET=1`` child process (see triton_interpreter). On a CUDA machine the
``_on_cuda`` tests check the dispatching ops on real shapes, and a calibration forward compiled
with ``fullgraph=True``.
"""

import copy

import pytest
import torch
from conftest import DTYPE_IDS, DTYPES, reference_refused, requires_cuda, torch_threads
from triton_interpreter import run_interpreted

from nvfp4_static import kernels, references
from nvfp4_static.kernels.scale_sweep import launch_fp8_scale_sweep

HISTOGRAM = "nvfp4_static.kernels.histogram:launch_block_amax_histogram"
SWEEP = "nvfp4_static.kernels.scale_sweep:launch_fp8_scale_sweep"
BLOCK_HESSIAN = "nvfp4_static.kernels.block_hessian:launch_block_hessian"
BIN_EDGES = references.histogram_bin_edges(num_bins=512, log2_min=-40.0, log2_max=40.0)

# Every interpreted launch of this file, by name: (launcher, args).
LAUNCHES: dict[str, tuple[str, tuple]] = {}


@pytest.fixture(scope="module")
def interpreted():
    """Each name of ``LAUNCHES``: its ``Launched`` (args after the launch, and its return value)."""
    return run_interpreted(LAUNCHES)


def activation(shape, dtype, seed, device="cpu"):
    """Block amaxes spread over 2^-50 .. 2^50 (past both ends of the bins), with zero blocks."""
    generator = torch.Generator().manual_seed(seed)
    *lead, k = shape
    n_blocks = -(-k // 16)
    exponents = torch.randint(-50, 50, (*lead, n_blocks, 1), generator=generator)
    x = (torch.randn(*lead, n_blocks, 16, generator=generator) * 2.0**exponents.float())
    x = x.reshape(*lead, n_blocks * 16)[..., :k].contiguous()
    x.view(-1, k)[::3, : min(k, 32)] = 0.0
    finite = torch.finfo(dtype).max / 2
    return x.clamp(-finite, finite).to(device=device, dtype=dtype)


def histogram_launch(x, counts=None, amax=None):
    """The histogram launcher on ``x``, adding into ``counts`` and ``amax`` (zeros by default)."""
    counts = torch.zeros(BIN_EDGES.numel() + 1, dtype=torch.int64) if counts is None else counts
    amax = torch.zeros(()) if amax is None else amax
    return HISTOGRAM, (x, counts, amax, BIN_EDGES.to(x.device))


def reference_histogram(x, counts=None, amax=None):
    counts = torch.zeros(BIN_EDGES.numel() + 1, dtype=torch.int64) if counts is None else counts
    amax = torch.zeros(()) if amax is None else amax
    batch_counts, batch_amax = references.block_amax_histogram(x, BIN_EDGES.to(x.device))
    return counts + batch_counts.to(counts.device), torch.maximum(amax, batch_amax.to(amax.device))


def assert_same_histogram(got, expected):
    assert torch.equal(got[0].cpu(), expected[0].cpu())
    assert got[1].item() == expected[1].item()


# K = 72: the last block of each row is ragged (8 columns, zero-padded logically).
LAUNCHES.update({f"histogram-{dtype}": histogram_launch(activation((3, 7, 72), dtype, seed=0)) for dtype in DTYPES})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_histogram_kernel_matches_reference_interpreted(interpreted, dtype):
    x, counts, amax, _ = interpreted[f"histogram-{dtype}"].args
    assert_same_histogram((counts, amax), reference_histogram(x))


def accumulating_launches():
    """Two launches into the same counts and max: the second adds to what the first wrote."""
    first_launch = histogram_launch(activation((20, 64), torch.float32, 1))
    _, (_, counts, amax, _) = first_launch
    return {
        "histogram-first": first_launch,
        "histogram-second": histogram_launch(activation((9, 48), torch.float32, 2), counts, amax),
    }


LAUNCHES.update(accumulating_launches())


def test_histogram_kernel_accumulates_in_place_interpreted(interpreted):
    first = interpreted["histogram-first"].args[0]
    second, counts, amax, _ = interpreted["histogram-second"].args
    expected = reference_histogram(second, *reference_histogram(first))
    assert_same_histogram((counts, amax), expected)


def amaxes_at_and_beside_every_edge():
    edges = BIN_EDGES
    amaxes = torch.cat(
        [edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e38))]
    )
    x = torch.rand(amaxes.numel(), 16, generator=torch.Generator().manual_seed(3)) * amaxes[:, None]
    x[:, 5] = -amaxes  # the block amax, with a negative sign
    return x


LAUNCHES["histogram-edges"] = histogram_launch(amaxes_at_and_beside_every_edge())


def test_histogram_kernel_bins_values_at_and_beside_every_edge_interpreted(interpreted):
    """The log2 guess is one bin off right at an edge; the edge comparisons must fix it."""
    x, counts, amax, _ = interpreted["histogram-edges"].args
    assert_same_histogram((counts, amax), reference_histogram(x))


LAUNCHES.update(
    {
        f"histogram-{magnitude}": histogram_launch(
            torch.randn(5, 40, generator=torch.Generator().manual_seed(4)) * magnitude
        )
        for magnitude in (1e-30, 1e30)
    }
)


@pytest.mark.parametrize("magnitude", [1e-30, 1e30], ids=["1e-30", "1e30"])
def test_histogram_kernel_extreme_magnitudes_interpreted(interpreted, magnitude):
    x, counts, amax, _ = interpreted[f"histogram-{magnitude}"].args
    assert_same_histogram((counts, amax), reference_histogram(x))


NON_FINITE = [float("nan"), float("inf"), -float("inf")]


def with_non_finite(bad, dtype):
    x = activation((6, 48), dtype, seed=5)
    x[4, 37] = bad
    return x


LAUNCHES.update(
    {
        f"histogram-{bad}-{dtype}": histogram_launch(with_non_finite(bad, dtype))
        for dtype in DTYPES
        for bad in NON_FINITE
    }
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_histogram_kernel_max_carries_non_finite_values_interpreted(interpreted, dtype, bad):
    """The observer refuses a batch by its non-finite running max: a NaN or Inf anywhere in the
    input must reach it, whatever else the tile holds."""
    x, _, amax, _ = interpreted[f"histogram-{bad}-{dtype}"].args
    _, expected = reference_histogram(x)
    assert not amax.isfinite() and torch.equal(amax.isnan(), expected.isnan())


LAUNCHES["histogram-zeros"] = histogram_launch(torch.zeros(4, 33), amax=torch.tensor(3.0))


def test_histogram_kernel_of_zeros_counts_nothing_and_keeps_the_max_interpreted(interpreted):
    _, counts, amax, _ = interpreted["histogram-zeros"].args
    assert int(counts.sum()) == 0 and amax.item() == 3.0


def with_one_bad_element(bad):
    x = activation((4, 64), torch.float32, seed=3)
    x[2, 17] = bad
    return x


LAUNCHES.update({f"histogram-poisoned-{bad}": histogram_launch(with_one_bad_element(bad)) for bad in NON_FINITE[:2]})


@pytest.mark.parametrize("bad", NON_FINITE[:2], ids=["nan", "inf"])
def test_histogram_kernel_poisons_the_max_with_non_finite_input_interpreted(interpreted, bad):
    """The observer refuses a batch when the running max is not finite: the kernel must make it so."""
    _, _, amax, _ = interpreted[f"histogram-poisoned-{bad}"].args
    assert not torch.isfinite(amax)


def sweep_weight(rows, cols, dtype, seed, device="cpu"):
    """Blocks with gains 2^-16 .. 1, an all-zero block, and a block every candidate can tie on."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(rows, cols // 16, 16, generator=generator)
    gains = 2.0 ** torch.randint(-16, 1, (rows, cols // 16, 1), generator=generator).float()
    weight = (blocks * gains).reshape(rows, cols)
    weight[0, :16] = 0.0
    weight[1, :16] = 0.125  # exact at many scales: equal errors, the lowest candidate wins
    return weight.to(device=device, dtype=dtype)


def block_hessian_for(cols, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, cols, generator=generator) * torch.rand(cols, generator=generator) * 4
    return references.block_hessian(x.to(device))


def sweep_launch(weight, global_amax, hessian=None):
    return SWEEP, (weight, global_amax, hessian)


def assert_same_scales(got, expected):
    assert got.dtype == torch.float8_e4m3fn and got.shape == expected.shape
    assert torch.equal(got.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())


# Weight shapes of the sweep launches, whose programs each walk up to all 126 candidates (3-6 s
# interpreted). Both weightings share the kernel's loads and stores: in fp32 the plain sweep runs
# two row tiles of 32 (the second ragged), the Hessian sweep two block columns (each with its own
# Hessian block) of one ragged row tile of 64. The dtypes differ only in the load's conversion to
# float32: one ragged tile each.
PLAIN_SWEEP_SHAPES = {torch.float32: (40, 16), torch.bfloat16: (24, 16), torch.float16: (24, 16)}
HESSIAN_SWEEP_SHAPES = {torch.float32: (32, 32), torch.bfloat16: (32, 16)}


def plain_sweep_launch(dtype):
    weight = sweep_weight(*PLAIN_SWEEP_SHAPES[dtype], dtype, seed=5)
    return sweep_launch(weight, weight.abs().max().float())


LAUNCHES.update({f"sweep-plain-{dtype}": plain_sweep_launch(dtype) for dtype in DTYPES})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_plain_sweep_kernel_matches_reference_interpreted(interpreted, dtype):
    (weight, global_amax, _), scales = interpreted[f"sweep-plain-{dtype}"]
    assert_same_scales(scales, references.fp8_scale_sweep(weight, global_amax))


def hessian_sweep_launch(dtype):
    rows, cols = HESSIAN_SWEEP_SHAPES[dtype]
    weight = sweep_weight(rows, cols, dtype, seed=6)
    return sweep_launch(weight, weight.abs().max().float(), block_hessian_for(cols, seed=7))


LAUNCHES.update({f"sweep-hessian-{dtype}": hessian_sweep_launch(dtype) for dtype in (torch.float32, torch.bfloat16)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hessian_sweep_kernel_matches_reference_interpreted(interpreted, dtype):
    (weight, global_amax, hessian), scales = interpreted[f"sweep-hessian-{dtype}"]
    assert_same_scales(scales, references.fp8_scale_sweep(weight, global_amax, hessian))


def extreme_sweep_launch(weighting, magnitude):
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(8)) * magnitude
    hessian = block_hessian_for(16, seed=9) if weighting == "hessian" else None
    return sweep_launch(weight, weight.abs().max(), hessian)


LAUNCHES.update(
    {
        f"sweep-{weighting}-{magnitude}": extreme_sweep_launch(weighting, magnitude)
        for weighting in ("plain", "hessian")
        for magnitude in (1e-30, 1e30)
    }
)


@pytest.mark.parametrize("magnitude", [1e-30, 1e30], ids=["1e-30", "1e30"])
@pytest.mark.parametrize("weighting", ["plain", "hessian"])
def test_sweep_kernel_extreme_magnitudes_interpreted(interpreted, weighting, magnitude):
    """1e30 squares overflow to inf: no candidate has a finite error and both give scale 0."""
    (weight, global_amax, hessian), scales = interpreted[f"sweep-{weighting}-{magnitude}"]
    assert_same_scales(scales, references.fp8_scale_sweep(weight, global_amax, hessian))


def test_sweep_launcher_refuses_a_global_amax_whose_reciprocals_overflow():
    """Checked on the host before any launch (so it runs here on CPU tensors): the kernel never
    sees the inf reciprocals under which its float min would differ from the reference's NaN."""
    weight = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="too small"):
        launch_fp8_scale_sweep(weight, torch.tensor(1e-34))


# The CPU sweep kernel (backends/cpu_sweep.c): tiles of 16 rows, so row counts below, at and past
# a tile; strided rows; several pieces on several threads.
CPU_SWEEP_SHAPES = [(2, 16), (37, 160), (64, 512)]


@pytest.mark.parametrize("weighting", ["plain", "hessian", "asymmetric hessian"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", CPU_SWEEP_SHAPES, ids=str)
def test_cpu_sweep_kernel_matches_reference(monkeypatch, shape, dtype, weighting):
    weight = sweep_weight(*shape, dtype, seed=shape[0])
    global_amax = weight.abs().max().float()
    hessian = {
        "plain": None,
        "hessian": block_hessian_for(shape[1], seed=shape[1]),
        "asymmetric hessian": torch.randn(shape[1] // 16, 16, 16, generator=torch.Generator().manual_seed(3)),
    }[weighting]
    expected = references.fp8_scale_sweep(weight, global_amax, hessian)
    reference_refused(monkeypatch, "fp8_scale_sweep")
    assert_same_scales(kernels.fp8_scale_sweep(weight, global_amax, hessian), expected)


@pytest.mark.parametrize("magnitude", [1e-30, 1e30], ids=["1e-30", "1e30"])
@pytest.mark.parametrize("weighting", ["plain", "hessian"])
def test_cpu_sweep_kernel_extreme_magnitudes(monkeypatch, weighting, magnitude):
    """1e30 squares overflow to inf: no candidate has a finite error and both give scale 0."""
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(8)) * magnitude
    hessian = block_hessian_for(16, seed=9) if weighting == "hessian" else None
    expected = references.fp8_scale_sweep(weight, weight.abs().max(), hessian)
    reference_refused(monkeypatch, "fp8_scale_sweep")
    assert_same_scales(kernels.fp8_scale_sweep(weight, weight.abs().max(), hessian), expected)


@pytest.mark.parametrize("layout", ["rows apart", "transposed"])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_sweep_kernel_reads_strided_weights_in_pieces_on_threads(monkeypatch, layout, threads):
    from nvfp4_static.backends import cpu_sweep

    full = sweep_weight(96, 256, torch.bfloat16, seed=4)
    weight = full[:, 64:224] if layout == "rows apart" else full[:80, :96].t()
    hessian = block_hessian_for(weight.shape[1], seed=5)
    expected = [references.fp8_scale_sweep(weight, weight.abs().max().float(), h) for h in (None, hessian)]
    reference_refused(monkeypatch, "fp8_scale_sweep")
    monkeypatch.setattr(cpu_sweep, "ROWS_PER_PIECE", 16)
    with torch_threads(threads):
        for h, scales in zip((None, hessian), expected):
            assert_same_scales(kernels.fp8_scale_sweep(weight, weight.abs().max().float(), h), scales)


@pytest.mark.parametrize(
    "weight_shape, hessian_shape, message",
    [
        ((32,), None, r"weight of shape \(32,\) must be 2-D \[N, K\]"),
        ((2, 4, 16), None, r"weight of shape \(2, 4, 16\) must be 2-D"),
        ((4, 24), None, r"weight of shape \(4, 24\) must be 2-D \[N, K\] with K a multiple of 16"),
        ((4, 32), (2, 16, 8), r"Hessian of shape \(2, 16, 8\) for a weight of shape \(4, 32\); it must be \[2, 16, 16\]"),
        ((4, 32), (3, 16, 16), r"Hessian of shape \(3, 16, 16\) .* must be \[2, 16, 16\]"),
        ((4, 32), (16, 16), r"Hessian of shape \(16, 16\) .* must be \[2, 16, 16\]"),
    ],
    ids=["1-D", "3-D", "K of 24", "Hessian of 16 x 8", "Hessian of 3 blocks", "one 2-D Hessian"],
)
def test_sweep_refuses_operands_it_would_misread_naming_their_shapes(weight_shape, hessian_shape, message):
    weight = torch.randn(weight_shape)
    hessian = None if hessian_shape is None else torch.randn(hessian_shape)
    with pytest.raises(ValueError, match=message):
        kernels.fp8_scale_sweep(weight, torch.tensor(1.0), hessian)


def test_sweep_refuses_an_integer_weight_naming_its_dtype():
    with pytest.raises(TypeError, match="fp8_scale_sweep weight has dtype torch.int32"):
        kernels.fp8_scale_sweep(torch.ones(4, 32, dtype=torch.int32), torch.tensor(1.0))


def assert_hessian_within_fp32_rounding(got, x, initial):
    """|got - exact| <= 2 n u sum_t |x_i x_j| (n tokens, u = 2^-24): a float32 sum of n products."""
    tokens = x.reshape(-1, x.shape[-1] // 16, 16).double()
    exact = initial.double() + torch.einsum("tbi,tbj->bij", tokens, tokens)
    bound = initial.double().abs() + torch.einsum("tbi,tbj->bij", tokens.abs(), tokens.abs())
    assert bool(((got.double() - exact).abs() <= 2 * tokens.shape[0] * 2.0**-24 * bound).all())


def hessian_inputs(dtype):
    """135 tokens (a ragged step) of 96 columns, and the Hessian the launch adds to."""
    generator = torch.Generator().manual_seed(10)
    x = (torch.randn(3, 45, 96, generator=generator) * 8).to(dtype)
    initial = torch.randn(6, 16, 16, generator=generator)
    return x, initial


def block_hessian_launch(dtype):
    x, initial = hessian_inputs(dtype)
    return BLOCK_HESSIAN, (x, initial.clone())


LAUNCHES.update({f"block-hessian-{dtype}": block_hessian_launch(dtype) for dtype in (torch.float32, torch.float16)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_block_hessian_kernel_matches_reference_interpreted(interpreted, dtype):
    """bf16 runs on CUDA only: the interpreter's tl.dot multiplies bf16's raw bits."""
    x, hessian = interpreted[f"block-hessian-{dtype}"].args
    initial = hessian_inputs(dtype)[1]
    assert_hessian_within_fp32_rounding(hessian, x, initial)
    assert_hessian_within_fp32_rounding(initial + references.block_hessian(x), x, initial)


@requires_cuda
@pytest.mark.parametrize(
    "shape, dtype",
    [((4096, 8192), torch.bfloat16), ((2, 333, 8200), torch.float32), ((64, 4104), torch.float16)],
    ids=["4096x8192-bf16", "2x333x8200-fp32", "64x4104-fp16"],
)
def test_histogram_op_matches_reference_on_cuda(shape, dtype):
    x = activation(shape, dtype, seed=11, device="cuda")
    counts = torch.full((BIN_EDGES.numel() + 1,), 5, dtype=torch.int64, device="cuda")
    amax = torch.zeros((), device="cuda")
    expected = reference_histogram(x, counts.clone(), amax.clone())
    kernels.collect_block_amax_histogram(x, counts, amax, BIN_EDGES.cuda())
    assert_same_histogram((counts, amax), expected)


@requires_cuda
@pytest.mark.parametrize(
    "shape, dtype, weighting",
    [
        ((1024, 4096), torch.bfloat16, "plain"),
        ((300, 1024), torch.float32, "plain"),
        ((256, 2048), torch.bfloat16, "hessian"),
        ((100, 512), torch.float16, "hessian"),
    ],
    ids=["1024x4096-bf16-plain", "300x1024-fp32-plain", "256x2048-bf16-hessian", "100x512-fp16-hessian"],
)
def test_sweep_op_matches_reference_on_cuda(shape, dtype, weighting):
    weight = sweep_weight(*shape, dtype, seed=12, device="cuda")
    global_amax = weight.abs().max().float()
    hessian = block_hessian_for(shape[1], seed=13, device="cuda") if weighting == "hessian" else None
    expected = references.fp8_scale_sweep(weight, global_amax, hessian)
    assert_same_scales(kernels.fp8_scale_sweep(weight, global_amax, hessian), expected)


@requires_cuda
@pytest.mark.parametrize("magnitude", [1e-30, 1e30], ids=["1e-30", "1e30"])
def test_sweep_op_extreme_magnitudes_on_cuda(magnitude):
    weight = torch.randn(128, 256, device="cuda") * magnitude
    global_amax = weight.abs().max()
    assert_same_scales(
        kernels.fp8_scale_sweep(weight, global_amax), references.fp8_scale_sweep(weight, global_amax)
    )


@requires_cuda
@pytest.mark.parametrize(
    "shape, dtype",
    [((4096, 8192), torch.bfloat16), ((3, 500, 1040), torch.float32), ((77, 272), torch.float16)],
    ids=["4096x8192-bf16", "3x500x1040-fp32", "77x272-fp16"],
)
def test_block_hessian_op_within_fp32_rounding_on_cuda(shape, dtype):
    x = (torch.randn(shape, device="cuda") * 4).to(dtype)
    initial = torch.randn(shape[-1] // 16, 16, 16, device="cuda")
    hessian = initial.clone()
    kernels.accumulate_block_hessian(x, hessian)
    assert_hessian_within_fp32_rounding(hessian, x, initial)


class CalibrationForward(torch.nn.Module):
    """A linear that feeds its input to all three calibration ops, as an observed linear does."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear
        n_blocks = linear.in_features // 16
        device = linear.weight.device
        self.register_buffer("edges", BIN_EDGES.to(device))
        self.register_buffer("counts", torch.zeros(BIN_EDGES.numel() + 1, dtype=torch.int64, device=device))
        self.register_buffer("amax", torch.zeros((), device=device))
        self.register_buffer("hessian", torch.zeros(n_blocks, 16, 16, device=device))

    def forward(self, x):
        kernels.collect_block_amax_histogram(x, self.counts, self.amax, self.edges)
        kernels.accumulate_block_hessian(x, self.hessian)
        weight = self.linear.weight.detach()
        return self.linear(x), kernels.fp8_scale_sweep(weight, self.amax, self.hessian)


def check_compiled_calibration_forward(device, backend):
    torch.manual_seed(14)
    linear = torch.nn.Linear(64, 32, device=device)
    x = torch.randn(2, 24, 64, device=device)
    eager, compiled = CalibrationForward(linear), CalibrationForward(linear)
    compiled_forward = torch.compile(compiled, fullgraph=True, backend=backend)
    for _ in range(2):
        expected_out, expected_scales = eager(x)
        out, scales = compiled_forward(x)
    torch.testing.assert_close(out, expected_out)
    assert_same_scales(scales, expected_scales)
    assert torch.equal(compiled.counts, eager.counts) and torch.equal(compiled.amax, eager.amax)
    torch.testing.assert_close(compiled.hessian, eager.hessian, rtol=1e-6, atol=1e-4)


def test_calibration_ops_trace_with_fullgraph():
    """On CPU the ops are their references; this checks the op registration (fakes, mutation)."""
    check_compiled_calibration_forward("cpu", "aot_eager")


@requires_cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_calibrator_refuses_non_finite_input_on_cuda(bad):
    from nvfp4_static.observers import NVFP4ActMaxCalibrator

    calibrator = NVFP4ActMaxCalibrator(name="layer")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    calibrator.collect(x)
    before = calibrator.state_dict()
    bad_batch = x.clone()
    bad_batch[100, 1000] = bad
    calibrator.collect(bad_batch)  # on CUDA the test is read later, without waiting for the GPU
    with pytest.raises(ValueError, match="'layer'.*before this call"):
        calibrator.collect(x)
    after = calibrator.state_dict()  # neither the refused batch nor the one that reported it
    assert all(torch.equal(before[key], after[key]) for key in before)
    calibrator.collect(bad_batch)
    with pytest.raises(ValueError, match="'layer'"):
        calibrator.compute_amax()  # convert reads the state: the refusal surfaces there too
    assert torch.equal(calibrator.state_dict()["counts"], before["counts"])


@requires_cuda
def test_observed_layer_drops_a_refused_batch_from_both_observers_on_cuda():
    from torchao.quantization import quantize_

    from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable

    model = torch.nn.Sequential(torch.nn.Linear(256, 64)).cuda()
    config = NVFP4StaticActivationConfig(step="prepare", weight_scale="hessian_mse")
    quantize_(model, config, filter_fn=is_quantizable)  # records the layer names the messages use
    good = torch.randn(32, 256, device="cuda")
    model(good)
    observed = model[0]
    act_before = observed.act_calibrator.state_dict()
    hessian_before = observed.hessian_accumulator.state_dict()
    model(good * 1e30)  # finite, but its squares overflow the Hessian
    with pytest.raises(ValueError, match="'0'"):
        model(good)
    assert all(torch.equal(act_before[k], v) for k, v in observed.act_calibrator.state_dict().items())
    assert all(torch.equal(hessian_before[k], v) for k, v in observed.hessian_accumulator.state_dict().items())
    model(good)
    copied = copy.deepcopy(model)  # a test in flight is settled first; events are not copied
    copied(good)
    assert copied[0].act_calibrator.compute_amax().item() == observed.act_calibrator.compute_amax().item()


@requires_cuda
def test_compiled_calibration_forward_with_fullgraph_on_cuda():
    check_compiled_calibration_forward("cuda", "inductor")
