"""The CPU's own kernel (backends/cpu_kernel.c) against its plain-torch definition
(``references.static_nvfp4_linear_in_block_order``), and the route around it: which calls take
it, how it is built, what it refuses."""

import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import stat
import warnings

import pytest
import torch
from conftest import PassThrough, linear_operands, relative_error
from torch._dynamo.testing import CompileCounter
from torch.fx.experimental.proxy_tensor import make_fx

from nvfp4_static import references
from nvfp4_static.backends import cpu, cpu_kernel
from nvfp4_static.numerics import quantize_nvfp4_unpacked


@pytest.fixture
def lib():
    """The built kernel. A test machine has a C compiler (torch's own CPU compiler needs one):
    a missing kernel fails here rather than skipping."""
    built = cpu_kernel.library()
    assert built is not None, "the CPU kernel was not built"
    return built


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernel's module as before its first use, with its cache in ``tmp_path``."""
    monkeypatch.setattr(cpu_kernel, "_library", None)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setenv(cpu_kernel.CACHE_ENV_VAR, str(tmp_path / "cache"))
    return tmp_path


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert [str(warning.message) for warning in caught] == []


def without_torch_route(monkeypatch):
    """Make the torch ops fail, so that a call that returns went through the kernel."""

    def refuse(*args):
        raise AssertionError("took the torch route")

    monkeypatch.setattr(cpu, "torch_static_nvfp4_linear", refuse)


def operands(rows, n, k, dtype, seed, with_bias=True):
    ops = linear_operands(rows, n, k, seed, block_gains=True)
    bias = ops.bias.to(dtype) if with_bias else None
    return ops.x.to(dtype), ops.weight_qdata, ops.weight_block_scales, ops.weight_scale, ops.act_scale, bias


# One row goes one row at a time, more rows (from 2 or 3) as vector lanes in chunks of 16 (8-lane
# vectors up to 8 rows, above two of them or one of 16 lanes), several features at a time: row
# counts in one and two vectors and past a chunk, output counts with and without a remainder.
SHAPES = [
    (1, 8, 16), (1, 48, 64), (3, 40, 96), (16, 33, 272), (5, 17, 1024), (2, 24, 4096), (40, 37, 48), (25, 6, 80),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("rows,n,k", SHAPES, ids=str)
def test_kernel_equals_its_definition_bit_for_bit(lib, monkeypatch, dtype, with_bias, rows, n, k):
    """Odd output counts, K of 1 to 256 blocks (whole groups of four and the rest), blocks of
    scales 2^-8 to 2^4 apart, every activation dtype."""
    args = operands(rows, n, k, dtype, seed=rows + n + k, with_bias=with_bias)
    expected = references.static_nvfp4_linear_in_block_order(*args)
    without_torch_route(monkeypatch)
    out = cpu.static_nvfp4_linear(*args)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rows", [1, 7], ids=str)
def test_kernel_takes_any_packed_bytes_and_fp8_scale_codes_as_its_definition(lib, monkeypatch, rows):
    """A loaded weight may hold any bytes: every packed byte (-0.0 codes included) and every FP8
    scale code but the two NaNs (negative and subnormal scales included), at random."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 40, 160
    qdata = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8)
    codes = torch.randint(0, 254, (n, k // 16), generator=generator, dtype=torch.uint8)
    codes = torch.where(codes >= 0x7F, codes + 1, codes)  # skip 0x7F; 0xFF is never drawn
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    args = (x, qdata, codes.view(torch.float8_e4m3fn), torch.tensor(0.02), torch.tensor(0.01), None)
    expected = references.static_nvfp4_linear_in_block_order(*args)
    without_torch_route(monkeypatch)
    assert torch.equal(cpu.static_nvfp4_linear(*args), expected)


def test_definition_differs_from_the_torch_route_only_by_its_float32_sum():
    args = operands(7, 64, 4096, torch.float32, seed=5)
    in_block_order = references.static_nvfp4_linear_in_block_order(*args)
    assert 0 < relative_error(in_block_order, cpu.torch_static_nvfp4_linear(*args)) < 1e-6


@pytest.mark.parametrize("act_scale", [1e-3, 1.0, 3e4, 1e-30], ids=str)
def test_kernel_quantizes_every_bfloat16_value_as_numerics_does(lib, act_scale):
    """All 65280 finite bfloat16 values, shuffled into blocks, under global scales that put most
    block scales in range, at FP8's top (448) and at its clamp (2^-6)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[torch.isfinite(bits)]
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    rows = values[: values.numel() // 256 * 256].reshape(-1, 256)
    scale = torch.tensor(act_scale, dtype=torch.float32)
    twice_e2m1, scales = cpu_kernel.quantize_rows(lib, rows, scale)
    q, block_scales = quantize_nvfp4_unpacked(rows, scale)
    assert torch.equal(twice_e2m1.float() / 2, q)
    assert torch.equal(scales, block_scales.float())


@pytest.mark.parametrize("act_scale", [0.0, -1e-3, float("inf"), float("nan")], ids=str)
def test_kernel_quantizes_under_degenerate_global_scales_as_numerics_does(lib, act_scale):
    """Scales the tensor never holds, given to the route directly: NaN and infinities come out
    where torch's arithmetic makes them, and NaN scaled values become 1.5 with their sign."""
    rows = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    rows[0, :16], rows[1, 5] = 0.0, float("inf")
    scale = torch.tensor(act_scale, dtype=torch.float32)
    twice_e2m1, scales = cpu_kernel.quantize_rows(lib, rows, scale)
    q, block_scales = quantize_nvfp4_unpacked(rows, scale)
    assert torch.equal(twice_e2m1.float() / 2, q)
    torch.testing.assert_close(scales, block_scales.float(), rtol=0, atol=0, equal_nan=True)


def test_kernel_rounds_e2m1_midpoints_to_even(lib):
    """A block of 6 and every midpoint of the E2M1 grid under a global scale of 1 (its block
    scale 1, so the kernel's scaled values are the midpoints themselves)."""
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block = torch.tensor([6.0, *midpoints, *[-m for m in midpoints], 0.0])
    twice_e2m1, scales = cpu_kernel.quantize_rows(lib, block.reshape(1, 16), torch.tensor(1.0))
    assert scales.tolist() == [[1.0]]
    assert (twice_e2m1[0] / 2).tolist() == [6.0, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 0]


@pytest.mark.parametrize(
    "place,value",
    [((0, 3), float("nan")), ((2, 95), float("nan")), ((1, 40), float("inf")), ((0, 80), float("-inf"))],
    ids=["nan-first-block", "nan-last-block", "inf", "minus-inf"],
)
def test_kernel_takes_non_finite_activations_as_the_torch_route_does(lib, monkeypatch, place, value):
    """A NaN makes every output of its row NaN and leaves the other rows as they were; an
    infinity quantizes to 6 at the block's top scale, as the torch route quantizes it."""
    x, *rest = operands(3, 24, 96, torch.float32, seed=9)
    x[place] = value
    expected = references.static_nvfp4_linear_in_block_order(x, *rest)
    without_torch_route(monkeypatch)
    out = cpu.static_nvfp4_linear(x, *rest)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert out[place[0]].isnan().all().item() == (value != value)
    assert out[[row for row in range(3) if row != place[0]]].isfinite().all()


def test_calls_of_up_to_the_kernels_rows_take_it_and_more_the_torch_ops(lib, monkeypatch):
    """A kernel built without AVX2 takes up to 16 rows (``instruction_set_builds`` below)."""
    taken = []
    monkeypatch.setattr(cpu_kernel, "static_nvfp4_linear_rows", lambda *args: taken.append("kernel"))
    monkeypatch.setattr(cpu, "torch_static_nvfp4_linear", lambda *args: taken.append("torch"))
    monkeypatch.setattr(lib, "most_rows", 16)
    weights = operands(1, 16, 64, torch.bfloat16, seed=0)[1:]
    for shape in [(64,), (1, 64), (16, 64), (2, 8, 64), (17, 64), (3, 6, 64)]:
        cpu.static_nvfp4_linear(torch.zeros(shape, dtype=torch.bfloat16), *weights)
    assert taken == ["kernel"] * 4 + ["torch"] * 2


def experts_operands(rows_per_expert, n=24, k=64, dtype=torch.bfloat16, seed=0):
    """``grouped_static_nvfp4_linear``'s operands: rows sorted by expert (``rows_per_expert[e]``
    for expert ``e``, some none), each expert's weight and global scales its own."""
    experts = [linear_operands(max(rows, 1), n, k, seed + e, block_gains=True) for e, rows in enumerate(rows_per_expert)]
    x = torch.cat([ops.x[:rows] for ops, rows in zip(experts, rows_per_expert)]).to(dtype)
    offsets = torch.tensor([0, *itertools.accumulate(rows_per_expert)], dtype=torch.int32)
    qdata = torch.stack([ops.weight_qdata for ops in experts])
    scales = torch.stack([ops.weight_block_scales for ops in experts])
    weight_scales = torch.stack([ops.weight_scale.reshape(()) for ops in experts])
    act_scales = torch.stack([ops.act_scale.reshape(()) for ops in experts])
    return x, offsets, qdata, scales, weight_scales, act_scales


def each_expert_alone(x, offsets, qdata, scales, weight_scales, act_scales, linear):
    out = torch.zeros(x.shape[0], qdata.shape[1], dtype=x.dtype)
    bounds = offsets.tolist()
    for e, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > first:
            out[first:end] = linear(x[first:end], qdata[e], scales[e], weight_scales[e], act_scales[e], None)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows_per_expert", [[1, 1, 1, 1], [0, 3, 0, 17, 1], [5]], ids=str)
def test_grouped_experts_take_the_kernel_once_checked_equal_to_each_expert_alone(lib, monkeypatch, dtype, rows_per_expert):
    """Each expert's slice of the stacked weights, read by address: the same outputs bit for bit
    as the route on that expert's own tensors, and its definition's."""
    args = experts_operands(rows_per_expert, dtype=dtype, seed=len(rows_per_expert))
    alone = each_expert_alone(*args, linear=cpu.static_nvfp4_linear)
    defined = each_expert_alone(*args, linear=references.static_nvfp4_linear_in_block_order)
    monkeypatch.setattr(cpu, "static_nvfp4_linear", lambda *a: pytest.fail("an expert took the per-expert route"))
    out = cpu.grouped_static_nvfp4_linear(*args)
    assert torch.equal(out, alone) and torch.equal(out, defined)


def grouped_fallback_cases():
    """Stacked operands the kernel would not read as they are: each expert then takes the route."""
    return {
        "float16 rows": lambda args, lib, mp: (args[0].half(), *args[1:]),
        "float64 global scales": lambda args, lib, mp: (*args[:4], args[4].double(), args[5]),
        "strided stacked weight": lambda args, lib, mp: (
            args[0], args[1], torch.cat([args[2], args[2]], dim=2)[:, :, : args[2].shape[2]], *args[3:]
        ),
        "an expert with more rows than the build takes": lambda args, lib, mp: (
            mp.setattr(lib, "most_rows", 2), args
        )[1],
    }


@pytest.mark.parametrize("case", list(grouped_fallback_cases()))
def test_grouped_experts_the_kernel_would_misread_take_the_route_per_expert(lib, monkeypatch, case):
    args = grouped_fallback_cases()[case](experts_operands([2, 0, 3]), lib, monkeypatch)
    expected = each_expert_alone(*args, linear=cpu.static_nvfp4_linear)
    alone = []
    route = cpu.static_nvfp4_linear
    monkeypatch.setattr(cpu, "static_nvfp4_linear", lambda *a: alone.append(1) or route(*a))
    out = cpu.grouped_static_nvfp4_linear(*args)
    assert len(alone) == 2 and torch.equal(out, expected.to(out.dtype))


@pytest.mark.parametrize("width", [48, 80, 32], ids=str)
def test_grouped_experts_refuse_rows_of_another_width_naming_the_shapes(lib, width):
    x, *rest = experts_operands([2, 3])
    message = (
        rf"activation \(5, {width}\): packed weight torch.uint8 \(24, 32\).* \(the shapes of one expert of 2, "
        rf"stacked as packed weights \(2, 24, 32\) and block scales \(2, 24, 4\)\)"
    )
    with pytest.raises(ValueError, match=message):
        cpu.grouped_static_nvfp4_linear(torch.zeros(5, width, dtype=x.dtype), *rest)


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


# The kernel's code paths by the flags that build them: for this CPU (with VNNI's byte dot
# products where it has them), AVX2 without them, and the portable C.
INSTRUCTION_SETS = {"native": ("-march=native",), "avx2": ("-mavx2",), "portable": ()}


@pytest.fixture(scope="module")
def instruction_set_builds(tmp_path_factory):
    """Each of INSTRUCTION_SETS' builds this CPU runs, loaded."""
    directory = tmp_path_factory.mktemp("builds")
    builds = {}
    for name, flags in INSTRUCTION_SETS.items():
        if name == "avx2" and "avx2" not in cpu_flags():
            continue
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(cpu_kernel.CACHE_ENV_VAR, str(directory))
            built = cpu_kernel._build_with([*cpu_kernel._compiler(), *cpu_kernel.FLAGS, *flags])
        builds[name] = cpu_kernel._load(built)
    return builds


@pytest.mark.parametrize("name", list(INSTRUCTION_SETS))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 33], ids=str)
def test_every_instruction_set_build_equals_the_definition(instruction_set_builds, name, rows):
    """Every build that can take the rows equals the definition bit for bit; the portable one
    takes up to 16, the vector ones any number."""
    if name not in instruction_set_builds:
        pytest.skip(f"this CPU has no {name}")
    built = instruction_set_builds[name]
    assert built.most_rows == (16 if name == "portable" else 2**31 - 1)
    args = operands(rows, 37, 80, torch.bfloat16, seed=rows)
    if rows > built.most_rows:
        with pytest.raises(ValueError, match=f"takes at most 16 rows, got {rows} rows of 80"):
            cpu_kernel.static_nvfp4_linear_rows(built, *args, cpu.decoding_tables()[1])
        return
    out = cpu_kernel.static_nvfp4_linear_rows(built, *args, cpu.decoding_tables()[1])
    assert torch.equal(out, references.static_nvfp4_linear_in_block_order(*args))


def test_a_workspace_the_kernel_cannot_allocate_raises_memory_error_naming_the_shapes(lib):
    class OutOfMemory:
        most_rows = lib.most_rows

        @staticmethod
        def nvfp4_linear(*args):
            return -1

    args = operands(5, 24, 64, torch.bfloat16, seed=10)
    with pytest.raises(MemoryError, match=r"5 rows of 64 \(a \[5, 64\] activation times a \[24, 64\] weight\)"):
        cpu_kernel.static_nvfp4_linear_rows(OutOfMemory, *args, cpu.decoding_tables()[1])


@pytest.mark.parametrize("rows", [0, 1, 5], ids=str)
def test_kernel_takes_no_rows_and_a_weight_of_no_outputs(lib, monkeypatch, rows):
    without_torch_route(monkeypatch)
    x, qdata, scales, weight_scale, act_scale, bias = operands(max(rows, 1), 24, 64, torch.bfloat16, seed=11)
    no_rows = cpu.static_nvfp4_linear(x[:0], qdata, scales, weight_scale, act_scale, bias)
    assert no_rows.shape == (0, 24) and no_rows.dtype == torch.bfloat16
    no_outputs = cpu.static_nvfp4_linear(x[:rows], qdata[:0], scales[:0], weight_scale, act_scale, bias[:0])
    assert no_outputs.shape == (rows, 0) and no_outputs.dtype == torch.bfloat16


def test_kernel_takes_leading_dims(lib):
    x, *rest = operands(2 * 7, 48, 96, torch.bfloat16, seed=4)
    out = cpu.static_nvfp4_linear(x.reshape(2, 7, 96), *rest)
    assert torch.equal(out, cpu.static_nvfp4_linear(x, *rest).reshape(2, 7, 48))
    assert torch.equal(cpu.static_nvfp4_linear(x[3], *rest), out[0, 3])


@contextlib.contextmanager
def split_into(threads, monkeypatch):
    """Calls split their outputs into ``threads`` parts, however small."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_kernel, "_PRODUCTS_PER_THREAD", 1)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 4, 20], ids=str)
def test_outputs_split_across_threads_equal_one_thread(lib, monkeypatch, rows):
    """Rounds of 5, 2, 7 and 3 parts in turn on the kernel's worker threads, kept between calls."""
    args = operands(rows, 61, 256, torch.bfloat16, seed=2)
    one_thread = cpu.static_nvfp4_linear(*args)
    for threads in (5, 2, 7, 3):
        with split_into(threads, monkeypatch):
            assert torch.equal(cpu.static_nvfp4_linear(*args), one_thread)


def test_calls_from_several_python_threads_at_once_equal_one_thread(lib, monkeypatch):
    """The kernel releases the GIL: concurrent split calls, one using the workers and the others
    running their parts themselves, each get their own outputs."""
    calls = [operands(rows, 61, 256, torch.bfloat16, seed=rows) for rows in (1, 3, 9, 20)]
    expected = [cpu.static_nvfp4_linear(*args) for args in calls]
    with split_into(4, monkeypatch), concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            outs = list(pool.map(lambda args: cpu.static_nvfp4_linear(*args), calls))
            assert all(torch.equal(out, want) for out, want in zip(outs, expected))


def _split_call_in_child(args, expected, results):
    torch.set_num_threads(4)
    cpu_kernel._PRODUCTS_PER_THREAD = 1
    results.put(torch.equal(cpu.static_nvfp4_linear(*args), expected))


def test_a_forked_child_splits_calls_on_workers_of_its_own(lib, monkeypatch):
    """fork() copies none of the parent's worker threads: the child starts its own rather than
    waiting on workers that are not there."""
    args = operands(4, 61, 256, torch.bfloat16, seed=12)
    expected = cpu.static_nvfp4_linear(*args)
    with split_into(4, monkeypatch):
        assert torch.equal(cpu.static_nvfp4_linear(*args), expected)  # the parent's workers started
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_split_call_in_child, args=(args, expected, results))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's split call did not finish in 60 s")
    assert child.exitcode == 0 and results.get(timeout=5) is True


def test_traced_on_a_cpu_the_linear_is_one_op_equal_to_the_eager_call(lib):
    """A traced graph holds the op, which chooses kernel or torch ops by its row count when it
    runs: no weight-sized temporaries in the graph, and its outputs are the eager ones."""
    args = operands(3, 40, 64, torch.bfloat16, seed=1)
    graph = make_fx(lambda *a: cpu.static_nvfp4_linear(*a))(*args)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.nvfp4_static.cpu_static_nvfp4_linear.default]
    assert torch.equal(graph(*args), cpu.static_nvfp4_linear(*args))
    with PassThrough():
        assert torch.equal(cpu.static_nvfp4_linear(*args), graph(*args))


def test_compiled_once_for_every_row_count_equal_to_eager(lib):
    counter = CompileCounter()
    linear = torch.compile(cpu.static_nvfp4_linear, backend=counter, fullgraph=True, dynamic=True)
    _, *weights = operands(1, 32, 128, torch.bfloat16, seed=3)
    for rows in (2, 5, 16, 17, 40):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert torch.equal(linear(x, *weights), cpu.static_nvfp4_linear(x, *weights))
    assert counter.frame_count == 1


def bad_operands():
    x, qdata, scales, weight_scale, act_scale, bias = operands(2, 32, 64, torch.bfloat16, seed=6)
    good = dict(x=x, weight_qdata=qdata, weight_block_scales=scales, weight_per_tensor_scale=weight_scale,
                act_per_tensor_scale=act_scale, bias=bias)
    return good, {
        "weight K": ({"weight_qdata": qdata[:, :16]}, "packed weight"),
        "weight dtype": ({"weight_qdata": qdata.view(torch.int8)}, "packed weight"),
        "scales shape": ({"weight_block_scales": scales[:, :2]}, "block scales"),
        "scales dtype": ({"weight_block_scales": scales.view(torch.uint8)}, "block scales"),
        "scales rows": ({"weight_block_scales": scales[:16]}, "block scales"),
        "bias": ({"bias": bias[:31]}, "bias of shape (31,)"),
        "global scale": ({"act_per_tensor_scale": act_scale.repeat(2)}, "activation global scale"),
        "device": ({"weight_qdata": qdata.to("meta")}, "operands on ['cpu', 'meta']"),
    }


@pytest.mark.parametrize("case", list(bad_operands()[1]))
def test_kernel_refuses_operands_it_would_misread_naming_them(lib, case):
    good, cases = bad_operands()
    change, named = cases[case]
    with pytest.raises(ValueError, match="static NVFP4 linear of an activation \\(2, 64\\)") as error:
        cpu_kernel.static_nvfp4_linear_rows(lib, **{**good, **change}, scale_values=cpu.decoding_tables()[1])
    assert named in str(error.value)


def fake_compiler(directory, script: str) -> str:
    """An executable shell script standing in for the C compiler."""
    path = directory / "cc"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize(
    "compiler,message",
    [("/nonexistent/cc", "No such file"), ("failing", "no compiler here")],
    ids=["missing", "failing"],
)
def test_an_unbuildable_kernel_warns_once_and_the_torch_ops_run(fresh_build, monkeypatch, compiler, message):
    if compiler == "failing":
        compiler = fake_compiler(fresh_build, "echo 'no compiler here' >&2; exit 1\n")
    monkeypatch.setenv("CC", compiler)
    args = operands(2, 32, 64, torch.bfloat16, seed=7)
    with pytest.warns(RuntimeWarning, match="CPU kernel .* could not be built") as caught:
        out = cpu.static_nvfp4_linear(*args)
    assert len(caught) == 1 and message in str(caught[0].message) and "$CC" in str(caught[0].message)
    assert torch.equal(out, cpu.torch_static_nvfp4_linear(*args))
    with no_warnings():
        assert torch.equal(cpu.static_nvfp4_linear(*args), out)


def test_a_compiler_without_march_native_builds_the_portable_kernel(fresh_build, monkeypatch):
    real = os.environ.get("CC") or "cc"
    log = fresh_build / "commands"
    compiler = fake_compiler(
        fresh_build,
        f'echo "$*" >> {log}\ncase "$*" in *-march=native*) echo "unknown -march" >&2; exit 1;; esac\nexec {real} "$@"\n',
    )
    monkeypatch.setenv("CC", compiler)
    args = operands(2, 32, 64, torch.float32, seed=8)
    out = cpu.static_nvfp4_linear(*args)
    commands = log.read_text().splitlines()
    assert len(commands) == 2 and "-march=native" in commands[0] and "-march=native" not in commands[1]
    assert torch.equal(out, references.static_nvfp4_linear_in_block_order(*args))


def test_the_built_kernel_is_reused_from_the_cache(fresh_build, monkeypatch):
    log = fresh_build / "commands"
    real = os.environ.get("CC") or "cc"
    monkeypatch.setenv("CC", fake_compiler(fresh_build, f'echo "$*" >> {log}\nexec {real} "$@"\n'))
    assert cpu_kernel.library() is not None
    monkeypatch.setattr(cpu_kernel, "_library", None)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    assert cpu_kernel.library() is not None
    assert len(log.read_text().splitlines()) == 1
    assert len(list((fresh_build / "cache").glob("cpu_kernel-*.so"))) == 1


def test_switched_off_the_kernel_is_neither_built_nor_used(fresh_build, monkeypatch):
    monkeypatch.setenv(cpu_kernel.SWITCH_ENV_VAR, "0")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    args = operands(2, 32, 64, torch.bfloat16, seed=7)
    with no_warnings():
        out = cpu.static_nvfp4_linear(*args)
    assert torch.equal(out, cpu.torch_static_nvfp4_linear(*args))
    assert not (fresh_build / "cache").exists() or not list((fresh_build / "cache").iterdir())
