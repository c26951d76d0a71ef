"""backends/triton_eager.py: a replayed layer call equals the Triton route's call bit for bit.

On CPU the recorded launches replay under Triton's interpreter (in a child process, see
triton_interpreter) with small tiles; on a CUDA machine the converted layer's own forward runs
the real kernels through Triton's compiled launchers, against the general route.
"""

import copy
import io
import warnings
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import captured_twice_then_replayed_backwards, gpu_tolerance, linear_operands, relative_error, requires_cuda
from torch.utils._python_dispatch import TorchDispatchMode
from torchao.utils import unwrap_tensor_subclass
from triton_interpreter import run_interpreted

from nvfp4_static.backends import triton_eager
from nvfp4_static.backends.triton_eager import EagerTritonLaunches, ReplayedLinear
from nvfp4_static.kernels import gemm, gemm_decode_warp_specialized, gemm_warp_specialized
from nvfp4_static.kernels.gemm import (
    DECODE_TILE,
    SPLIT_SQUARE_TILES,
    SPLIT_TALL_TILES,
    SQUARE_TILE,
    TALL_TILE,
    _epilogue_kernel,
    table_config,
    triton_entries,
)
from nvfp4_static.kernels.launch import KernelCall, recording_launches
from nvfp4_static.kernels.replay import reproduces
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.tensor import NVFP4StaticTensor, static_linear

REPLAYER = "test_triton_eager:record_then_replay"


def _route(x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, config, copies_operand=False):
    """The Triton route's launches for one bucket, called as the ops call them: the activation
    kernel then the GEMM, or the GEMM alone where ``config`` quantizes the activation itself.
    A split K is summed in the GEMM, whose tile counters a replay reuses: a replay that left
    them wrong would leave tiles unsummed. ``copies_operand``: a torch op copies the operand
    between the two kernels, which a recording does not see (the GEMM's operand is then a
    buffer no replayed launch writes)."""
    from nvfp4_static.kernels.act_quantize import launch_activation_quantize
    from nvfp4_static.kernels.gemm import launch_nvfp4_gemm

    out = torch.empty(x.shape[0], weight_qdata.shape[0], dtype=x.dtype)
    weights = (weight_qdata, weight_block_scales, act_scale, weight_scale, bias, out, config)
    if config.activation_rows:
        launch_nvfp4_gemm(x, *weights, raw_activation=True)
    else:
        operand = torch.empty(x.shape, dtype=torch.float16)
        launch_activation_quantize(x, act_scale, None, None, operand)
        launch_nvfp4_gemm(operand.clone() if copies_operand else operand, *weights)
    return out


def record_then_replay(first_x, second_x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, config,
                       copies_operand):
    """In the interpreted child: record the route on ``first_x``, replay it on ``second_x`` over
    scratch memory of 0xFF bytes; returns (first output, replayed output, the route's output on
    ``second_x``, launches, whether the replay reproduces the route's output)."""
    weights = (weight_qdata, weight_block_scales, act_scale, weight_scale, bias)
    with recording_launches() as calls:
        first = _route(first_x, *weights, config, copies_operand)
    replay = ReplayedLinear.of(first_x, first, calls, (weight_qdata, weight_block_scales, weight_scale, act_scale, bias), None)
    replay.poison_scratch()
    replayed = replay(second_x, None)
    expected = _route(second_x, *weights, config, copies_operand)
    return first, replayed, expected, len(calls), reproduces((replayed,), (expected,))


def _interpreter_configs():
    from nvfp4_static.kernels.gemm import GemmConfig

    # Small tiles so that the interpreter sees several tiles and a split K (programs_per_sm is
    # large against the CPU's one "SM").
    split_k = GemmConfig(16, 32, 32, num_warps=4, num_stages=1, programs_per_sm=64)
    operand_then_gemm = GemmConfig(16, 16, 32, num_warps=4, num_stages=1)
    return {  # name: (config, launches, whether a torch op copies the operand)
        "operand-then-gemm": (operand_then_gemm, 2, False),
        "operand-then-split-k": (split_k, 2, False),  # the GEMM sums its splits itself
        "quantizing-split-k": (replace(split_k, activation_rows=2), 1, False),
        "operand-copied-by-torch": (operand_then_gemm, 2, True),
    }


INTERPRETER_CASES = ["operand-then-gemm", "operand-then-split-k", "quantizing-split-k"]


@pytest.fixture(scope="module")
def replays():
    launches = {}
    for seed, (name, (config, _, copies_operand)) in enumerate(_interpreter_configs().items()):
        first = linear_operands(3, 40, 224, seed, block_gains=True)
        second = linear_operands(3, 40, 224, seed + 10, block_gains=True)
        weights = (first.weight_qdata, first.weight_block_scales, first.act_scale, first.weight_scale, first.bias)
        launches[name] = (f"{REPLAYER}", (first.x, second.x, *weights, config, copies_operand))
    return run_interpreted(launches)


@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_interpreted_replay_equals_the_route_on_a_new_activation(replays, case):
    """Over scratch memory of 0xFF bytes: every buffer a replayed launch reads, one wrote."""
    first, replayed, expected, launches, reproduced = replays[case].returned
    assert launches == _interpreter_configs()[case][1]
    assert not expected.isnan().any()
    assert torch.equal(replayed, expected) and reproduced
    assert not torch.equal(replayed, first)  # the new activation, not the recorded one


def test_interpreted_replay_of_a_route_with_a_torch_op_inside_reads_the_poisoned_scratch(replays):
    """The operand copied by torch between the kernels: the replayed GEMM reads a scratch buffer
    of 0xFF bytes (fp16 NaNs), and the check says the replay does not reproduce the route."""
    _, replayed, expected, launches, reproduced = replays["operand-copied-by-torch"].returned
    assert launches == 2
    assert not expected.isnan().any()
    assert replayed.isnan().all()
    assert not reproduced


def _call(kernel_args):
    return KernelCall(kernel=None, grid=(1,), args=kernel_args, meta={})


@dataclass
class Descriptor:
    """Stands for a TMA descriptor argument: the tensor it describes is its ``base``."""

    base: torch.Tensor
    block_shape: tuple = (16, 32)


def test_replay_refuses_launches_it_could_not_redo():
    """Each refusal sends the layer to the general route: nothing launched, an output no launch
    wrote, a scratch buffer that is a strided view, one buffer used under two shapes, or a
    descriptor of the activation or the output (a replay would have to rebuild it each call)."""
    x, out, weight = torch.zeros(2, 32), torch.zeros(2, 8), torch.zeros(8, 16, dtype=torch.uint8)
    scratch = torch.zeros(4, 32)
    weights = (weight,)
    assert ReplayedLinear.of(x, out, [], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, weight, scratch))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, scratch.t(), out))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, scratch, out)), _call((scratch.view(8, 16), out))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((Descriptor(x), weight, out))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, weight, Descriptor(out)))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, Descriptor(weight), Descriptor(out), out))], weights, None) is None
    assert ReplayedLinear.of(x, out, [_call((x, Descriptor(scratch.t()), out))], weights, None) is None


class SeenKernel:
    """Stands for a kernel under Triton's interpreter: keeps the arguments of each launch."""

    def __init__(self, *arg_names):
        self.arg_names = list(arg_names)
        self.seen = []

    def __getitem__(self, grid):
        return lambda *values, **options: self.seen.append(values)


def test_replay_describes_the_arenas_buffer_where_a_descriptor_described_scratch(monkeypatch):
    """A launch reading the operand through a TMA descriptor (the warp-specialized GEMM): the
    replay's descriptor describes the arena buffer the replayed operand kernel writes, not the
    recorded call's operand; a descriptor of a weight stays as it was; the activation and the
    output are the replay's own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the launches are kept as values, not compiled
    x, out, weight = torch.zeros(2, 32), torch.zeros(2, 8), torch.zeros(8, 16, dtype=torch.uint8)
    operand = torch.zeros(2, 32, dtype=torch.float16)
    quantize = KernelCall(SeenKernel("x", "operand"), (1,), (x, operand), {})
    descriptors = (Descriptor(operand, (16, 32)), Descriptor(weight))
    multiply = KernelCall(SeenKernel("a_desc", "w_desc", "out"), (1,), (*descriptors, out), {})
    replay = ReplayedLinear.of(x, out, [quantize, multiply], (weight,), None)
    for round in range(2):
        new_x = torch.ones(2, 32)
        new_out = replay(new_x, None)
        x_seen, operand_seen = quantize.kernel.seen[round]
        a_desc, w_desc, out_seen = multiply.kernel.seen[round]
        assert x_seen is new_x and out_seen is new_out
        assert a_desc.base is operand_seen and a_desc.base.data_ptr() != operand.data_ptr()
        assert a_desc.block_shape == (16, 32) and a_desc.base.shape == operand.shape
        assert a_desc.base.dtype == operand.dtype
        assert w_desc.base is weight


def _layer(N, K, dtype, device, with_bias=True, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    weight = torch.randn(N, K, generator=generator, device=device, dtype=dtype)
    nvfp4 = NVFP4StaticTensor.from_float(weight, torch.tensor(8.0), backend_override="triton" if device == "cuda" else None)
    bias = torch.nn.Parameter(torch.randn(N, generator=generator, device=device, dtype=dtype)) if with_bias else None
    return NVFP4StaticLinear(nvfp4, bias, recipe={}, layer_name="layer")


def test_copies_of_a_layer_start_without_its_launches():
    """What is kept holds the original's tensor addresses: a deep copy or an unpickled layer
    prepares its own."""
    layer = _layer(32, 64, torch.float32, "cpu")
    copied = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        assert isinstance(other._eager_launches, EagerTritonLaunches)
        assert other._eager_launches is not layer._eager_launches
        x = torch.randn(3, 64)
        assert torch.equal(other(x), layer(x))


def test_cpu_activations_take_the_general_route():
    layer = _layer(32, 64, torch.float32, "cpu")
    x = torch.randn(3, 64)
    assert layer._eager_launches(x, layer.weight, layer.bias) is None
    assert torch.equal(layer(x), static_linear(x, layer.weight, layer.bias))


def test_a_layer_with_unwrapped_weights_asks_for_the_replay_with_its_inner_tensors(monkeypatch):
    """torchao's unwrap_tensor_subclass holds the weight as plain tensors and rebuilds it at
    each read around them: the layer still goes to its replay, with those tensors (on a GPU it
    replays; on CPU the replay declines and the route runs)."""
    layer = _layer(32, 64, torch.float32, "cpu")
    expected = layer(torch.ones(3, 64))
    unwrap_tensor_subclass(torch.nn.Sequential(layer))
    assert layer._parameters.get("weight") is None
    asked = []
    original = EagerTritonLaunches.__call__

    def recording(self, x, weight, bias):
        asked.append((weight.qdata, weight.scale, bias))
        return original(self, x, weight, bias)

    monkeypatch.setattr(EagerTritonLaunches, "__call__", recording)
    assert torch.equal(layer(torch.ones(3, 64)), expected)
    originals = layer.parametrizations.weight
    assert len(asked) == 1
    assert asked[0][0] is originals.original0 and asked[0][1] is originals.original1
    assert asked[0][2] is layer.bias


class StandInReplay:
    """Stands for a recorded linear whose replay gives ``out``; notes what it was asked, in order."""

    def __init__(self, out):
        self.out, self.asked, self.checked = out, [], False

    def poison_scratch(self):
        self.asked.append("poison")

    def __call__(self, x, stream):
        self.asked.append("replay")
        return self.out


def _wrong_outputs(expected):
    """Replayed outputs that are not the route's: NaNs, one value one bit off, the sign of one
    value flipped, the route's output for another activation."""
    one_bit = expected.clone()
    one_bit.view(torch.int32)[1, 5] += 1
    flipped = expected.clone()
    flipped[2, 0] = -flipped[2, 0]
    return {"nan": torch.full_like(expected, float("nan")), "one-bit": one_bit, "sign": flipped, "other": expected + 1}


def test_a_first_replay_is_kept_only_where_it_gives_the_routes_output_bit_for_bit():
    """Each first replay runs over poisoned scratch, beside the route; the call returns the
    route's output either way. A replay agreeing is kept, marked checked; each wrong one is
    dropped (the shape is not replayed from then on) with a warning naming the weight's and the
    activation's shapes."""
    layer = _layer(32, 64, torch.float32, "cpu")
    launches = layer._eager_launches
    x = torch.randn(3, 64)
    expected = static_linear(x, layer.weight, layer.bias)
    good = StandInReplay(expected.clone())
    launches._linears = {"good": good}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(launches._first_replay("good", good, x, layer.weight, layer.bias, None), expected)
    assert good.checked and good.asked == ["poison", "replay"] and launches._linears["good"] is good
    for name, wrong in _wrong_outputs(expected).items():
        replay = StandInReplay(wrong)
        launches._linears = {name: replay}
        with pytest.warns(RuntimeWarning, match=r"weight \[32, 64\] called on a torch.float32 activation of shape \[3, 64\]"):
            out = launches._first_replay(name, replay, x, layer.weight, layer.bias, None)
        assert torch.equal(out, expected), name
        assert launches._linears == {name: None} and not replay.checked, name


def test_a_layer_keeps_replays_for_its_most_recently_recorded_shapes(monkeypatch):
    """At most ``REPLAYED_SHAPES`` (3 here): each new shape's recording forgets the oldest one,
    and every recording call gives the route's output. On CPU the route launches nothing, so
    each shape is kept as one that is not replayed, which counts alike."""
    monkeypatch.setattr(triton_eager, "REPLAYED_SHAPES", 3)
    layer = _layer(32, 64, torch.float32, "cpu")
    launches = layer._eager_launches
    launches._hold(layer.weight, layer.bias)
    for M in (1, 2, 3, 4, 5):
        x = torch.randn(M, 64)
        out = launches._record((M,), x, layer.weight, layer.bias, None)
        assert torch.equal(out, static_linear(x, layer.weight, layer.bias))
        assert list(launches._linears) == [(m,) for m in range(max(1, M - 2), M + 1)]


# --- On a GPU: the layer's forward against the general route ---------------------------------------------


def _activation(shape, dtype, seed):
    generator = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(shape, generator=generator, device="cuda") * 3).to(dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gpu_replayed_forward_equals_the_route_at_every_bucket(dtype, with_bias):
    """Each M three times with new values (the first call records, the second checks the first
    replay, the third replays), every tile bucket up to the last replayed one (the Triton
    entries') and past it, and leading dims."""
    layer = _layer(1024, 2048, dtype, "cuda", with_bias)
    last_replayed = max(max_m for max_m, _ in triton_entries())  # then the general route
    past = (last_replayed + 1, 2048)
    shapes = list(dict.fromkeys([(1, 2048), (2, 2048), (5, 2048), (16, 2048), (17, 2048), (33, 2048), (64, 2048),
                                 (last_replayed, 2048), past, (2, 3, 2048), (1, 1, 2048)]))
    with torch.no_grad():
        for seed, shape in enumerate(shapes):
            for call in range(3):
                x = _activation(shape, dtype, seed=10 * seed + call)
                assert torch.equal(layer(x), static_linear(x, layer.weight, layer.bias)), (shape, call)
    replayed = {key[0] for key, linear in layer._eager_launches._linears.items() if _checked_replay(linear)}
    assert replayed == {torch.Size(shape) for shape in shapes if shape != past}


def _checked_replay(linear) -> bool:
    return isinstance(linear, ReplayedLinear) and linear.checked


@requires_cuda
def test_gpu_a_layer_replays_its_most_recent_shapes_and_records_a_forgotten_one_again(monkeypatch):
    """With room for 3 shapes, 5 token counts called three times each: the second and third
    calls of each replay, the layer keeps the last 3, and the first count, called again, is
    recorded again; every output is the route's."""
    monkeypatch.setattr(triton_eager, "REPLAYED_SHAPES", 3)
    layer = _layer(512, 1024, torch.bfloat16, "cuda")
    with torch.no_grad():
        for seed, M in enumerate((1, 4, 16, 64, 200, 1)):
            for call in range(3):
                x = _activation((M, 1024), torch.bfloat16, seed=10 * seed + call)
                assert torch.equal(layer(x), static_linear(x, layer.weight, layer.bias)), (M, call)
    kept = [key[0] for key in layer._eager_launches._linears]
    assert kept == [torch.Size((M, 1024)) for M in (64, 200, 1)]
    assert all(_checked_replay(linear) for linear in layer._eager_launches._linears.values())


@requires_cuda
def test_gpu_replay_follows_new_weights_streams_and_falls_back_on_odd_activations(monkeypatch):
    """A weight loaded in place (same tensors, new values), a new weight assigned, another
    stream, a strided or misaligned activation, and a dispatch mode (which must see the ops, and
    under which the route runs as traced: the table's entry after the operand kernel, not the
    one launch of an eager call of 4 rows)."""
    layer, other = _layer(512, 1024, torch.bfloat16, "cuda"), _layer(512, 1024, torch.bfloat16, "cuda", seed=1)
    x = _activation((4, 1024), torch.bfloat16, seed=0)

    def expected(x):
        return static_linear(x, layer.weight, layer.bias)

    with torch.no_grad():
        layer(x), layer(x)  # recorded, then its first replay checked
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x), static_linear(x, other.weight, other.bias))
        third = _layer(512, 1024, torch.bfloat16, "cuda", seed=2)
        layer.weight, layer.bias = third.weight, third.bias
        assert torch.equal(layer(x), static_linear(x, third.weight, third.bias))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            on_stream = layer(x)
        stream.synchronize()
        assert torch.equal(on_stream, expected(x))
        wide = _activation((4, 2048), torch.bfloat16, seed=1)
        assert torch.equal(layer(wide[:, :1024]), expected(wide[:, :1024]))
        flat = _activation((4 * 1024 + 4,), torch.bfloat16, seed=2)
        misaligned = flat[4:].view(4, 1024)  # 8 bytes past an aligned address
        assert torch.equal(layer(misaligned), expected(misaligned))

        class OpNames(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(str(func))
                return func(*args, **(kwargs or {}))

        with OpNames() as mode:
            out = layer(x)
        monkeypatch.setattr(gemm, "EAGER_QUANTIZING_MAX_ROWS", 1)
        assert torch.equal(out, expected(x))
        assert any("nvfp4_static" in name for name in mode.names), mode.names


@requires_cuda
def test_gpu_a_layer_captured_twice_on_one_stream_gives_its_outputs_whatever_the_kept_counters_hold():
    """A layer called eagerly (its launches recorded and replayed), then captured into two CUDA
    graphs on another stream, at several token counts: nothing is recorded for the capture
    stream, and after the counters kept for the captures are filled with 7s, the graphs
    replayed in the other order than captured both give the route's output (the graphs' tiles
    may differ from eager calls', hence a tolerance); the eager call still gives it bit for bit."""
    layer = _layer(4096, 14336, torch.bfloat16, "cuda")
    stream, checked = torch.cuda.Stream(), []
    with torch.no_grad():
        for M in (1, 4, 64, 128):
            x = _activation((M, 14336), torch.bfloat16, seed=M)
            expected = static_linear(x, layer.weight, layer.bias)
            assert torch.equal(layer(x), expected) and torch.equal(layer(x), expected)
            outs, kept = captured_twice_then_replayed_backwards(lambda: layer(x), stream)
            assert torch.equal(outs[0], outs[1]), M
            assert relative_error(outs[0], expected) <= gpu_tolerance(14336, torch.bfloat16), M
            assert torch.equal(layer(x), expected), M
            checked.append((M, kept))
    assert any(kept for _, kept in checked), f"no capture used tile counters: {checked}"
    assert all(key[3] != stream.cuda_stream for key in layer._eager_launches._linears)


@requires_cuda
def test_gpu_a_layer_with_unwrapped_weights_replays_its_launches():
    """The weight rebuilt at each read (torchao's unwrap_tensor_subclass) shares its inner
    tensors, so the second and third calls of each shape replay, with the route's outputs."""
    layer = _layer(1024, 2048, torch.bfloat16, "cuda")
    unwrap_tensor_subclass(torch.nn.Sequential(layer))
    shapes = [(1, 2048), (16, 2048), (64, 2048)]
    with torch.no_grad():
        for seed, shape in enumerate(shapes):
            for call in range(3):
                x = _activation(shape, torch.bfloat16, seed=10 * seed + call)
                assert torch.equal(layer(x), static_linear(x, layer.weight, layer.bias)), (shape, call)
    replayed = {key[0] for key, linear in layer._eager_launches._linears.items() if _checked_replay(linear)}
    assert replayed == {torch.Size(shape) for shape in shapes}


@requires_cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and gemm_warp_specialized.available(torch.device("cuda"))),
    reason="needs a Hopper GPU and Gluon",
)
@pytest.mark.parametrize(
    "M,N,K,tile",
    [(300, 8192, 1024, "tall"), (100, 14336, 1024, "square"), (128, 8192, 8192, "split-square"),
     (200, 8192, 1024, "split-tall"),
     (16, 28672, 8192, "decode"), (16, 14336, 8192, "decode")],
)
def test_gpu_replay_redoes_the_warp_specialized_launch(M, N, K, tile):
    """On Hopper a wide layer at 65-512 rows runs the warp-specialized Gluon GEMM (split in K, its
    partial products then summed by the epilogue kernel, where its programs alone would leave SMs
    idle), and a large layer at 2-16 rows the decode one, which read the operand through a TMA
    descriptor (the decode kernel on 28672 x 8192 in one split, on 14336 x 8192 in two that its
    programs sum themselves): the second and third calls replay it (over the arena's operand and
    partial products), each with the route's output for its own activation."""
    tiles = {
        "tall": TALL_TILE,
        "square": SQUARE_TILE,
        "split-square": SPLIT_SQUARE_TILES[128],
        "split-tall": SPLIT_TALL_TILES[256],
        "decode": DECODE_TILE,
    }
    kernel = (
        gemm_decode_warp_specialized._decode_gemm_kernel
        if tile == "decode"
        else gemm_warp_specialized._warp_specialized_gemm_kernel
    )
    assert table_config(M, None, N, K, torch.device("cuda")) == tiles[tile]
    layer = _layer(N, K, torch.bfloat16, "cuda")
    with torch.no_grad():
        outs = []
        for call in range(3):
            x = _activation((M, K), torch.bfloat16, seed=call)
            outs.append(layer(x))
            assert torch.equal(outs[-1], static_linear(x, layer.weight, layer.bias)), call
    assert not torch.equal(outs[1], outs[2])
    linear = layer._eager_launches._linears[next(iter(layer._eager_launches._linears))]
    assert _checked_replay(linear)
    kernels = [launch._kernel for launch in linear._launches._launches]
    assert kernels.count(kernel) == 1
    assert (_epilogue_kernel in kernels) == tile.startswith("split-")
