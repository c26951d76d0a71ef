"""backends/cpu_eager.py: a converted layer's eager CPU call through its prepared kernel
arguments equals the general route's call bit for bit, and every call it does not take, or
whose weight changed, reaches the general route."""

import copy
import io

import pytest
import torch
from conftest import PassThrough

from nvfp4_static import references
from nvfp4_static.backends import cpu_kernel
from nvfp4_static.backends.cpu_eager import EagerCpuKernelCalls
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.tensor import NVFP4StaticTensor, static_linear

N, K = 40, 96


@pytest.fixture(autouse=True)
def built_kernel():
    """A test machine has a C compiler: a missing kernel fails here rather than skipping."""
    assert cpu_kernel.library() is not None, "the CPU kernel was not built"


def layer_of(n=N, k=K, bias_dtype=torch.float32, seed=0, act_amax=8.0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    nvfp4 = NVFP4StaticTensor.from_float(weight, torch.tensor(act_amax))
    bias = None
    if bias_dtype is not None:
        bias = torch.nn.Parameter(torch.randn(n, generator=generator).to(bias_dtype), requires_grad=False)
    return NVFP4StaticLinear(nvfp4, bias, recipe={}, layer_name="layer")


def activation(*shape, dtype=torch.float32, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype)


class GeneralRouteSpy:
    """Stands in for a layer's Triton launches, whose ``linear`` is the general route's entry
    from the layer: counts the calls that reach it."""

    def __init__(self):
        self.calls = 0

    def linear(self, x, weight, bias):
        self.calls += 1
        return static_linear(x, weight, bias)


def spied(layer) -> GeneralRouteSpy:
    spy = GeneralRouteSpy()
    layer._eager_launches = spy
    return spy


def definition(layer, x):
    w = layer.weight
    return references.static_nvfp4_linear_in_block_order(
        x, w.qdata, w.scale, w.per_tensor_scale, w.act_per_tensor_scale, layer.bias
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, K), (5, K), (2, 3, K), (17, K), (K,)], ids=str)
def test_a_prepared_call_equals_the_general_route_and_the_definition_bit_for_bit(dtype, bias_dtype, shape):
    layer = layer_of(bias_dtype=bias_dtype)
    spy = spied(layer)
    for seed in range(3):  # the first call prepares, the later ones reuse
        x = activation(*shape, dtype=dtype, seed=seed)
        with torch.no_grad():
            out = layer(x)
        assert out.dtype == dtype and out.shape == (*shape[:-1], N)
        assert torch.equal(out, static_linear(x, layer.weight, layer.bias))
        assert torch.equal(out, definition(layer, x))
    assert spy.calls == 0


def test_a_call_outside_no_grad_takes_it_where_nothing_requires_gradients():
    layer = layer_of()
    spy = spied(layer)
    x = activation(3, K)
    assert torch.equal(layer(x), definition(layer, x))
    assert spy.calls == 0


@pytest.mark.parametrize("wants_gradients", ["bias", "activation", "both"])
def test_a_call_recording_gradients_takes_it_and_its_backward_raises_the_layers_error(wants_gradients):
    """Convert keeps the float bias, which requires gradients, so every call outside no_grad
    records gradients: the kernel serves it, its output tied back to the inputs."""
    layer = layer_of()
    layer.bias.requires_grad_(wants_gradients in ("bias", "both"))
    spy = spied(layer)
    x = activation(3, K).requires_grad_(wants_gradients in ("activation", "both"))
    with torch.enable_grad():
        out = layer(x)
    assert spy.calls == 0 and out.requires_grad
    assert torch.equal(out.detach(), definition(layer, x.detach()).detach())
    with pytest.raises(RuntimeError, match="converted NVFP4 layers are inference-only"):
        out.sum().backward()


def general_route_cases():
    """Calls the prepared kernel arguments do not serve: (name, how to make the layer, the call)."""

    def float16(layer):
        return layer(activation(4, K, dtype=torch.float16))

    def under_a_dispatch_mode(layer):
        with PassThrough():
            return layer(activation(4, K))

    def more_rows_than_the_kernel_takes(layer, monkeypatch):
        monkeypatch.setattr(cpu_kernel.library(), "most_rows", 3)
        return layer(activation(4, K))

    def no_rows(layer):
        return layer(activation(0, K))

    def float64_activation_scale(layer):
        weight = layer.weight
        weight.act_per_tensor_scale = weight.act_per_tensor_scale.double()
        return layer(activation(4, K))

    def strided_weight(layer):
        weight = layer.weight
        weight.qdata = torch.cat([weight.qdata, weight.qdata], dim=1)[:, : K // 2]
        return layer(activation(4, K))

    def strided_block_scales(layer):
        weight = layer.weight
        weight.scale = weight.scale.t().contiguous().t()
        return layer(activation(4, K))

    def float16_bias(layer):
        layer.bias = torch.nn.Parameter(layer.bias.half(), requires_grad=False)
        return layer(activation(4, K))

    def kernel_switched_off(layer, monkeypatch):
        layer(activation(4, K))  # prepared while the kernel is on
        monkeypatch.setenv(cpu_kernel.SWITCH_ENV_VAR, "0")
        return layer(activation(4, K))

    return {
        case.__name__: case
        for case in (
            float16, under_a_dispatch_mode, more_rows_than_the_kernel_takes, no_rows,
            float64_activation_scale, strided_weight, strided_block_scales, float16_bias, kernel_switched_off,
        )
    }


@pytest.mark.parametrize("case", list(general_route_cases()))
def test_calls_it_does_not_serve_take_the_general_route_with_its_result(case, monkeypatch):
    call = general_route_cases()[case]
    layer = layer_of()
    spy = spied(layer)
    takes_monkeypatch = "monkeypatch" in call.__code__.co_varnames[: call.__code__.co_argcount]
    out = call(layer, monkeypatch) if takes_monkeypatch else call(layer)
    assert spy.calls == 1
    # what the general route gives for the same call, with the layer as the call left it
    reference_layer = copy.deepcopy(layer)
    reference_layer._eager_cpu_calls = None
    expected = call(reference_layer, monkeypatch) if takes_monkeypatch else call(reference_layer)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "shape", [(4, K - 16), (4, K + 16), (4, K // 2), (), (K, 4)], ids=["narrower", "wider", "half", "scalar", "transposed"]
)
def test_an_activation_of_another_width_is_refused_by_the_general_route_naming_the_shapes(shape):
    layer = layer_of()
    good = activation(2, K)
    with torch.no_grad():
        before = layer(good)
        with pytest.raises(ValueError, match=rf"activation of shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")):
            layer(activation(*shape) if shape else torch.tensor(1.0))
        assert torch.equal(layer(good), before)  # the prepared arguments still serve


def test_a_weight_loaded_in_place_reaches_the_next_call():
    layer, other = layer_of(seed=0), layer_of(seed=5, act_amax=20.0)
    x = activation(3, K)
    with torch.no_grad():
        first = layer(x)
        layer.load_state_dict(other.state_dict())
        out = layer(x)
    assert not torch.equal(out, first)
    assert torch.equal(out, definition(other, x))


@pytest.mark.parametrize("change", ["new weight", "qdata data", "bias in place", "new bias", "no bias"])
def test_a_changed_weight_or_bias_is_prepared_again(change):
    layer, other = layer_of(seed=0), layer_of(seed=5, act_amax=20.0)
    spy = spied(layer)
    x = activation(3, K)
    with torch.no_grad():
        first = layer(x)
        if change == "new weight":
            layer.weight = other.weight
        elif change == "qdata data":
            layer.weight.qdata.data = other.weight.qdata.clone()
        elif change == "bias in place":
            layer.bias.copy_(other.bias)
        elif change == "new bias":
            layer.bias = other.bias
        else:
            layer.bias = None
        out = layer(x)
    assert not torch.equal(out, first)
    assert torch.equal(out, definition(layer, x))
    assert spy.calls == 0


def test_copies_of_a_layer_start_without_its_prepared_arguments():
    layer = layer_of()
    x = activation(3, K)
    with torch.no_grad():
        expected = layer(x)
    assert layer._eager_cpu_calls._prepared[2] is not None
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert isinstance(other._eager_cpu_calls, EagerCpuKernelCalls)
        assert other._eager_cpu_calls is not layer._eager_cpu_calls
        assert other._eager_cpu_calls._prepared == ((), (), None)
        with torch.no_grad():
            assert torch.equal(other(x), expected)
        assert other._eager_cpu_calls._prepared[0][0] is other.weight.qdata


def test_a_layer_pickled_without_prepared_calls_takes_the_general_route():
    layer = layer_of()
    del layer._eager_cpu_calls  # the class default, None, as a layer pickled without them loads
    spy = spied(layer)
    x = activation(3, K)
    with torch.no_grad():
        assert torch.equal(layer(x), definition(layer, x))
    assert spy.calls == 1


@pytest.mark.parametrize("default_device", ["meta", "cpu"])
@pytest.mark.parametrize("rows, dtype", [(3, torch.float32), (3, torch.float16), (20, torch.bfloat16)],
                         ids=["prepared", "general", "many-rows"])
def test_a_call_while_another_default_device_is_set_gives_the_cpu_output(default_device, rows, dtype):
    """The kernels write through their outputs' pointers: allocated on the default device (meta
    here, CUDA on a GPU machine) they would not be CPU memory, and the process would crash."""
    layer, x = layer_of(), activation(rows, K, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        with torch.device(default_device):
            out = layer(x)
    assert out.device.type == "cpu" and torch.equal(out, expected)
    assert torch.equal(expected, definition(layer, x).to(dtype))


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-ops"])
def test_under_cpu_autocast_every_route_equals_the_definition(monkeypatch, autocast_dtype, kernel):
    """The torch ops multiply the unscaled operands (up to 6 x 448 each): under autocast that
    product in float16 would overflow to Inf, in bfloat16 be rounded."""
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "library", lambda: None)
    layer, x = layer_of(act_amax=1.0), activation(4, K)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype):
        out = layer(x)
    assert torch.equal(out, definition(layer, x))
