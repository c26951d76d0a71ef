"""backends/triton_route.py and backends/blackwell.py against the torch route, backends/cpu.py.

The Blackwell route cannot run here (no sm100 GPU): its operands are checked against the layout
torchao's NVFP4Tensor produces, and the whole route runs on CPU with ``torch._scaled_mm``
replaced by an emulation of cuBLAS's block-scaled FP4 product.
"""

import pytest
import torch
from conftest import UNIT_ROUNDOFF, gpu_tolerance, linear_operands, relative_error, requires_cuda
from torch.fx.experimental.proxy_tensor import make_fx
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.prototype.mx_formats.utils import from_blocked

from nvfp4_static.backends import BACKENDS, blackwell, cpu, linear_function
from nvfp4_static.backends import triton_route as triton_backend
from nvfp4_static.kernels import gemm
from nvfp4_static.kernels.gemm import GEMM_CONFIGS, gemm_bucket
from nvfp4_static.kernels.launch import recording_launches
from nvfp4_static.numerics import dequantize_nvfp4, quantize_nvfp4


def linear_inputs(M, N, K, dtype, seed, device="cpu", with_bias=True):
    """``static_nvfp4_linear``'s arguments, in its order."""
    operands = linear_operands(M, N, K, seed, device)
    return (
        operands.x.to(dtype),
        operands.weight_qdata,
        operands.weight_block_scales,
        operands.weight_scale,
        operands.act_scale,
        operands.bias if with_bias else None,
    )


def test_each_backend_name_gives_its_modules_linear():
    modules = {"cpu": cpu, "triton": triton_backend, "blackwell": blackwell}
    assert set(modules) == set(BACKENDS)
    for name, module in modules.items():
        assert linear_function(name) is module.static_nvfp4_linear, name


def dequantized_rows(monkeypatch) -> list:
    """The row counts of the weight pieces the cpu route dequantizes from now on, in order."""
    rows = []

    def dequantize(qdata, block_scales, **options):
        rows.append(qdata.shape[0])
        return dequantize_nvfp4(qdata, block_scales, **options)

    monkeypatch.setattr(cpu, "dequantize_nvfp4", dequantize)
    return rows


@pytest.mark.parametrize(
    "leading,N,K,slice_rows",
    [((1,), 48, 64, 5), ((7,), 48, 64, 16), ((2, 3), 40, 96, 7), ((16,), 33, 32, 1), ((3,), 24, 64, 24)],
    ids=["one-token", "whole-slices", "3d-activation", "row-by-row", "one-slice"],
)
def test_cpu_route_by_weight_slices_equals_the_whole_weight_bit_for_bit(monkeypatch, leading, N, K, slice_rows):
    """On a CPU the torch ops dequantize and multiply the weight some output features at a time
    (``cpu._WEIGHT_SLICE_ELEMENTS``); each output is the same dot product as with the weight
    dequantized whole, bias, scales and dtype applied after."""
    ops = linear_operands(2, N, K, seed=N + K)
    x = torch.randn(*leading, K, generator=torch.Generator().manual_seed(K)).to(torch.bfloat16)
    args = (ops.weight_qdata, ops.weight_block_scales, ops.weight_scale, ops.act_scale, ops.bias)
    monkeypatch.setattr(cpu, "_WEIGHT_SLICE_ELEMENTS", 1 << 40)
    whole = cpu.torch_static_nvfp4_linear(x, *args)
    dequantized = dequantized_rows(monkeypatch)
    monkeypatch.setattr(cpu, "_WEIGHT_SLICE_ELEMENTS", slice_rows * K)
    sliced = cpu.torch_static_nvfp4_linear(x, *args)
    assert dequantized == [min(slice_rows, N - first) for first in range(0, N, slice_rows)]
    assert sliced.shape == (*leading, N) and sliced.dtype == torch.bfloat16
    assert torch.equal(sliced.view(torch.int16), whole.view(torch.int16))


def test_cpu_route_builds_its_decoding_tables_once_as_ordinary_tensors():
    """Built on the first eager call, here under inference mode, the tables are kept as ordinary
    tensors (a later call outside inference mode may use them in any op) and reused."""
    ops = linear_operands(2, 32, 64, seed=3)
    args = (ops.weight_qdata, ops.weight_block_scales, ops.weight_scale, ops.act_scale, ops.bias)
    cpu.decoding_tables.cache_clear()
    with torch.inference_mode():
        first = cpu.static_nvfp4_linear(ops.x, *args)
    tables = cpu.decoding_tables()
    assert not any(table.is_inference() for table in tables)
    second = cpu.static_nvfp4_linear(ops.x, *args)
    assert cpu.decoding_tables.cache_info().misses == 1
    assert all(kept is table for kept, table in zip(cpu.decoding_tables(), tables))
    assert torch.equal(second, first)


def test_triton_backend_sends_cpu_tensors_to_the_cpu_backend(monkeypatch):
    inputs = linear_inputs(5, 32, 64, torch.bfloat16, seed=0)
    reference = cpu.static_nvfp4_linear
    calls = []
    monkeypatch.setattr(cpu, "static_nvfp4_linear", lambda *args: calls.append(args) or reference(*args))
    with recording_launches() as launches:
        out = triton_backend.static_nvfp4_linear(*inputs)
    assert len(calls) == 1 and launches == []
    assert torch.equal(out, reference(*inputs))


@pytest.mark.parametrize("M,N,K", [(5, 256, 128), (130, 64, 320)], ids=str)
def test_blackwell_operands_match_torchao_swizzled_layout(M, N, K):
    inputs = linear_operands(M, N, K, seed=1)
    x, weight, act_scale, weight_scale = inputs.x, inputs.weight, inputs.act_scale, inputs.weight_scale
    operands = blackwell.scaled_mm_operands(*quantize_nvfp4(x, act_scale), *quantize_nvfp4(weight, weight_scale))
    a, b, scale_a, scale_b = operands
    torchao_act = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=act_scale, is_swizzled_scales=True)
    torchao_weight = NVFP4Tensor.to_nvfp4(weight, per_tensor_scale=weight_scale, is_swizzled_scales=True)

    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2
    assert torch.equal(a.view(torch.uint8), torchao_act.qdata)
    assert torch.equal(scale_a.view(torch.uint8), torchao_act.scale.flatten().view(torch.uint8))
    # cuBLAS takes the weight column-major: the [K/2, N] transpose of the contiguous [N, K/2].
    assert b.shape == (K // 2, N) and b.stride() == (1, K // 2)
    assert torch.equal(b.view(torch.uint8), torchao_weight.qdata.t())
    assert torch.equal(scale_b.view(torch.uint8), torchao_weight.scale.flatten().view(torch.uint8))


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """cuBLAS's NVFP4 ``_scaled_mm`` in float64: decode both FP4 operands, un-block their scales
    (torchao's ``from_blocked``), multiply each 16-element block by its scale, then ``a @ b``."""

    def decode(qdata_rows: torch.Tensor, blocked_scales: torch.Tensor) -> torch.Tensor:
        rows, half_k = qdata_rows.shape
        values = f4_unpacked_to_f32(unpack_uint4(qdata_rows.contiguous().view(torch.uint8)))
        scales = from_blocked(blocked_scales.view(torch.float8_e4m3fn), rows, half_k // 8).to(torch.float32)
        return (values.reshape(rows, -1, 16) * scales[..., None]).reshape(rows, -1).double()

    return (decode(a, scale_a) @ decode(b.t(), scale_b).t()).to(out_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_blackwell_route_with_emulated_scaled_mm_matches_cpu_backend(monkeypatch, dtype, with_bias):
    # Both sides multiply the same exact block products; they differ only in fp32 summation
    # order (the emulation sums in fp64), far below one rounding of the output dtype.
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    inputs = linear_inputs(7, 48, 96, dtype, seed=2, with_bias=with_bias)
    tolerance = 1e-5 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype]
    assert relative_error(blackwell.static_nvfp4_linear(*inputs), cpu.static_nvfp4_linear(*inputs)) <= tolerance


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K",
    [(1, 4096, 4096), (1, 96, 16), (13, 8192, 8192), (77, 1024, 4096), (1000, 4096, 4096), (3, 48, 16), (4, 4096, 4096)],
    ids=str,
)
def test_gpu_triton_backend_matches_cpu_backend(dtype, with_bias, M, N, K):
    inputs = linear_inputs(M, N, K, dtype, seed=M, device="cuda", with_bias=with_bias)
    out = triton_backend.static_nvfp4_linear(*inputs)
    assert relative_error(out, cpu.static_nvfp4_linear(*inputs)) <= gpu_tolerance(K, dtype)


@pytest.mark.parametrize("route", ["cpu", "blackwell"])
def test_routes_take_leading_dims(monkeypatch, route):
    """``x [..., K]`` gives the ``[M, K]`` result with the leading dims restored, exactly."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    linear = {"cpu": cpu, "blackwell": blackwell}[route].static_nvfp4_linear
    x, *rest = linear_inputs(2 * 9, 48, 96, torch.bfloat16, seed=4)
    assert torch.equal(linear(x.reshape(2, 9, 96), *rest), linear(x, *rest).reshape(2, 9, 48))
    assert linear(x[0], *rest).shape == (48,)


@requires_cuda
def test_gpu_3d_activation():
    x, *rest = linear_inputs(2 * 9, 512, 1024, torch.bfloat16, seed=3, device="cuda")
    x3d = x.reshape(2, 9, 1024)
    out = triton_backend.static_nvfp4_linear(x3d, *rest)
    assert torch.equal(out, triton_backend.static_nvfp4_linear(x, *rest).reshape(2, 9, 512))
    assert relative_error(out.reshape(-1, 512), cpu.static_nvfp4_linear(x, *rest)) <= gpu_tolerance(1024, torch.bfloat16)


def m_at_every_gemm_bucket_bound() -> list[int]:
    """2, each bound of the tile table with the M just past it, and a prefill size."""
    bounds = [max_m for max_m, _ in GEMM_CONFIGS[:-1] if max_m >= 2]
    return [2] + [m for bound in bounds for m in (bound, bound + 1)] + [1000]


def test_traced_linear_picks_the_tables_bucket_for_every_m_from_one_graph(monkeypatch):
    """The cond tree the Triton route traces, each bucket's linear replaced by a marker of its
    index (CPU, no kernels): compiled for a dynamic M by dynamo, and traced symbolically as
    AOTAutograd traces a weight subclass's linear, every M runs ``gemm_bucket(M)``'s branch."""

    def bucket_marker(bucket, output_scale, x, weights, bias):
        return x.new_full((*x.shape[:-1], 1), float(bucket))

    monkeypatch.setattr(triton_backend, "_linear_in_bucket", bucket_marker)
    weights = (torch.zeros(8, 8, dtype=torch.uint8), torch.zeros(8, 1), torch.ones(()), torch.ones(()))

    def linear(x, *weights):
        return triton_backend._linear_branching_on_m(None, x, weights, None)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(linear, fullgraph=True, dynamic=True)
    symbolic = make_fx(linear, tracing_mode="symbolic")(torch.zeros(3, 5, 16), *weights)
    for M in m_at_every_gemm_bucket_bound():
        x = torch.zeros(M, 16)
        assert compiled(x, *weights).unique().tolist() == [gemm_bucket(M)], M
        for shape in [(M, 1, 16), (1, M, 16)]:
            assert symbolic(torch.zeros(shape), *weights).unique().tolist() == [gemm_bucket(M)], shape
    assert counters["stats"]["unique_graphs"] == 1


def test_traced_branches_choose_the_tiles_their_bucket_runs_on_the_weight(monkeypatch):
    """Each branch of the cond tree asks ``operand_config`` which tiles its bucket runs (CPU, no
    kernels: a Hopper GPU of 132 SMs stood in, each branch returning a marker of its bucket and
    whether the tall tile runs there). Compiled for a dynamic M, on a weight of 14336 rows the
    tall tile runs at 129-512 rows and, in cuBLAS's place, at 513-2048, not above; on one of 1024
    rows in neither."""

    def tall_tile_marker(bucket, output_scale, x, weights, bias):
        config = gemm.operand_config(bucket, weights[0].shape[0], 2 * weights[0].shape[1], torch.device("cuda"), True)
        return x.new_full((*x.shape[:-1], 1), float(bucket) + 0.5 * (config == gemm.TALL_TILE))

    monkeypatch.setattr(triton_backend, "_linear_in_bucket", tall_tile_marker)
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: True)
    for N, tall_at in [(14336, {300, 512, 513, 2048}), (1024, set())]:
        weights = (torch.zeros(N, 2048, dtype=torch.uint8), torch.zeros(N, 256), torch.ones(()), torch.ones(()))
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x: triton_backend._linear_branching_on_m(None, x, weights, None), fullgraph=True, dynamic=True
        )
        for M in (16, 300, 512, 513, 2048, 2049):
            marker = compiled(torch.zeros(M, 4096)).unique().tolist()
            assert marker == [gemm_bucket(M) + 0.5 * (M in tall_at)], (N, M)


@requires_cuda
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gpu_compiled_fullgraph_one_graph_for_every_m(with_bias, monkeypatch):
    """A graph compiled for a dynamic M holds every tile bucket behind a cond: M from 2 to
    prefill sizes runs without recompiling, each M with the same kernels as the eager call on
    the table's entries (eager calls of 2-16 rows, bound by their host, otherwise take other
    tiles: ``gemm.quantizes_eagerly``). M = 1 is left out: dynamo specialises sizes 0 and 1
    (their own graph) whatever we do."""
    monkeypatch.setattr(gemm, "EAGER_QUANTIZING_MAX_ROWS", 1)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    _, *weights, bias = linear_inputs(1, 1024, 2048, torch.bfloat16, seed=0, device="cuda", with_bias=with_bias)
    compiled = torch.compile(lambda x: triton_backend.static_nvfp4_linear(x, *weights, bias), fullgraph=True, dynamic=True)
    m_values = m_at_every_gemm_bucket_bound()
    assert len({gemm_bucket(M) for M in m_values}) == len(GEMM_CONFIGS) - 1  # all but M = 1's
    for M in m_values:
        x = torch.randn(M, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(M)).bfloat16()
        expected = triton_backend.static_nvfp4_linear(x, *weights, bias)
        assert torch.equal(compiled(x), expected), f"M = {M}"
    assert counters["stats"]["unique_graphs"] == 1


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("M,N,K", [(1000, 1024, 4096), (4096, 8192, 8192)], ids=str)
def test_gpu_triton_backend_with_a_host_output_scale_matches_cpu_backend(dtype, with_bias, M, N, K):
    """Large M with the scale product on the host: cuBLAS takes the whole epilogue (1000 rows of
    1024 columns: too few tall programs to take cuBLAS's place on Hopper)."""
    x, weight_qdata, weight_block_scales, weight_scale, act_scale, bias = linear_inputs(
        M, N, K, dtype, seed=M, device="cuda", with_bias=with_bias
    )
    inputs = (x, weight_qdata, weight_block_scales, weight_scale, act_scale, None if bias is None else bias.to(dtype))
    output_scale = float(act_scale * weight_scale)
    out = triton_backend.static_nvfp4_linear(*inputs, output_scale)
    assert relative_error(out, cpu.static_nvfp4_linear(*inputs)) <= gpu_tolerance(K, dtype)


@requires_cuda
def test_gpu_compiled_api_linear_at_prefill_size_scales_by_the_scale_tensors():
    """Through ``F.linear`` on the weight subclass at a prefill size: eagerly cuBLAS takes the
    weight's host ``output_scale`` as alpha; traced, the weight has no host copy (a graph reads
    the global scales from their tensors), so the graph gives the route's output without it,
    bit for bit, one output rounding or so from the eager call."""
    from nvfp4_static.tensor import NVFP4StaticTensor

    torch._dynamo.reset()
    weight = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    nvfp4_weight = NVFP4StaticTensor.from_float(weight, torch.tensor(4.0), backend_override="triton")
    assert nvfp4_weight.output_scale is not None
    compiled = torch.compile(torch.nn.functional.linear, fullgraph=True)
    x = torch.randn(2100, 1024, device="cuda", dtype=torch.bfloat16)  # cuBLAS's rows on any GPU
    inputs = (x, nvfp4_weight.qdata, nvfp4_weight.scale, nvfp4_weight.per_tensor_scale, nvfp4_weight.act_per_tensor_scale, bias)
    with torch.no_grad():
        eager = torch.nn.functional.linear(x, nvfp4_weight, bias)
        out = compiled(x, nvfp4_weight, bias)
    assert torch.equal(out, triton_backend.static_nvfp4_linear(*inputs))
    assert relative_error(out, eager.double()) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]
    assert relative_error(eager, cpu.static_nvfp4_linear(*inputs)) <= gpu_tolerance(1024, torch.bfloat16)
