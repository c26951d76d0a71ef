"""smooth_norm_inputs: the float model is unchanged, the scales are SmoothQuant's, the quantized
error falls where a channel dominates its blocks, and bad calls leave the model as it was."""

import math
import re

import pytest
import torch

from conftest import all_but_lm_head, prepare
from nvfp4_static import NVFP4StaticLinear, calibrate_layer_by_layer, smooth_norm_inputs
from nvfp4_static.numerics import fake_quantize_nvfp4, per_tensor_amax_to_scale
from nvfp4_static.observers.mse import nvfp4_fake_quantize_with_amax
from tiny_llama import logits, tiny_llama, token_ids

K = 32


class ChannelScale(torch.nn.Module):
    """A norm whose output is ``x * weight``: each channel's largest output is known."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


class NormThenLinears(torch.nn.Module):
    def __init__(self, width: int = K, out: int = 32):
        super().__init__()
        self.norm = ChannelScale(width)
        self.proj = torch.nn.Linear(width, out, bias=False)
        self.gate = torch.nn.Linear(width, out, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return self.proj(y) + self.gate(y)


CONSUMERS = {"norm": ("proj", "gate")}


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_the_float_llama_computes_what_it_did():
    model = tiny_llama()
    with torch.no_grad():  # channels of very different sizes, as in trained models
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(torch.logspace(-2, 1, 64)[torch.randperm(64)])
    before = logits(model)
    scales = smooth_norm_inputs(model, lambda m: m(token_ids(1)))
    assert set(scales) == {
        f"model.layers.{i}.{norm}" for i in range(2)
        for norm in ("input_layernorm", "post_attention_layernorm")
    }
    # the input norms' channels span 1000x: the scales must move them, not stay near 1
    assert float(scales["model.layers.0.input_layernorm"].max()) > 4
    torch.testing.assert_close(logits(model), before, rtol=1e-4, atol=1e-4)


def test_scales_are_the_square_root_of_activation_over_weight_over_their_geometric_mean():
    model = NormThenLinears()
    # channel k's largest |input| is 4^(k % 4), every weight column's largest |value| is 1
    x = torch.zeros(3, K)
    x[1] = 4.0 ** (torch.arange(K) % 4)
    with torch.no_grad():
        model.proj.weight.fill_(0.5)
        model.proj.weight[0] = 1.0
        model.gate.weight.fill_(-1.0)
    scales = smooth_norm_inputs(model, lambda m: m(x), norm_consumers=CONSUMERS)["norm"]
    # sqrt(4^j / 1) = 2^j for j = 0..3, geometric mean 2^1.5
    expected = 2.0 ** ((torch.arange(K) % 4).float() - 1.5)
    torch.testing.assert_close(scales, expected)
    torch.testing.assert_close(model.norm.weight.detach(), 1 / expected)
    torch.testing.assert_close(model.gate.weight[:, 5].detach(), torch.full((32,), -expected[5]))


@pytest.mark.parametrize("alpha", [0.0, 1.0], ids=["weights-only", "activations-only"])
def test_alpha_picks_which_maxima_set_the_scales(alpha):
    model = NormThenLinears()
    x = (torch.arange(K) % 4 + 1).float().expand(2, K)
    with torch.no_grad():
        model.proj.weight.copy_((torch.arange(K) % 2 + 1).float().expand(32, K))
        model.gate.weight.fill_(0.1)
    scales = smooth_norm_inputs(model, lambda m: m(x), alpha=alpha, norm_consumers=CONSUMERS)["norm"]
    # alpha 1: the channel maxima (k % 4 + 1); alpha 0: one over the column maxima (k % 2 + 1)
    raw = x[0] if alpha == 1.0 else 1 / (torch.arange(K) % 2 + 1).float()
    expected = raw / math.exp(float(raw.log().mean()))
    torch.testing.assert_close(scales, expected)


def test_a_channel_that_dominates_its_blocks_loses_less_to_nvfp4_after_smoothing():
    torch.manual_seed(0)
    model = NormThenLinears()
    x = torch.randn(256, K)
    x[:, ::16] *= 200  # one channel per block 200x the others: they round to zero beside it
    with torch.no_grad():
        reference = model(x)

    @torch.no_grad()
    def quantized_output_error(m):
        y = m.norm(x)
        yq = nvfp4_fake_quantize_with_amax(y, y.abs().amax())
        out = 0
        for linear in (m.proj, m.gate):
            w = linear.weight.detach()
            wq = fake_quantize_nvfp4(w, per_tensor_amax_to_scale(w.abs().amax()))
            out = out + yq @ wq.T
        return float(((out - reference) ** 2).mean() / (reference ** 2).mean())

    before = quantized_output_error(model)
    smooth_norm_inputs(model, lambda m: m(x), norm_consumers=CONSUMERS)
    torch.testing.assert_close(model(x).detach(), reference, rtol=1e-4, atol=1e-3)
    assert quantized_output_error(model) < 0.5 * before


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "0.5", None, True, torch.tensor(0.5)],
                         ids=["negative", "above-1", "nan", "string", "none", "bool", "tensor"])
def test_bad_alpha_is_refused_and_nothing_changes(alpha):
    """A string or a tensor read as alpha=0.5 in the message, as if out of range."""
    model = tiny_llama()
    before = state(model)
    with pytest.raises(ValueError, match=re.escape(f"alpha={alpha!r} must be a number in [0, 1]")):
        smooth_norm_inputs(model, lambda m: m(token_ids(1)), alpha=alpha)
    assert_same_state(model, before)


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


@pytest.mark.parametrize(
    "norm_consumers, message",
    [
        ({}, "norm_consumers maps each norm's attribute name"),
        ({"input_layernorm": "self_attn.q_proj"}, "norm_consumers maps each norm's attribute name"),
        ({"input_layernorm": ("self_attn.q_proj", "self_attn.q_proj")}, "norm_consumers maps each norm's"),
        ({"input_layernorm": ()}, "norm_consumers maps each norm's attribute name"),
        ({"input_layernorm": ATTENTION, "post_attention_layernorm": ("mlp.gate_prj", "mlp.up_proj")},
         r"'model.layers.0.post_attention_layernorm' has only some of its consumers .* \(missing: \['mlp.gate_prj'\]\)"),
        ({"input_layernorm": ATTENTION, "post_attention_layernorm": ("self_attn.q_proj",)},
         r"'self_attn.q_proj' is named as a consumer of both 'model.layers.0.input_layernorm' and"),
    ],
    ids=["empty", "a string", "a name twice", "no names", "a typo in one group", "one linear in two groups"],
)
def test_norm_consumers_that_do_not_name_each_norms_readers_are_refused_and_nothing_changes(norm_consumers, message):
    model = tiny_llama()
    before = state(model)
    with pytest.raises(ValueError, match=message):
        smooth_norm_inputs(model, lambda m: m(token_ids(1)), norm_consumers=norm_consumers)
    assert_same_state(model, before)


def test_a_model_without_the_named_norms_is_refused():
    model = torch.nn.Sequential(torch.nn.LayerNorm(K), torch.nn.Linear(K, K))
    with pytest.raises(ValueError, match="found no norm with its consumers"):
        smooth_norm_inputs(model, lambda m: m(torch.randn(2, K)))


def test_a_prepared_model_is_refused_naming_the_layer_and_nothing_changes():
    model = prepare(tiny_llama(), filter_fn=all_but_lm_head, weight_scale="max")
    before = state(model)
    with pytest.raises(ValueError, match=r"self_attn.q_proj.*NVFP4StaticObservedLinear.*before step='prepare'"):
        smooth_norm_inputs(model, lambda m: m(token_ids(1)))
    assert_same_state(model, before)


def test_a_norm_without_weight_is_refused():
    model = NormThenLinears()
    model.norm = torch.nn.LayerNorm(K, elementwise_affine=False)
    with pytest.raises(ValueError, match="norm 'norm' has no 1-D weight"):
        smooth_norm_inputs(model, lambda m: m(torch.randn(2, K)), norm_consumers=CONSUMERS)


def test_a_loop_that_runs_nothing_is_refused_and_nothing_changes():
    model = tiny_llama()
    before = state(model)
    with pytest.raises(ValueError, match="model.layers.0.input_layernorm.*saw no input"):
        smooth_norm_inputs(model, lambda m: None)
    assert_same_state(model, before)


def shared(model, case):
    """``model`` (tiny_llama) with a norm module or a q_proj weight its two layers share."""
    first, second = model.model.layers
    if case == "norm":
        second.input_layernorm = first.input_layernorm
    else:
        second.self_attn.q_proj.weight = first.self_attn.q_proj.weight
    return model


@pytest.mark.parametrize("case, places", [
    ("norm", "'model.layers.1.input_layernorm' and 'model.layers.0.input_layernorm'"),
    ("q_proj", "'model.layers.1.self_attn.q_proj' and 'model.layers.0.self_attn.q_proj'"),
])
@pytest.mark.parametrize("how", ["smooth_norm_inputs", "calibrate_layer_by_layer"])
def test_a_weight_two_layers_share_is_refused_before_anything_changes(case, places, how):
    """Folded into twice, a shared norm or tied weight would change what the float model computes."""
    model = shared(tiny_llama(), case)
    before = state(model)
    with pytest.raises(ValueError, match=f"{places} hold one weight"):
        if how == "smooth_norm_inputs":
            smooth_norm_inputs(model, lambda m: m(token_ids(0)))
        else:
            calibrate_layer_by_layer(model, [token_ids(0)], device="cpu", filter_fn=all_but_lm_head, progress=False)
    assert_same_state(model, before)
    assert all(type(m) is not NVFP4StaticLinear for m in model.modules())


def test_batches_without_tokens_are_skipped_and_only_such_batches_are_refused():
    """The float model runs a batch of no tokens, whose norm output has no rows to take an amax of."""
    x, empty = torch.randn(8, K) * torch.linspace(0.5, 4, K), torch.empty(0, K)
    torch.manual_seed(0)
    with_empty = NormThenLinears()
    torch.manual_seed(0)
    plain = NormThenLinears()
    scales = smooth_norm_inputs(with_empty, lambda m: [m(empty), m(x), m(empty.reshape(2, 0, K))],
                                norm_consumers=CONSUMERS)["norm"]
    assert torch.equal(scales, smooth_norm_inputs(plain, lambda m: m(x), norm_consumers=CONSUMERS)["norm"])
    only_empty = NormThenLinears()
    before = state(only_empty)
    with pytest.raises(ValueError, match=r"norms norm saw no input \(or only batches without tokens\)"):
        smooth_norm_inputs(only_empty, lambda m: m(empty), norm_consumers=CONSUMERS)
    assert_same_state(only_empty, before)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_norm_outputs_are_refused_and_nothing_changes(bad):
    model = NormThenLinears()
    before = state(model)
    x = torch.randn(2, K)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="output of norms norm was not finite"):
        smooth_norm_inputs(model, lambda m: m(x), norm_consumers=CONSUMERS)
    assert_same_state(model, before)


def test_an_fp16_model_whose_norm_outputs_reach_subnormals_is_smoothed():
    """Norm weights of 1e-3 put some fp16 outputs under 6e-5, whose rounding the relative check
    read as a norm that does not scale with its weight."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1e-3)
    model = model.half()
    before = {name: norm.weight.clone() for name, norm in model.named_modules() if name.endswith("input_layernorm")}
    with torch.no_grad():
        smooth_norm_inputs(model, lambda m: [m(token_ids(seed)) for seed in range(2)], alpha=0.5)
    changed = [name for name, weight in before.items() if not torch.equal(model.get_submodule(name).weight, weight)]
    assert changed == list(before)


class OnePlusWeightNorm(ChannelScale):
    """Gemma's parametrization: ``x * (1 + weight)``, which dividing the weight does not scale."""

    def forward(self, x):
        return x * (1.0 + self.weight)


@pytest.mark.parametrize("weight", [0.0, 0.5, -0.5], ids=["zero", "positive", "negative"])
def test_a_norm_whose_output_does_not_follow_its_weight_is_refused_and_nothing_changes(weight):
    model = NormThenLinears()
    model.norm = OnePlusWeightNorm(K)
    model.norm.weight.data.fill_(weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loud = torch.ones(8, K)
    loud[:, 0] = 100.0  # one dominant channel: scales far from 1
    with pytest.raises(ValueError, match="'norm' \\(OnePlusWeightNorm\\) does not scale its output"):
        smooth_norm_inputs(model, lambda m: m(loud), norm_consumers={"norm": ("proj", "gate")})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_gemma_norm_is_refused_in_fp16_too(dtype):
    model = NormThenLinears().to(dtype)
    model.norm = OnePlusWeightNorm(K).to(dtype)
    loud = torch.ones(8, K, dtype=dtype)
    loud[:, 0] = 100.0
    with pytest.raises(ValueError, match="'norm' \\(OnePlusWeightNorm\\) does not scale its output"):
        smooth_norm_inputs(model, lambda m: m(loud), norm_consumers={"norm": ("proj", "gate")})


def tiny_model_of(config_class: str):
    """A random two-layer model of ``config_class``, its norms' weights far from 1 (so that
    folding changes what the model computes wherever it does not fold into every reader)."""
    import transformers

    config = getattr(transformers, config_class)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.ndim == 1:
                parameter.mul_(torch.rand_like(parameter) * 3 + 0.1)
    return model


@pytest.mark.parametrize(
    "config_class, norm, problem",
    [("PhiConfig", "input_layernorm", r"\['model.layers.0.mlp.fc1'\] also read its output"),
     ("CohereConfig", "input_layernorm", r"\['model.layers.0.mlp.gate_proj', 'model.layers.0.mlp.up_proj'\] also read"),
     ("Olmo2Config", "post_attention_layernorm", r"\['model.layers.0.mlp.gate_proj', .*\] do not read its output")],
)
def test_a_norm_whose_readers_are_not_the_named_consumers_is_left_as_it_is_with_a_warning(config_class, norm, problem):
    """Phi and Cohere run the MLP beside attention on the same norm's output; OLMo2's
    post-attention norm normalises the attention output, which the MLP does not read."""
    model = tiny_model_of(config_class)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    expected_state = state(model)
    with pytest.warns(UserWarning, match=rf"leaves norm 'model.layers.0.{norm}' as it is: {problem}"):
        scales = smooth_norm_inputs(model, lambda m: m(ids))
    assert torch.equal(scales[f"model.layers.0.{norm}"], torch.ones(64))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert_same_state(model, expected_state)


def test_consumers_naming_only_some_of_a_norms_readers_leave_it_as_it_is():
    model = tiny_llama()
    before = logits(model)
    with pytest.warns(UserWarning, match=r"'model.layers.0.input_layernorm' as it is: \['model.layers.0.self_attn.k_proj', "
                                         r"'model.layers.0.self_attn.v_proj'\] also read its output"):
        smooth_norm_inputs(model, lambda m: m(token_ids(1)), norm_consumers={"input_layernorm": ("self_attn.q_proj",)})
    assert torch.equal(logits(model), before)
