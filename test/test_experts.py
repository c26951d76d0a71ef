"""Mixture-of-experts layers (nvfp4_static/experts/, kernels/grouped_gemm.py): transformers 5.x
fused 3-D experts (Qwen3-MoE, Mixtral) calibrated per expert, converted, run as grouped GEMMs
(compiled without recompiling as routing changes), saved and loaded.

The references are independent of the code under test: each expert's statistics are recomputed
from the tokens the test routed to it, and a converted layer's output is recomputed the way
transformers' eager forward loops over experts, with one ``NVFP4StaticLinear`` per expert.
"""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchao.quantization import quantize_
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from conftest import convert, gpu_tolerance, prepare, relative_error, requires_cuda
from triton_interpreter import run_interpreted
from nvfp4_static import (
    ExpertsLayout,
    NVFP4StaticActivationConfig,
    NVFP4StaticExperts,
    NVFP4StaticLinear,
    NVFP4StaticObservedExperts,
    NVFP4StaticObservedLinear,
    export_checkpoint,
    import_checkpoint,
    is_quantizable,
    load_quantized,
    register_experts,
    tie_fused_layers,
)
from nvfp4_static.clip_monitor import clip_counts, disable_clip_monitor, enable_clip_monitor
from nvfp4_static.diagnostics import format_diagnostics, layer_diagnostics, snr_db
from nvfp4_static.backends.cpu import grouped_static_nvfp4_linear
from nvfp4_static.experts import routing as experts_routing
from nvfp4_static.experts.routing import combine, route
from nvfp4_static.kernels.launch import runs_eagerly
from nvfp4_static.kernels.grouped_gemm import GroupedGemmConfig
from nvfp4_static.numerics import dequantize_nvfp4, fake_quantize_nvfp4, per_tensor_amax_to_scale, quantize_nvfp4
from nvfp4_static.observers.full_hessian import block_diagonal
from nvfp4_static.references import block_hessian, fp8_scale_sweep
from nvfp4_static.tensor import NVFP4StaticTensor


VOCAB = 128
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 8, 2


def qwen3_moe_config(**changes) -> Qwen3MoeConfig:
    settings = dict(
        hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=VOCAB,
    )
    config = Qwen3MoeConfig(**{**settings, **changes})
    config._experts_implementation = "eager"  # the loop over experts our routing reproduces
    return config


def mixtral_config(**changes) -> MixtralConfig:
    settings = dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, vocab_size=VOCAB,
    )
    config = MixtralConfig(**{**settings, **changes})
    config._experts_implementation = "eager"
    return config


ARCHITECTURES = {
    "qwen3_moe": (qwen3_moe_config, Qwen3MoeForCausalLM, Qwen3MoeExperts),
    "mixtral": (mixtral_config, MixtralForCausalLM, MixtralExperts),
}


def tiny_model(architecture: str, seed: int = 0, dtype=torch.float32, **changes):
    config_of, model_class, _ = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    return model_class._from_config(config_of(**changes), dtype=dtype).eval()


def token_ids(seed: int, batch: int = 4, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def quantized_model(architecture: str, tie: bool = False, **config):
    """The tiny model prepared, calibrated on three batches, its fused linears tied if ``tie``
    (as serving needs), and converted with ``config``."""
    model = prepare(tiny_model(architecture), **config)
    with torch.no_grad():
        for seed in range(3):
            model(token_ids(seed))
    if tie:
        tie_fused_layers(model)
    return convert(model, **config)


class Holder(torch.nn.Module):
    """A parent for a standalone experts module, so that ``quantize_`` can replace it."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_index, top_k_weights)


def standalone_experts(architecture: str = "qwen3_moe", seed: int = 0, **changes) -> Holder:
    """One random-weight experts module of ``architecture``, as its model builds it."""
    config_of, _, experts_class = ARCHITECTURES[architecture]
    experts = experts_class(config_of(**changes))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            # Each expert its own magnitude, so that per-expert global scales differ.
            gains = torch.rand(weight.shape[0], 1, 1, generator=generator) + 0.25
            weight.copy_(torch.randn(weight.shape, generator=generator) * gains * 0.1)
    return Holder(experts)


def routed_batch(tokens: int, seed: int, experts=None, num_experts: int = EXPERTS):
    """``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``; each token picks
    ``TOP_K`` distinct experts among ``experts`` (default all), at random."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.tensor(experts if experts is not None else range(num_experts))
    picks = torch.stack([torch.randperm(len(choices), generator=generator)[:TOP_K] for _ in range(tokens)])
    hidden = torch.randn(tokens, HIDDEN, generator=generator) * (1 + torch.arange(tokens)[:, None] % 5)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1)
    return hidden, choices[picks], weights


def calibrated_experts(batches, architecture="qwen3_moe", **config) -> Holder:
    holder = prepare(standalone_experts(architecture), **config)
    with torch.no_grad():
        for batch in batches:
            holder.experts(*batch)
    return holder


def per_expert_linear(grouped, expert: int) -> NVFP4StaticLinear:
    """Expert ``expert``'s weights of a converted grouped linear, as an ``NVFP4StaticLinear``."""
    weight = NVFP4StaticTensor(
        grouped.qdata[expert], grouped.scale[expert], 16, torch.float32,
        grouped.per_tensor_scale[expert], grouped.act_per_tensor_scale[expert],
    )
    return NVFP4StaticLinear(weight, None, {"act_calibration": "b_min", "weight_scale": "mse"})


def loop_over_experts(experts: NVFP4StaticExperts, hidden, top_k_index, top_k_weights):
    """transformers' eager experts forward with each expert's GEMMs an ``NVFP4StaticLinear``."""
    out = torch.zeros_like(hidden)
    for expert in range(experts.num_experts):
        top_k_pos, token_idx = torch.where((top_k_index == expert).t())
        if len(token_idx) == 0:
            continue
        gate, up = per_expert_linear(experts.gate_up_proj, expert)(hidden[token_idx]).chunk(2, dim=-1)
        rows = per_expert_linear(experts.down_proj, expert)(experts.act_fn(gate) * up)
        out.index_add_(0, token_idx, (rows * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
    return out


# --- selection and the registry ---------------------------------------------------------------


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_is_quantizable_selects_registered_experts_and_not_their_subclasses(architecture):
    experts = standalone_experts(architecture).experts

    class Subclass(type(experts)):
        pass

    assert is_quantizable(experts, "experts")
    assert not is_quantizable(Subclass.__new__(Subclass), "subclass")  # its forward may differ
    assert not is_quantizable(torch.nn.ReLU(), "relu")


class MyExperts(torch.nn.Module):
    """Another architecture's experts under other names, with transformers' eager forward."""

    def __init__(self, source):
        super().__init__()
        self.w13 = source.gate_up_proj
        self.w2 = source.down_proj
        self.activation = source.act_fn
        self.source = source

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.source(hidden_states, top_k_index, top_k_weights)


def test_a_registered_architecture_is_calibrated_under_its_own_names():
    float_experts = standalone_experts().experts
    register_experts(MyExperts, ExpertsLayout(gate_up="w13", down="w2", act_fn="activation"))
    holder = prepare(Holder(MyExperts(float_experts)), act_calibration="max")
    batch = routed_batch(12, seed=0)
    with torch.no_grad():
        assert torch.equal(holder.experts(*batch), float_experts(*batch))
    assert sum(holder.experts.tokens_per_expert) == 12 * TOP_K


def test_register_experts_refuses_what_is_not_a_layout():
    with pytest.raises(TypeError, match="ExpertsLayout"):
        register_experts(MyExperts, {"gate_up": "w13"})


@pytest.mark.parametrize(
    "experts_class, error, message",
    [
        (123, TypeError, "takes an nn.Module class or its qualified name"),
        (None, TypeError, "takes an nn.Module class or its qualified name"),
        (MyExperts.__init__, TypeError, "takes an nn.Module class or its qualified name"),
        ("MyExperts", TypeError, "takes an nn.Module class or its qualified name"),
        (torch.nn.Linear, ValueError, "is a linear .* quantized as a linear"),
        ("torch.nn.modules.linear.Linear", ValueError, "is a linear .* quantized as a linear"),
        (NVFP4StaticObservedLinear, ValueError, "is a linear .* quantized as a linear"),
        (NVFP4StaticLinear, ValueError, "is a linear .* quantized as a linear"),
        (f"{NVFP4StaticLinear.__module__}.{NVFP4StaticLinear.__qualname__}", ValueError, "is a linear .* quantized as"),
        (f"{NVFP4StaticObservedLinear.__module__}.{NVFP4StaticObservedLinear.__qualname__}", ValueError,
         "is a linear .* quantized as"),
    ],
    ids=["int", "none", "function", "unqualified name", "linear class", "linear name", "observed linear",
         "converted linear", "converted linear name", "observed linear name"],
)
def test_register_experts_refuses_what_is_not_an_experts_class(experts_class, error, message):
    with pytest.raises(error, match=message):
        register_experts(experts_class, ExpertsLayout())


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(checkpoint_names=("a", "a", "b")), ValueError, r"three different names.*\('a', 'a', 'b'\)"),
        (dict(checkpoint_names=("w1", "w2")), ValueError, "three different names"),
        (dict(checkpoint_names=["w1", "w3", "w2"]), ValueError, "three different names"),
        (dict(checkpoint_names=("w1", "", "w2")), ValueError, "three different names"),
        (dict(gate_up=5), TypeError, r"ExpertsLayout.gate_up is an attribute name, got 5"),
        (dict(act_fn=None), TypeError, r"ExpertsLayout.act_fn is an attribute name, got None"),
        (dict(router=""), TypeError, r"ExpertsLayout.router is an attribute name, got ''"),
        (dict(gate_up="w", down="w"), ValueError, r"four different attributes .*'gate_up': 'w', 'down': 'w'"),
        (dict(act_fn="gate"), ValueError, r"four different attributes"),
    ],
    ids=["duplicate names", "two names", "a list", "an empty name", "int attribute", "none act_fn", "empty router",
         "one weight for both projections", "act_fn named as the router"],
)
def test_an_experts_layout_that_names_its_parts_ambiguously_is_refused(fields, error, message):
    with pytest.raises(error, match=message):
        ExpertsLayout(**fields)


# --- prepare and calibration -------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prepared_model_computes_the_float_eager_output_bit_for_bit(architecture):
    model = tiny_model(architecture)
    ids = token_ids(1)
    with torch.no_grad():
        expected = model(ids).logits
        prepare(model)
        assert isinstance(model.model.layers[0].mlp.experts, NVFP4StaticObservedExperts)
        assert torch.equal(model(ids).logits, expected)


def test_each_expert_observes_only_the_tokens_routed_to_it():
    holder = standalone_experts()
    float_experts = holder.experts
    gate_up = float_experts.gate_up_proj.detach().clone()
    batches = [routed_batch(20, seed) for seed in range(3)]
    calibrated = calibrated_experts(batches, act_calibration="max", weight_scale="hessian_mse").experts
    for expert in range(EXPERTS):
        # Each batch's rows of this expert in transformers' order (by slot, then token), its
        # down-projection inputs, and the Hessians summed batch by batch as the accumulator does.
        xs = [hidden[torch.where((index == expert).t())[1]] for hidden, index, _ in batches]
        hs = []
        for x in xs:
            gate, up = torch.nn.functional.linear(x, gate_up[expert]).chunk(2, dim=-1)
            hs.append(float_experts.act_fn(gate) * up)
        gate_up_linear, down_linear = calibrated.gate_up_proj[expert], calibrated.down_proj[expert]
        assert calibrated.tokens_per_expert[expert] == sum(len(x) for x in xs)
        assert torch.equal(gate_up_linear.act_calibrator.compute_amax(), torch.cat(xs).abs().amax())
        assert torch.equal(down_linear.act_calibrator.compute_amax(), torch.cat(hs).abs().amax())
        assert torch.equal(gate_up_linear.hessian_accumulator.hessian, sum(block_hessian(x) for x in xs if len(x)))
        assert torch.equal(down_linear.hessian_accumulator.hessian, sum(block_hessian(h) for h in hs if len(h)))
    all_hidden = torch.cat([hidden for hidden, _, _ in batches])
    assert torch.equal(calibrated.pooled_gate_up_calibrator.compute_amax(), all_hidden.abs().amax())


@pytest.mark.parametrize(
    "bad_hidden",
    [lambda h: torch.cat([h, h], dim=-1), lambda h: h[:, :32], lambda h: h.to(torch.bfloat16)],
    ids=["wider", "narrower", "bf16"],
)
def test_a_batch_the_experts_would_refuse_leaves_every_statistic_as_it_was(bad_hidden):
    holder = calibrated_experts([routed_batch(20, 0)], act_calibration="max", weight_scale="hessian_mse")
    experts = holder.experts
    before = copy.deepcopy(
        (experts.pooled_gate_up_calibrator.state_dict(), experts.pooled_down_calibrator.state_dict(),
         list(experts.tokens_per_expert), [linear.hessian_accumulator.hessian for linear in experts.gate_up_proj])
    )
    hidden, index, weights = routed_batch(20, 1)
    bad = bad_hidden(hidden * 50)
    with pytest.raises(ValueError, match=rf"gate_up_proj.0' takes inputs of {HIDDEN} features.*not observed"):
        experts(bad, index, weights)
    after = (experts.pooled_gate_up_calibrator.state_dict(), experts.pooled_down_calibrator.state_dict(),
             list(experts.tokens_per_expert), [linear.hessian_accumulator.hessian for linear in experts.gate_up_proj])
    for state_before, state_after in zip(before[:2], after[:2], strict=True):
        assert all(torch.equal(state_before[key], state_after[key]) for key in state_before)
    assert before[2] == after[2]
    assert all(torch.equal(b, a) for b, a in zip(before[3], after[3], strict=True))


@pytest.mark.parametrize("step", ["prepare", "prepare_for_loading"])
def test_a_bare_experts_module_handed_to_quantize_is_refused_telling_to_wrap_it(step):
    experts = standalone_experts().experts
    with pytest.raises(ValueError, match=rf"the model given to quantize_ is itself a {type(experts).__name__}.*wrap it"):
        quantize_(experts, NVFP4StaticActivationConfig(step=step), filter_fn=is_quantizable)
    assert type(experts) is ARCHITECTURES["qwen3_moe"][2]


BAD_ROUTINGS = {
    "float index": lambda h, i, w: (h, i.float(), w),
    "bool index": lambda h, i, w: (h, i > 3, w),
    "uint8 index": lambda h, i, w: (h, i.to(torch.uint8), w),  # -1 wraps to 255: every slot to no expert
    "uint32 index": lambda h, i, w: (h, i.to(torch.uint32), w),
    "weights transposed": lambda h, i, w: (h, i, w.t().contiguous()),
    "one weight per token": lambda h, i, w: (h, i, w[:, :1]),
    "1-d weights": lambda h, i, w: (h, i, w[:, 0]),
    "integer weights": lambda h, i, w: (h, i, (w * 10).long()),
    "fewer index rows": lambda h, i, w: (h, i[:-1], w[:-1]),
    "more index rows": lambda h, i, w: (h[:-1], i, w),
    "3-d hidden states": lambda h, i, w: (h[None], i[None], w[None]),
}


@pytest.mark.parametrize("bad", BAD_ROUTINGS.values(), ids=BAD_ROUTINGS.keys())
@pytest.mark.parametrize("state", ["observed", "converted"])
def test_routing_that_does_not_describe_each_tokens_experts_is_refused(bad, state):
    holder = calibrated_experts([routed_batch(96, seed) for seed in range(2)], act_calibration="max", weight_scale="mse")
    if state == "converted":
        convert(holder, act_calibration="max", weight_scale="mse")
    else:
        before = copy.deepcopy((holder.experts.pooled_gate_up_calibrator.state_dict(),
                                list(holder.experts.tokens_per_expert)))
    with pytest.raises(ValueError, match=r"take hidden_states \[tokens, hidden\], a signed integer top_k_index"):
        holder.experts(*bad(*routed_batch(6, seed=3)))
    if state == "observed":
        state_after = holder.experts.pooled_gate_up_calibrator.state_dict()
        assert all(torch.equal(before[0][key], state_after[key]) for key in before[0])
        assert before[1] == list(holder.experts.tokens_per_expert)


@pytest.mark.parametrize("bad", [lambda h: h.double(), lambda h: h.int(), lambda h: h[:, :32]],
                         ids=["float64", "int32", "narrower"])
def test_hidden_states_the_converted_experts_cannot_take_are_refused_naming_them(bad):
    """The error came from one expert's GEMM, with that expert's rows' shape."""
    holder = calibrated_experts([routed_batch(96, seed) for seed in range(2)], act_calibration="max", weight_scale="mse")
    convert(holder, act_calibration="max", weight_scale="mse")
    hidden, index, weights = routed_batch(10, seed=3)
    bad_hidden = bad(hidden)
    with pytest.raises(ValueError, match=rf"experts 'experts' take hidden states of size {HIDDEN} in float32, "
                                         rf"bfloat16 or float16, got shape \({bad_hidden.shape[0]}, "
                                         rf"{bad_hidden.shape[1]}\) in {bad_hidden.dtype}"):
        holder.experts(bad_hidden, index, weights)


ROUTINGS_ON_META = {
    "hidden states": (lambda h, i, w: (h.to("meta"), i, w), "hidden_states on meta"),
    "index": (lambda h, i, w: (h, i.to("meta"), w), "top_k_index on meta"),
    "weights": (lambda h, i, w: (h, i, w.to("meta")), "top_k_weights on meta"),
    "all three": (lambda h, i, w: (h.to("meta"), i.to("meta"), w.to("meta")),
                  "hidden_states on meta, top_k_index on meta, top_k_weights on meta"),
}


@pytest.mark.parametrize("move, named", ROUTINGS_ON_META.values(), ids=ROUTINGS_ON_META.keys())
@pytest.mark.parametrize("state", ["observed", "converted"])
def test_experts_refuse_inputs_on_another_device_than_their_weights(move, named, state):
    """Taken as they were, torch stopped inside the routing with "Tensor on device cpu is not on
    the expected device meta!", no layer named; calibration must not have seen the batch."""
    holder = calibrated_experts([routed_batch(32, seed) for seed in range(2)], act_calibration="max", weight_scale="mse")
    if state == "converted":
        convert(holder, act_calibration="max", weight_scale="mse")
    else:
        before = list(holder.experts.tokens_per_expert)
    with pytest.raises(ValueError, match=rf"experts '.*experts' hold their weights on cpu, but got {named}; move"):
        holder.experts(*move(*routed_batch(6, seed=3)))
    if state == "observed":
        assert before == list(holder.experts.tokens_per_expert)


@pytest.mark.parametrize("index", [-1, EXPERTS + 1, 1000], ids=["negative", "past no-expert", "far"])
def test_calibration_refuses_an_expert_index_outside_the_experts_and_the_no_expert_index(index):
    holder = calibrated_experts([routed_batch(20, 0)], act_calibration="max", weight_scale="hessian_mse")
    experts = holder.experts
    before = copy.deepcopy((experts.pooled_gate_up_calibrator.state_dict(), list(experts.tokens_per_expert)))
    hidden, top_k_index, weights = routed_batch(6, seed=3)
    top_k_index[2, 1] = index
    with pytest.raises(ValueError, match=rf"top_k_index holds 1 expert indices outside 0..{EXPERTS} \(first: {index}\)"):
        experts(hidden, top_k_index, weights)
    state_after = experts.pooled_gate_up_calibrator.state_dict()
    assert all(torch.equal(before[0][key], state_after[key]) for key in before[0])
    assert before[1] == list(experts.tokens_per_expert)
    top_k_index[2, 1] = EXPERTS  # transformers' index for "no expert" is taken
    experts(hidden, top_k_index, weights)
    assert sum(experts.tokens_per_expert) == sum(before[1]) + 6 * TOP_K - 1


# --- convert -----------------------------------------------------------------------------------


def test_convert_gives_each_expert_its_own_scales_by_the_linear_recipe():
    batches = [routed_batch(96, seed) for seed in range(2)]
    holder = calibrated_experts(batches, act_calibration="max", weight_scale="mse")
    assert min(holder.experts.tokens_per_expert) >= 16  # no expert takes the pooled statistics
    gate_up = holder.experts.gate_up_proj
    float_gate_up = torch.stack([linear.weight.detach() for linear in gate_up]).clone()
    convert(holder, act_calibration="max", weight_scale="mse")
    experts = holder.experts
    assert isinstance(experts, NVFP4StaticExperts)
    hidden, index = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    for expert in range(EXPERTS):
        x = hidden[(index == expert).any(dim=1)]
        assert torch.equal(experts.gate_up_proj.act_global_amax[expert], per_tensor_amax_to_scale(x.abs().amax()) * 448 * 6)
        # gate and up: one weight global amax over the expert's whole [2I, H] slice
        weight_amax = float_gate_up[expert].abs().amax()
        assert torch.equal(experts.gate_up_proj.per_tensor_scale[expert], per_tensor_amax_to_scale(weight_amax))
        block_scales = fp8_scale_sweep(float_gate_up[expert], weight_amax)
        assert torch.equal(experts.gate_up_proj.scale[expert].view(torch.uint8), block_scales.view(torch.uint8))
        qdata, _ = quantize_nvfp4(float_gate_up[expert], per_tensor_amax_to_scale(weight_amax), block_scales)
        assert torch.equal(experts.gate_up_proj.qdata[expert], qdata)
    assert len(set(experts.gate_up_proj.act_per_tensor_scale.tolist())) > 1
    assert experts.calibration_stats["pooled_experts"] == []


@pytest.mark.parametrize("prepared_for", ["hessian_mse", "gptq"])  # per-block, or whole Hessians
def test_experts_without_enough_tokens_take_the_pooled_statistics_with_one_warning(prepared_for):
    # Experts 0-5 only, then one batch in which expert 6 gets a few tokens; expert 7 none.
    batches = [routed_batch(64, seed, experts=range(6)) for seed in range(2)]
    few = routed_batch(4, seed=7, experts=[5, 6])
    holder = calibrated_experts([*batches, few], weight_scale=prepared_for, act_calibration="max")
    observed = holder.experts
    assert observed.tokens_per_expert[6:] == [4, 0]
    pooled_hessian = sum(linear.hessian_accumulator.hessian for linear in observed.gate_up_proj
                         if linear.hessian_accumulator._state is not None)
    if prepared_for == "gptq":  # the hessian_mse sweep reads a whole Hessian's diagonal blocks
        pooled_hessian = block_diagonal(pooled_hessian)
    weight = observed.gate_up_proj[7].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"layer 'experts': experts 6, 7 saw fewer than 16 calibration tokens \(4, 0\)"):
        convert(holder, weight_scale="hessian_mse", act_calibration="max")
    experts = holder.experts
    all_hidden = torch.cat([b[0] for b in [*batches, few]])
    pooled_amax = per_tensor_amax_to_scale(all_hidden.abs().amax()) * 448 * 6
    assert torch.equal(experts.gate_up_proj.act_global_amax[6:], pooled_amax.expand(2))
    expected_scales = fp8_scale_sweep(weight, weight.abs().amax(), pooled_hessian)
    assert torch.equal(experts.gate_up_proj.scale[7].view(torch.uint8), expected_scales.view(torch.uint8))
    assert experts.calibration_stats["pooled_experts"] == [6, 7]
    own = observed.gate_up_proj[7]
    assert own.act_calibrator is not observed.pooled_gate_up_calibrator  # given back


def test_a_layer_that_saw_no_tokens_is_refused_naming_it():
    holder = calibrated_experts([])
    with pytest.raises(RuntimeError, match="experts 'experts'.*no calibration data"):
        convert(holder)


# --- inference ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_holder():
    return convert(calibrated_experts([routed_batch(48, seed) for seed in range(2)]))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prepare_for_loading_refuses_prepared_experts_as_they_were_and_keeps_converted_ones(architecture, converted_holder):
    loading = NVFP4StaticActivationConfig(step="prepare_for_loading")
    holder = calibrated_experts([routed_batch(8, 0)], architecture)
    prepared = holder.experts
    with pytest.raises(ValueError, match=r"layer 'experts' is NVFP4StaticObservedExperts, prepared for calibration; "
                       r"step='prepare_for_loading' makes empty converted layers .* load the float model again"):
        quantize_(holder, loading, filter_fn=is_quantizable)
    assert holder.experts is prepared and sum(prepared.tokens_per_expert) == 8 * TOP_K  # its statistics kept
    converted = converted_holder.experts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_(converted_holder, loading, filter_fn=is_quantizable)
    assert converted_holder.experts is converted


ROUTINGS = {
    "spread": dict(),
    "some experts idle": dict(experts=[1, 4, 6]),
    "two experts take all": dict(experts=[3, 5]),
}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_converted_experts_equal_a_loop_of_per_expert_nvfp4_linears(converted_holder, routing):
    experts = converted_holder.experts
    batch = routed_batch(10, seed=11, **ROUTINGS[routing])
    with torch.no_grad():
        assert torch.equal(experts(*batch), loop_over_experts(experts, *batch))


def test_all_tokens_to_one_expert_and_tokens_routed_nowhere(converted_holder):
    experts = converted_holder.experts
    hidden, _, weights = routed_batch(6, seed=3)
    one_expert = torch.tensor([[2, EXPERTS]] * 6)  # EXPERTS: transformers' index for "no expert"
    with torch.no_grad():
        out = experts(hidden, one_expert, weights)
        assert torch.equal(out, loop_over_experts(experts, hidden, one_expert, weights))
        expected = per_expert_linear(experts.down_proj, 2)
        gate, up = per_expert_linear(experts.gate_up_proj, 2)(hidden).chunk(2, dim=-1)
        assert torch.equal(out, expected(experts.act_fn(gate) * up) * weights[:, :1])
        assert torch.equal(experts(hidden[:0], one_expert[:0], weights[:0]), hidden[:0])


@pytest.mark.parametrize("index", [-1, -100, EXPERTS + 1, 1000], ids=["negative", "far negative", "past no-expert", "far"])
def test_converted_experts_on_a_cpu_refuse_an_index_outside_the_experts_and_the_no_expert_index(converted_holder, index):
    """Taken as it was, the slot went to no expert (as transformers' no-expert index does),
    where transformers' one_hot refuses it."""
    hidden, top_k_index, weights = routed_batch(6, seed=3)
    top_k_index[4, 0] = index
    with pytest.raises(ValueError, match=rf"experts '.*experts': top_k_index holds 1 expert indices outside "
                                         rf"0..{EXPERTS} \(first: {index}\); {EXPERTS} routes a slot to no expert$"):
        converted_holder.experts(hidden, top_k_index, weights)


@pytest.mark.parametrize("indices", [[-1], [-100, EXPERTS + 1], [EXPERTS + 1, 1000, -2, -1], []], ids=str)
def test_routing_counts_the_pairs_whose_index_is_an_expert_or_the_no_expert_index(indices):
    """Each pair in ``indices`` replaces one routed pair; the no-expert index ``EXPERTS`` counts as
    in range, and the rows of every pair outside it still go to no expert."""
    _, top_k_index, _ = routed_batch(6, seed=3)
    top_k_index[0, 1] = EXPERTS
    for pair, index in enumerate(indices):
        top_k_index[1 + pair, 0] = index
    routing = route(top_k_index, EXPERTS)
    assert routing.pairs_in_range.tolist() == [top_k_index.numel() - len(indices)]
    assert routing.expert_offsets.shape == (EXPERTS + 1,)
    assert int(routing.expert_offsets[-1]) == top_k_index.numel() - len(indices) - 1


@pytest.mark.parametrize(
    "filter_fn",
    [None, lambda module, fqn: isinstance(module, torch.nn.Linear)],
    ids=["torchao's default filter", "a filter of its own"],
)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_filter_that_reaches_one_experts_linear_alone_is_refused_and_a_rerun_finishes(architecture, filter_fn):
    """A filter that selects ``nn.Linear`` alone walks into prepared experts and reaches their
    per-expert linears, which the experts convert together: refused there, naming both, with
    those experts as they were; convert with ``is_quantizable`` then finishes the model."""
    model = prepare(tiny_model(architecture))
    with torch.no_grad():
        model(token_ids(0))
    with pytest.raises(
        ValueError,
        match=r"layer 'model\.layers\.0\.mlp\.experts\.gate_up_proj\.0' is one expert's linear of "
        r"experts 'model\.layers\.0\.mlp\.experts', which step='convert' takes as one module: run it "
        r"with the filter_fn prepare ran with \(is_quantizable",
    ):
        quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=filter_fn)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts, NVFP4StaticObservedExperts)
        assert all(type(linear) is NVFP4StaticObservedLinear for linear in layer.mlp.experts.gate_up_proj)
    convert(model)
    reference = prepare(tiny_model(architecture))
    with torch.no_grad():
        reference(token_ids(0))
    convert(reference)
    with torch.no_grad():
        assert torch.equal(model(token_ids(8)).logits, reference(token_ids(8)).logits)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_converted_model_stays_close_to_the_float_model(architecture):
    ids = token_ids(9)
    model = quantized_model(architecture, weight_scale="max")
    with torch.no_grad():
        expected = tiny_model(architecture)(ids).logits
        out = model(ids).logits
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4StaticExperts)
    # W4A4 on every linear and expert of a random two-layer model: about 0.2 relative error
    # (the bound leaves room); a broken routing or scale gives order 1.
    assert relative_error(out, expected) < 0.35


def test_compiled_experts_serve_every_routing_without_recompiling(converted_holder):
    experts = converted_holder.experts
    compiled = torch.compile(experts, fullgraph=True)
    batches = [routed_batch(10, seed=1), routed_batch(10, seed=2, experts=[0, 7]),
               routed_batch(10, seed=3, experts=[4, 5])]
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            assert torch.equal(compiled(*batch), experts(*batch))


def graph_ops(run, *inputs) -> set:
    """The ``nvfp4_static`` ops in the graph dynamo traces of ``run(*inputs)``."""
    names = set()

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "nvfp4_static" in str(node.target):
                names.add(str(node.target).split(".")[-2])
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(run, backend=backend, fullgraph=True)(*inputs)
    return names


def test_routing_read_from_the_eager_kernels_buffer_equals_the_torch_ops_routing():
    """The route kernel writes its four outputs into one buffer for an eager call
    (``routing_in`` reads it) and into four tensors for the op (``routing_of``)."""
    index = routed_batch(7, seed=5)[1]
    index[0, 0], index[3, 1] = EXPERTS, -2  # no expert, and an index outside 0..E
    parts = experts_routing.routing_by_torch_ops(index, EXPERTS)
    expected = experts_routing.routing_of(parts, 7, EXPERTS)
    read = experts_routing.routing_in(torch.cat(parts), 7, EXPERTS)
    for field in ("pair_of_row", "expert_offsets", "pairs_in_range", "row_of_pair", "token_of_row"):
        assert torch.equal(getattr(read, field), getattr(expected, field)), field
    assert read.pairs_in_range.tolist() == [index.numel() - 1] and expected.expert_offsets.storage_offset() == 0


def test_traced_experts_route_and_combine_through_their_ops(converted_holder, monkeypatch):
    """A traced forward on CUDA reaches the routing kernels as two opaque ops; forced on the
    CPU (where the ops' kernels are the torch ops) the graph holds them and gives the eager
    output."""
    monkeypatch.setattr(experts_routing, "traced_on_cuda", lambda *tensors: not runs_eagerly(*tensors))
    monkeypatch.setattr(experts_routing, "combined_by_kernel", lambda rows, *rest: not runs_eagerly(rows))
    experts = converted_holder.experts
    batch = routed_batch(9, seed=6, experts=[0, 3, 5])
    assert {"route_experts", "combine_experts"} <= graph_ops(experts, *batch)
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(compiled(*batch), experts(*batch))


def test_model_to_another_dtype_keeps_the_nvfp4_data(converted_holder):
    holder = Holder(converted_holder.experts)
    buffers = {name: b.clone() for name, b in holder.named_buffers()}
    holder.to(torch.bfloat16)
    for name, buffer in holder.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer.view(torch.uint8), buffers[name].view(torch.uint8))
    batch = routed_batch(5, seed=4)
    with torch.no_grad():
        out = holder.experts(batch[0].bfloat16(), batch[1], batch[2].bfloat16())
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad_from", ["hidden states", "routing weights"])
def test_backward_through_converted_experts_names_the_problem(converted_holder, grad_from, compiled, monkeypatch):
    """Compiled too: the forward runs and gives what it gives without gradients; the backward,
    not the compile, raises."""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    experts = converted_holder.experts
    run = torch.compile(experts, fullgraph=True) if compiled else experts
    hidden, index, weights = routed_batch(4, seed=5)
    with torch.no_grad():
        expected = run(hidden, index, weights)
    wanting = hidden if grad_from == "hidden states" else weights
    wanting.requires_grad_()
    out = run(hidden, index, weights)
    assert out.requires_grad and torch.equal(out.detach(), expected)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
    assert wanting.grad is None


# --- the grouped GEMM kernel -------------------------------------------------------------------


def grouped_operands(counts, N, K, seed, tail=2):
    """Rows sorted by expert (``counts`` each, then ``tail`` rows routed nowhere) and ``E`` packed
    ``[N, K]`` weights, each with its own global scales, in the op's argument order."""
    generator = torch.Generator().manual_seed(seed)
    E = len(counts)
    rows = sum(counts) + tail
    gains = torch.exp2(torch.randint(-6, 4, (rows, K // 16, 1), generator=generator).float())  # block scales differ
    x = (torch.randn(rows, K // 16, 16, generator=generator) * gains).reshape(rows, K)
    weights = torch.randn(E, N, K, generator=generator) * (torch.rand(E, N, 1, generator=generator) + 0.1)
    weight_scales = torch.stack([per_tensor_amax_to_scale(w.abs().amax()) for w in weights])
    packed = [quantize_nvfp4(w, s) for w, s in zip(weights, weight_scales)]
    act_scales = torch.stack([per_tensor_amax_to_scale(x.abs().amax() * (0.5 + e)) for e in range(E)])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    return (x, offsets, torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]), weight_scales, act_scales)


# Tiny tiles so that the interpreter sees several row tiles per expert, a ragged K (48 with 32-wide
# K tiles), a ragged N, experts with no rows, tiles of one row, and transposed tiles.
KERNEL_CASES = {
    "16x16x32-ragged": ((5, 0, 19, 1), 40, 48, GroupedGemmConfig(16, 16, 32, 4, 1)),
    "16x32x64-one-expert": ((0, 0, 33), 32, 64, GroupedGemmConfig(16, 32, 64, 4, 1)),
    "32x16x32-single-rows": ((1, 1, 1, 1, 1), 16, 32, GroupedGemmConfig(32, 16, 32, 4, 1)),
    "16x32x32-transposed": ((3, 17, 0, 2), 48, 64, GroupedGemmConfig(16, 32, 32, 4, 1, weight_as_mma_a=True)),
}
LAUNCHER = "nvfp4_static.kernels.grouped_gemm:launch_grouped_nvfp4_gemm"
QUANTIZE_LAUNCHER = "nvfp4_static.kernels.grouped_gemm:launch_routed_rows_quantize"


def gathered(operands, seed):
    """The operands with ``x`` replaced by a shuffled ``x`` with spare rows, and the index
    ``source_rows`` that reads the original rows back out of it."""
    x = operands[0]
    generator = torch.Generator().manual_seed(seed)
    source = torch.cat((x, torch.randn(3, x.shape[1], generator=generator).to(x.dtype)))
    order = torch.randperm(len(source), generator=generator)
    source_rows = torch.argsort(order)[: len(x)]
    return (source[order], *operands[1:]), source_rows


@pytest.fixture(scope="module")
def interpreted_grouped_gemms():
    launches, operands = {}, {}
    for index, (name, (counts, N, K, config)) in enumerate(KERNEL_CASES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            case = f"{name}-{dtype}"
            args = list(grouped_operands(counts, N, K, seed=index))
            args[0] = args[0].to(dtype)
            operands[case] = args
            out = torch.full((args[0].shape[0], N), float("nan"), dtype=dtype)
            launches[case] = (LAUNCHER, (*args, out, config))
        # The same rows read through source_rows, from a shuffled x with rows no row reads.
        shuffled, source_rows = gathered(operands[f"{name}-{torch.float32}"], seed=index)
        out = torch.full((len(source_rows), N), float("nan"))
        launches[f"{name}-gathered"] = (LAUNCHER, (*shuffled, out, config, source_rows))
        operands[f"{name}-gathered"] = operands[f"{name}-{torch.float32}"]
    results = run_interpreted(launches)
    return {case: (operands[case], results[case].args[6]) for case in launches}


@pytest.mark.parametrize(
    "case", [f"{n}-{d}" for n in KERNEL_CASES for d in (torch.float32, torch.bfloat16, "gathered")]
)
def test_interpreted_grouped_gemm_equals_the_per_expert_torch_reference(interpreted_grouped_gemms, case):
    operands, out = interpreted_grouped_gemms[case]
    routed = int(operands[1][-1])
    expected = grouped_static_nvfp4_linear(*operands)[:routed]
    # Both sum exact products in fp32 (only the order differs) and round once to the output dtype.
    tolerance = gpu_tolerance(operands[0].shape[1], out.dtype)
    assert relative_error(out[:routed], expected) <= tolerance
    assert out[routed:].isnan().all()  # rows routed nowhere are not written


# Routings for the route and combine kernels: (tokens, top_k, experts, indices put in, index dtype,
# layout): the no-expert index and indices outside 0..E among them, one token, no token, a
# transposed (non-contiguous) top_k_index, more pairs than one block of the kernel's count.
ROUTE_CASES = {
    "spread": (10, 2, EXPERTS, [], torch.int64, "contiguous"),
    "no-expert-and-outside": (7, 3, 5, [5, -1, 6, 1000, -100], torch.int64, "contiguous"),
    "one-token-int32": (1, 8, 128, [128], torch.int32, "contiguous"),
    "transposed": (9, 4, 6, [-2, 6], torch.int64, "transposed"),
    "two-blocks-all-to-one": (50, 2, 3, [1] * 60, torch.int64, "contiguous"),
    "no-token": (0, 2, 4, [], torch.int64, "contiguous"),
    "ragged-chunks-transposed": (300, 4, 16, [16, 17, -5] * 20, torch.int32, "transposed"),
    "many-chunks": (1100, 8, 128, [128, 129, -1] * 40 + [3] * 300, torch.int64, "contiguous"),
    "three-hundred-experts": (90, 8, 300, [300, 299, 0, 301] * 5, torch.int32, "contiguous"),
}
# Cases for the route only: the weighted sum does not depend on the experts' count, and its
# interpreted programs for 1100 tokens would take minutes.
ROUTED_ONLY = {"many-chunks", "three-hundred-experts"}
ROUTE_LAUNCHER = "nvfp4_static.kernels.expert_routing:launch_route"
ROUTE_IN_CHUNKS_LAUNCHER = "test_experts:route_in_chunks"
COMBINE_LAUNCHER = "nvfp4_static.kernels.expert_routing:launch_combine"


def route_in_chunks(*args):
    """``launch_route`` routing every count of pairs but none in chunks (in the interpreted
    child), where the launcher would sort the smaller counts in one program."""
    from unittest import mock

    from nvfp4_static.kernels import expert_routing

    with mock.patch.object(expert_routing, "SORTED_IN_ONE_PROGRAM", 0):
        expert_routing.launch_route(*args)


def routing_case(tokens, top_k, experts, put_in, dtype, layout, seed):
    """``top_k_index [tokens, top_k]``: random experts with ``put_in`` written over its first
    pairs (token-major), as ``dtype``, contiguous or a transposed view."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, experts, (tokens, top_k), generator=generator)
    index.view(-1)[: len(put_in)] = torch.tensor(put_in, dtype=torch.int64)
    index = index.to(dtype)
    return index.t().contiguous().t() if layout == "transposed" else index


@pytest.fixture(scope="module")
def interpreted_routes_and_sums():
    """Each routing through the route kernel, and the torch ops' routing of it summed by the
    combine kernel in several dtypes (bf16 rows with fp32 weights too), with NaN in the rows
    routed nowhere."""
    launches, inputs = {}, {}
    for seed, (name, (tokens, top_k, experts, put_in, dtype, layout)) in enumerate(ROUTE_CASES.items()):
        index = routing_case(tokens, top_k, experts, put_in, dtype, layout, seed)
        pairs = index.numel()
        for case, launcher in ((f"route-{name}", ROUTE_LAUNCHER), (f"route-{name}-in-chunks", ROUTE_IN_CHUNKS_LAUNCHER)):
            outputs = (*(torch.full((pairs,), -7) for _ in range(3)), torch.full((experts + 2,), -7))
            launches[case] = (launcher, (index, experts, *outputs))
            inputs[case] = (index, experts)
        if name in ROUTED_ONLY:
            continue
        routing = route(index, experts)
        generator = torch.Generator().manual_seed(100 + seed)
        for rows_dtype, weights_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16), (torch.float32, torch.bfloat16)):
            rows = (torch.randn(pairs, 48, generator=generator) * 8).to(rows_dtype)
            rows[int(routing.expert_offsets[-1]):] = float("nan")
            weights = torch.rand(tokens, top_k, generator=generator).to(weights_dtype)
            out = torch.full((tokens, 48), float("nan"), dtype=rows_dtype)
            case = f"combine-{name}-{rows_dtype}-{weights_dtype}"
            launches[case] = (COMBINE_LAUNCHER, (rows, routing.row_of_pair, routing.expert_offsets[-1:], weights, out))
            inputs[case] = (rows, routing, weights)
    results = run_interpreted(launches)
    return {case: (inputs[case], results[case].args) for case in launches}


@pytest.mark.parametrize("how", ["", "-in-chunks"], ids=["by-size", "in-chunks"])
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_interpreted_route_kernel_equals_the_torch_ops_routing(interpreted_routes_and_sums, case, how):
    """As the launcher chooses (one program up to ``SORTED_IN_ONE_PROGRAM`` pairs: the last two
    cases go in chunks), and every case in chunks."""
    launched = interpreted_routes_and_sums[f"route-{case}{how}"]
    (index, experts), (_, _, pair_of_row, row_of_pair, token_of_row, starts) = launched
    expected = route(index, experts)
    assert torch.equal(pair_of_row, expected.pair_of_row)
    assert torch.equal(row_of_pair, expected.row_of_pair)
    assert torch.equal(token_of_row, expected.token_of_row)
    assert torch.equal(starts, torch.cat([expected.expert_offsets, expected.pairs_in_range]))


@pytest.mark.parametrize(
    "case",
    [f"{name}-{rows}-{weights}" for name in ROUTE_CASES if name not in ROUTED_ONLY for rows, weights in (
        (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16))],
)
def test_interpreted_combine_kernel_equals_the_torch_ops_sum_bit_for_bit(interpreted_routes_and_sums, case):
    (rows, routing, weights), launched = interpreted_routes_and_sums[f"combine-{case}"]
    out = launched[4]
    assert torch.equal(out, combine(rows, routing, weights, rows.dtype))


@pytest.fixture(scope="module")
def interpreted_routed_quantizations():
    """The quantize kernel alone on three routings, straight and through ``source_rows``: one
    program per row and 1024 columns, so K = 2112 takes two whole column tiles and a ragged one."""
    launches, operands = {}, {}
    for index, (counts, K) in enumerate((((5, 0, 19, 1), 48), ((0, 0, 3), 2048 + 64), ((1, 1, 1), 16))):
        x, offsets, _, _, _, act_scales = grouped_operands(counts, 16, K, seed=10 + index)
        for gather in (False, True):
            case = f"{counts}-{K}-{'gathered' if gather else 'straight'}"
            args, source_rows = gathered((x, offsets, act_scales), seed=index) if gather else ((x, offsets, act_scales), None)
            qdata = torch.full((len(x), K // 2), 0xAA, dtype=torch.uint8)
            scales = torch.full((len(x), K // 16), 0xAA, dtype=torch.uint8)
            launches[case] = (QUANTIZE_LAUNCHER, (*args, qdata, scales, source_rows))
            operands[case] = (x, offsets, act_scales)
    results = run_interpreted(launches)
    return {case: (operands[case], results[case].args[3], results[case].args[4]) for case in launches}


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("gather", ["straight", "gathered"])
def test_interpreted_routed_rows_quantize_equals_quantize_nvfp4_per_expert(interpreted_routed_quantizations, index, gather):
    case = [c for c in interpreted_routed_quantizations if c.endswith(gather)][index]
    (x, offsets, act_scales), qdata, scales = interpreted_routed_quantizations[case]
    bounds = offsets.tolist()
    for expert, (first, end) in [(e, b) for e, b in enumerate(zip(bounds[:-1], bounds[1:])) if b[1] > b[0]]:
        expected_qdata, expected_scales = quantize_nvfp4(x[first:end], act_scales[expert])
        assert torch.equal(qdata[first:end], expected_qdata)
        assert torch.equal(scales[first:end], expected_scales.view(torch.uint8))
    assert (qdata[bounds[-1]:] == 0xAA).all() and (scales[bounds[-1]:] == 0xAA).all()  # not written


def test_grouped_gemm_refuses_operands_that_do_not_fit_together():
    from nvfp4_static.kernels.grouped_gemm import launch_grouped_nvfp4_gemm

    x, offsets, qdata, scales, weight_scales, act_scales = grouped_operands((2, 3), 16, 32, seed=0)
    out = torch.empty(x.shape[0], 16)
    with pytest.raises(ValueError, match=r"expert_offsets \(4,\)"):
        launch_grouped_nvfp4_gemm(x, torch.cat((offsets, offsets[-1:])), qdata, scales, weight_scales, act_scales, out)
    with pytest.raises(ValueError, match=r"weight_qdata \(2, 16, 8\)"):
        launch_grouped_nvfp4_gemm(x, offsets, qdata[:, :, :8], scales, weight_scales, act_scales, out)
    with pytest.raises(ValueError, match=r"K = 24"):
        launch_grouped_nvfp4_gemm(x[:, :24], offsets, qdata[:, :, :12], scales[:, :, :1], weight_scales, act_scales, out)
    for source_rows in (torch.zeros(len(x), 1, dtype=torch.int64), torch.zeros(len(x)), torch.tensor(0)):
        with pytest.raises(ValueError, match=r"source_rows .* \(want 1-D integers\)"):
            launch_grouped_nvfp4_gemm(x, offsets, qdata, scales, weight_scales, act_scales, out, None, source_rows)


# --- save and load -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_model():
    return quantized_model("qwen3_moe", weight_scale="max")


def test_load_quantized_rebuilds_converted_experts_in_a_fresh_float_model(converted_model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save(converted_model.state_dict(), path)
    fresh = tiny_model("qwen3_moe", seed=1)
    load_quantized(fresh, path)
    experts = fresh.model.layers[0].mlp.experts
    assert isinstance(experts, NVFP4StaticExperts)
    assert experts.layer_name == "model.layers.0.mlp.experts"
    with torch.no_grad():
        assert torch.equal(fresh(token_ids(8)).logits, converted_model(token_ids(8)).logits)


def test_prepare_for_loading_gives_placeholders_that_refuse_to_run_until_loaded(converted_model):
    fresh = tiny_model("qwen3_moe", seed=1)
    quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="max"), filter_fn=is_quantizable)
    placeholder = fresh.model.layers[1].mlp.experts
    with pytest.raises(RuntimeError, match="'model.layers.1.mlp.experts' are an empty placeholder"):
        placeholder(*routed_batch(2, seed=0))
    fresh.load_state_dict(converted_model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(token_ids(8)).logits, converted_model(token_ids(8)).logits)


@pytest.mark.parametrize("left_out", ["gate_up_proj.qdata", "down_proj.scale", "down_proj.act_per_tensor_scale"])
def test_placeholder_experts_stay_empty_until_all_their_tensors_are_loaded(converted_model, left_out):
    """With strict=False a load may bring the extra state and some tensors only."""
    fresh = tiny_model("qwen3_moe", seed=1)
    quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="max"), filter_fn=is_quantizable)
    prefix = "model.layers.1.mlp.experts."
    state = {k: v for k, v in converted_model.state_dict().items() if k.startswith(prefix) and k != prefix + left_out}
    fresh.load_state_dict(state, strict=False)
    placeholder = fresh.model.layers[1].mlp.experts
    with pytest.raises(RuntimeError, match="'model.layers.1.mlp.experts' are an empty placeholder"):
        placeholder(*routed_batch(2, seed=0))
    fresh.load_state_dict({prefix + left_out: converted_model.state_dict()[prefix + left_out]}, strict=False)
    assert placeholder.loaded and not fresh.model.layers[0].mlp.experts.loaded


@pytest.mark.parametrize("unrouted", ["every slot", "some slots"])
def test_tokens_routed_to_no_expert_stay_out_of_the_pooled_statistics(unrouted):
    """Index num_experts routes a slot to no expert: a token all of whose slots go nowhere
    reaches no expert, so the pooled statistics (which experts short of tokens take) skip it."""
    hidden, index, weights = routed_batch(12, seed=3)
    outliers = 1000 * torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
    outlier_index = torch.full((4, TOP_K), EXPERTS)
    if unrouted == "some slots":
        outlier_index[:, 0] = 2  # these reach expert 2: they count
    mixed = (torch.cat([hidden, outliers]), torch.cat([index, outlier_index]), torch.cat([weights, weights[:4]]))
    holder = calibrated_experts([mixed], act_calibration="max")
    routed = torch.cat([hidden, outliers]) if unrouted == "some slots" else hidden
    assert torch.equal(holder.experts.pooled_gate_up_calibrator.compute_amax(), routed.abs().amax())


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf"), 1e37])
def test_a_checkpoint_with_a_bad_expert_scale_is_refused_naming_the_expert(converted_model, bad):
    state = dict(converted_model.state_dict())
    key = "model.layers.0.mlp.experts.down_proj.act_per_tensor_scale"
    state[key] = state[key].clone()
    state[key][3] = bad
    fresh = tiny_model("qwen3_moe", seed=1)
    before = dict(fresh.state_dict())
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj.3.*activation scale"):
        load_quantized(fresh, state)
    assert type(fresh.model.layers[0].mlp.experts) is Qwen3MoeExperts  # left as it was
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("code", [0x7F, 0xFF, 0xB8], ids=["nan", "negative-nan", "minus-one"])
@pytest.mark.parametrize("into", ["load_quantized", "placeholder"])
def test_a_checkpoint_with_a_bad_expert_block_scale_is_refused_naming_the_expert(converted_model, code, into):
    state = dict(converted_model.state_dict())
    key = "model.layers.1.mlp.experts.gate_up_proj.scale"
    state[key] = state[key].clone()
    state[key].view(torch.uint8)[5, 7, 2] = code
    fresh = tiny_model("qwen3_moe", seed=1)
    if into == "placeholder":
        quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="max"),
                  filter_fn=is_quantizable)
    experts = fresh.model.layers[1].mlp.experts
    before = {k: v.clone() for k, v in experts.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.gate_up_proj.5' has 1 FP8 block scale\(s\) that "
                                         r"are NaN or negative \(the first at index \[7, 2\]"):
        load_quantized(fresh, state) if into == "load_quantized" else fresh.load_state_dict(state)
    assert fresh.model.layers[1].mlp.experts is experts
    after = experts.state_dict()
    assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           after[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else after[k])
               for k, v in before.items())


# Stored otherwise than convert writes them: copied, the codes and block scales would be
# converted as numbers (other values without an error); a scale of another shape would copy part
# of the layer and then fail.
EXPERT_TENSORS_STORED_OTHERWISE = {
    "block scales as their byte codes": ("gate_up_proj.scale", lambda t: t.view(torch.uint8),
                                         r"gate_up_proj': its scale is torch.uint8, the model's torch.float8_e4m3fn"),
    "block scales as float32": ("down_proj.scale", lambda t: t.float(),
                                r"down_proj': its scale is torch.float32, the model's torch.float8_e4m3fn"),
    "codes as int16": ("down_proj.qdata", lambda t: t.to(torch.int16),
                       r"down_proj': its qdata is torch.int16, the model's torch.uint8"),
    "activation scales of shape [E, 1]": ("gate_up_proj.act_per_tensor_scale", lambda t: t[:, None],
                                          r"gate_up_proj': its act_per_tensor_scale has shape \(\d+, 1\), the model's "
                                          r"\(\d+,\)"),
    "codes of another shape": ("down_proj.qdata", lambda t: t[:, :, :-8],
                               r"down_proj': its qdata has shape"),
}


@pytest.mark.parametrize("stored", EXPERT_TENSORS_STORED_OTHERWISE.values(), ids=EXPERT_TENSORS_STORED_OTHERWISE.keys())
@pytest.mark.parametrize("into", ["load_quantized", "placeholder"])
def test_expert_tensors_stored_otherwise_are_refused_before_anything_is_copied(converted_model, stored, into):
    field, change, message = stored
    state = dict(converted_model.state_dict())
    key = f"model.layers.1.mlp.experts.{field}"
    state[key] = change(state[key].clone())
    fresh = tiny_model("qwen3_moe", seed=1)
    if into == "placeholder":
        quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="max"),
                  filter_fn=is_quantizable)
    before = plain_tensors(fresh)
    # load_quantized's own check of every tensor's shape speaks first where a shape differs
    refused = rf"experts 'model.layers.1.mlp.experts.{message}|size mismatch for '{key}'"
    with pytest.raises((ValueError, RuntimeError), match=refused):
        load_quantized(fresh, state) if into == "load_quantized" else fresh.load_state_dict(state)
    after = plain_tensors(fresh)
    assert before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())


def plain_tensors(model):
    """Every tensor of ``model``'s state, NVFP4 weights as their four tensors, FP8 ones as bytes."""
    tensors = {}
    for key, value in model.state_dict().items():
        parts = {f"{key}.{f}": getattr(value, f) for f in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale")} \
            if hasattr(value, "qdata") else {key: value}
        for name, t in parts.items():
            if isinstance(t, torch.Tensor):
                tensors[name] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
    return tensors


def test_converting_converted_experts_with_another_recipe_is_refused():
    holder = calibrated_experts([routed_batch(96, seed) for seed in range(2)], act_calibration="max", weight_scale="mse")
    convert(holder, act_calibration="max", weight_scale="mse")
    experts = holder.experts
    with pytest.raises(ValueError, match=r"is already converted with \{'act_calibration': 'max', 'weight_scale': 'mse'\}"):
        convert(holder, act_calibration="max", weight_scale="max")
    assert holder.experts is experts and experts.recipe == {"act_calibration": "max", "weight_scale": "mse"}


def test_a_checkpoint_of_another_recipe_is_refused(converted_model):
    fresh = tiny_model("qwen3_moe", seed=1)
    quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="mse"), filter_fn=is_quantizable)
    with pytest.raises(ValueError, match="recipe"):
        fresh.load_state_dict(converted_model.state_dict())


# --- serving checkpoints -----------------------------------------------------------------------

FORMATS = ("compressed-tensors", "modelopt")
# Each format's four tensors per linear, and the per-expert linear names (gate, up, down).
FIELDS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
}
CHECKPOINT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def served_models():
    """Each architecture quantized as serving needs it: fused linears tied."""
    return {arch: quantized_model(arch, tie=True, weight_scale="max") for arch in ARCHITECTURES}


def folder_tensors(folder):
    from test_export import read_folder

    return read_folder(folder)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_export_writes_each_expert_under_the_names_save_pretrained_gives_its_float_weights(
    served_models, architecture, format, tmp_path
):
    export_checkpoint(served_models[architecture], tmp_path / "export", format)
    tiny_model(architecture).save_pretrained(tmp_path / "float")  # transformers' own names
    ours, float_names = folder_tensors(tmp_path / "export"), set(load_file(tmp_path / "float" / "model.safetensors"))
    gate, up, _ = CHECKPOINT_NAMES[architecture]
    expert_linears = {n.removesuffix(".weight") for n in float_names if ".experts." in n}
    assert len(expert_linears) == 2 * EXPERTS * 3
    # Every expert linear of the float checkpoint is there with the format's four tensors, and
    # each tensor of ours is a tensor of the float checkpoint or one of a linear of it.
    assert {f"{name}.{field}" for name in expert_linears for field in FIELDS[format]} <= set(ours)
    for name in ours:
        module, _, field = name.rpartition(".")
        assert name in float_names or (field in FIELDS[format] and f"{module}.weight" in float_names), name
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    router = "block_sparse_moe.gate" if architecture == "mixtral" else "mlp.gate"
    assert {f"model.layers.{i}.{router}" for i in range(2)} <= set(config["ignore"])
    experts = [name.rpartition(".")[0] for name in expert_linears if name.endswith(f".{gate}")]
    assert len(experts) == 2 * EXPERTS
    for expert in experts:  # gate and up: one GEMM, one weight and one input scale
        for field in FIELDS[format][2:]:
            assert torch.equal(ours[f"{expert}.{gate}.{field}"], ours[f"{expert}.{up}.{field}"])


def test_compressed_tensors_decompressor_reads_every_expert(served_models, tmp_path):
    # Imported here, so that a machine without the test oracle (the GPU machines) runs the rest.
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from test_export import ct_scheme

    model = served_models["qwen3_moe"]
    export_checkpoint(model, tmp_path / "ct")
    tensors, scheme = folder_tensors(tmp_path / "ct"), ct_scheme(tmp_path / "ct")
    experts = model.model.layers[1].mlp.experts
    for expert in range(EXPERTS):
        for projection, grouped, rows in (
            ("gate_proj", experts.gate_up_proj, slice(0, INTERMEDIATE)),
            ("up_proj", experts.gate_up_proj, slice(INTERMEDIATE, None)),
            ("down_proj", experts.down_proj, slice(None)),
        ):
            prefix = f"model.layers.1.mlp.experts.{expert}.{projection}."
            state = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            decompressed = NVFP4PackedCompressor.decompress(state, scheme)
            ours = dequantize_nvfp4(
                grouped.qdata[expert, rows], grouped.scale[expert, rows], grouped.per_tensor_scale[expert]
            )
            # It multiplies by s / G where we multiply by s * p, then rounds to bf16: within one
            # bf16 ulp (test_export.py says why).
            torch.testing.assert_close(decompressed["weight"].float(), ours, rtol=2.0**-7, atol=0)
            assert torch.equal(decompressed["weight_scale"].float(), grouped.scale[expert, rows].float())


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_export_then_import_is_bit_identical(served_models, architecture, format, tmp_path):
    model = served_models[architecture]
    export_checkpoint(model, tmp_path / "export", format)
    imported = import_checkpoint(tmp_path / "export")
    for layer in range(2):
        ours, theirs = model.model.layers[layer].mlp.experts, imported.model.layers[layer].mlp.experts
        assert isinstance(theirs, NVFP4StaticExperts)
        for name, buffer in ours.state_dict().items():
            if name != "_extra_state":
                assert torch.equal(theirs.state_dict()[name].view(torch.uint8), buffer.view(torch.uint8)), name
    with torch.no_grad():
        assert torch.equal(imported(token_ids(8)).logits, model(token_ids(8)).logits)


def edit_folder(folder, config_edit=None, tensor_edit=None):
    if config_edit is not None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config_edit(config["quantization_config"])
        path.write_text(json.dumps(config))
    if tensor_edit is not None:
        for shard in folder.glob("*.safetensors"):
            tensors = load_file(shard)
            tensor_edit(tensors)
            save_file(tensors, shard)


def test_import_refuses_experts_only_partly_quantized(served_models, tmp_path):
    export_checkpoint(served_models["qwen3_moe"], tmp_path / "ct")
    edit_folder(tmp_path / "ct", lambda q: q["ignore"].append("model.layers.1.mlp.experts.3.up_proj"))
    with pytest.raises(ValueError, match=r"experts 'model.layers.1.mlp.experts' are partly quantized.*3.up_proj"):
        import_checkpoint(tmp_path / "ct")


def test_import_refuses_an_expert_whose_gate_and_up_scales_differ(served_models, tmp_path):
    export_checkpoint(served_models["mixtral"], tmp_path / "ct")
    key = "model.layers.0.block_sparse_moe.experts.5.w3.weight_global_scale"

    def double(tensors):
        if key in tensors:
            tensors[key] = tensors[key] * 2

    edit_folder(tmp_path / "ct", tensor_edit=double)
    fresh = tiny_model("mixtral", seed=3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"experts 'model.layers.0.mlp.experts': expert 5's w1 and w3 have different weight global"):
        import_checkpoint(tmp_path / "ct", fresh)
    assert type(fresh.model.layers[0].mlp.experts) is MixtralExperts  # left as it was
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def linears_but_not_experts(module, fqn):
    return is_quantizable(module, fqn) and not isinstance(module, (Qwen3MoeExperts, MixtralExperts))


@pytest.fixture(scope="module")
def float_experts_models():
    """Each architecture with its linears quantized and its experts left float."""
    models = {}
    for architecture in ARCHITECTURES:
        model = prepare(tiny_model(architecture), filter_fn=linears_but_not_experts)
        with torch.no_grad():
            model(token_ids(0))
        tie_fused_layers(model)
        models[architecture] = convert(model, filter_fn=linears_but_not_experts)
    return models


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_float_experts_are_exported_as_save_pretrained_splits_them_and_imported_bit_for_bit(
    float_experts_models, architecture, format, tmp_path
):
    model = float_experts_models[architecture]
    export_checkpoint(model, tmp_path / "export", format)
    tiny_model(architecture).save_pretrained(tmp_path / "float")  # transformers' own split
    theirs = {n for n in load_file(tmp_path / "float" / "model.safetensors") if ".experts." in n}
    ours = folder_tensors(tmp_path / "export")
    assert len(theirs) == 2 * EXPERTS * 3 and {n for n in ours if ".experts." in n} == theirs
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    assert {n.removesuffix(".weight") for n in theirs} <= set(config["ignore"])
    fresh = tiny_model(architecture, seed=7)
    assert not torch.equal(fresh.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj)
    imported = import_checkpoint(tmp_path / "export", fresh)
    for layer in range(2):
        exported, loaded = model.model.layers[layer].mlp.experts, imported.model.layers[layer].mlp.experts
        assert type(loaded) is ARCHITECTURES[architecture][2]
        for part in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(loaded, part).view(torch.int32), getattr(exported, part).view(torch.int32)), part
    with torch.no_grad():
        assert torch.equal(imported(token_ids(8)).logits, model(token_ids(8)).logits)


@pytest.mark.parametrize("architecture, missing", [("qwen3_moe", "3.up_proj"), ("mixtral", "0.w2"), ("mixtral", "7.w1")])
def test_float_experts_only_partly_in_the_folder_are_refused_naming_the_first_missing(
    float_experts_models, architecture, missing, tmp_path
):
    export_checkpoint(float_experts_models[architecture], tmp_path / "ct")
    saved = "block_sparse_moe" if architecture == "mixtral" else "mlp"
    name = f"model.layers.1.{saved}.experts.{missing}.weight"
    edit_folder(tmp_path / "ct", tensor_edit=lambda tensors: tensors.pop(name, None))
    fresh = tiny_model(architecture, seed=3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=rf"experts 'model.layers.1.mlp.experts' are in the checkpoint only partly .*'model.layers.1.mlp.experts.{missing}.weight' is missing \({EXPERTS * 3 - 1} of {EXPERTS * 3}",
    ):
        import_checkpoint(tmp_path / "ct", fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())  # left as it was


def test_float_experts_not_all_listed_as_unquantized_are_refused(float_experts_models, tmp_path):
    export_checkpoint(float_experts_models["qwen3_moe"], tmp_path / "ct")
    edit_folder(tmp_path / "ct", lambda q: q["ignore"].remove("model.layers.0.mlp.experts.2.gate_proj"))
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.experts.2.gate_proj': the checkpoint has no 'weight_packed'"):
        import_checkpoint(tmp_path / "ct", tiny_model("qwen3_moe"))


def test_a_model_with_experts_prepared_but_not_converted_is_not_exported(tmp_path):
    model = prepare(tiny_model("qwen3_moe"), filter_fn=lambda m, fqn: is_quantizable(m, fqn) and fqn.endswith("experts"))
    with pytest.raises(ValueError, match=r"2 layer\(s\) are prepared but not converted \(first: 'model.layers.0.mlp.experts'\)"):
        export_checkpoint(model, tmp_path / "ct", fusion_groups=())


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, sizes",
    [({"moe_intermediate_size": 24}, "64 and 24"), ({"hidden_size": 72, "head_dim": 18}, "72 and 32")],
    ids=["intermediate", "hidden"],
)
def test_experts_whose_dims_nvfp4_cannot_block_stay_float_with_a_reason(changes, sizes):
    holder = standalone_experts(**changes)
    with pytest.warns(UserWarning, match=f"layer 'experts' is left unquantized: .*divisible by 16.*{sizes}"):
        prepare(holder)
    assert type(holder.experts) is Qwen3MoeExperts
    convert(holder)  # nothing to convert, nothing refused
    assert type(holder.experts) is Qwen3MoeExperts
    with pytest.raises(ValueError, match="left unquantized"):
        prepare(standalone_experts(**changes), strict=True)


def test_experts_whose_weights_do_not_fit_their_layout_stay_float():
    holder = standalone_experts()
    holder.experts.down_proj = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN, 48))
    with pytest.warns(UserWarning, match=r"are not \[E, 2I, H\] and \[E, H, I\]"):
        prepare(holder)
    assert type(holder.experts) is Qwen3MoeExperts


@pytest.mark.parametrize("value", [0, -3, 2.5, None])
def test_config_refuses_an_expert_min_tokens_below_one_or_not_an_integer(value):
    with pytest.raises(ValueError, match="expert_min_tokens"):
        NVFP4StaticActivationConfig(expert_min_tokens=value)


def test_convert_without_prepare_and_prepare_twice_are_refused_naming_the_layer():
    with pytest.raises(RuntimeError, match="experts 'experts' have no observer"):
        convert(standalone_experts())
    holder = prepare(standalone_experts())
    with pytest.raises(ValueError, match="'experts' is already NVFP4StaticObservedExperts"):
        prepare(holder)


def test_convert_with_another_activation_recipe_than_prepared_is_refused():
    holder = calibrated_experts([routed_batch(32, seed=0)])
    with pytest.raises(ValueError, match="prepared with another activation recipe"):
        convert(holder, act_calibration="max")
    assert isinstance(holder.experts, NVFP4StaticObservedExperts)


def test_a_calibration_batch_with_nan_is_refused_naming_the_layer_and_the_pooled_statistics_skip_it():
    holder = prepare(standalone_experts(), act_calibration="max")
    hidden, index, weights = routed_batch(8, seed=0)
    hidden[3, 5] = float("nan")
    with pytest.raises(ValueError, match="experts.gate_up_proj.*NaN"):
        holder.experts(hidden, index, weights)
    assert holder.experts.tokens_per_expert == [0] * EXPERTS


# --- backend ------------------------------------------------------------------------------------


class OpsRun(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the ops that run inside it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def grouped_ops_run(experts, batch) -> set:
    with torch.no_grad(), OpsRun() as ops:
        experts(*batch)
    return {name for name in ops.names if "grouped" in name}


@pytest.mark.parametrize(
    "backend, route",
    [
        ("cpu", "nvfp4_static::grouped_static_nvfp4_linear_reference"),
        # the grouped GEMM's op: its Triton kernels on CUDA, on CPU tensors the torch reference
        ("triton", "nvfp4_static::grouped_static_nvfp4_linear"),
        (None, "nvfp4_static::grouped_static_nvfp4_linear_reference"),  # auto, on CPU
    ],
)
def test_the_config_backend_picks_the_experts_route(backend, route):
    holder = calibrated_experts([routed_batch(48, seed) for seed in range(2)], act_calibration="max", weight_scale="max")
    convert(holder, act_calibration="max", weight_scale="max", backend=backend)
    experts = holder.experts
    batch = routed_batch(10, seed=11)
    assert experts.backend == (backend or "cpu") and f"backend={experts.backend}" in repr(experts)
    assert grouped_ops_run(experts, batch) == {route}
    with torch.no_grad():
        assert torch.equal(experts(*batch), loop_over_experts(experts, *batch))


def test_load_quantized_and_prepare_for_loading_take_the_backend(converted_model):
    fresh = tiny_model("qwen3_moe", seed=1)
    load_quantized(fresh, converted_model.state_dict(), backend="triton")
    assert fresh.model.layers[0].mlp.experts.backend == "triton"
    fresh = tiny_model("qwen3_moe", seed=1)
    config = NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="max", backend="triton")
    quantize_(fresh, config, filter_fn=is_quantizable)
    assert fresh.model.layers[1].mlp.experts.backend == "triton"


def test_import_checkpoint_takes_the_backend(served_models, tmp_path):
    export_checkpoint(served_models["qwen3_moe"], tmp_path / "export")
    imported = import_checkpoint(tmp_path / "export", tiny_model("qwen3_moe", seed=1), backend="triton")
    assert imported.model.layers[0].mlp.experts.backend == "triton"


BLACKWELL_REFUSED = r"experts 'experts': backend 'blackwell' \(from the config's backend or \$NVFP4_STATIC_BACKEND\) has no grouped GEMM"


def test_convert_refuses_a_backend_the_experts_cannot_run_naming_the_layer():
    holder = calibrated_experts([routed_batch(48, seed) for seed in range(2)], act_calibration="max", weight_scale="max")
    observed = holder.experts
    with pytest.raises(ValueError, match=BLACKWELL_REFUSED):
        convert(holder, act_calibration="max", weight_scale="max", backend="blackwell")
    assert holder.experts is observed  # left as it was, and it still converts
    convert(holder, act_calibration="max", weight_scale="max", backend="cpu")
    assert holder.experts.backend == "cpu"


@pytest.mark.parametrize("env, error", [
    ("blackwell", BLACKWELL_REFUSED),
    ("tpu", r"unknown backend 'tpu' \(from \$NVFP4_STATIC_BACKEND\)"),
])
def test_a_backend_from_the_environment_is_honoured_and_checked_too(monkeypatch, env, error):
    holder = calibrated_experts([routed_batch(48, seed) for seed in range(2)], act_calibration="max", weight_scale="max")
    observed = holder.experts
    monkeypatch.setenv("NVFP4_STATIC_BACKEND", env)
    with pytest.raises(ValueError, match=error):
        convert(holder, act_calibration="max", weight_scale="max")
    assert holder.experts is observed
    monkeypatch.setenv("NVFP4_STATIC_BACKEND", "triton")
    convert(holder, act_calibration="max", weight_scale="max")
    assert holder.experts.backend == "triton"


def test_loading_with_a_backend_the_experts_cannot_run_is_refused_and_leaves_the_model(converted_model):
    fresh = tiny_model("qwen3_moe", seed=1)
    with pytest.raises(ValueError, match=r"experts 'model.layers.0.mlp.experts': backend 'blackwell'"):
        load_quantized(fresh, converted_model.state_dict(), backend="blackwell")
    assert type(fresh.model.layers[0].mlp.experts) is Qwen3MoeExperts
    with pytest.raises(ValueError, match=r"experts 'model.layers.0.mlp.experts': backend 'blackwell'"):
        quantize_(fresh, NVFP4StaticActivationConfig(step="prepare_for_loading", backend="blackwell"), filter_fn=is_quantizable)


# --- diagnostics and the clip monitor ----------------------------------------------------------

# Expert 6 gets 4 calibration tokens and expert 7 none: both take the pooled statistics.
STARVED = [6, 7]


@pytest.fixture(scope="module")
def float_and_starved():
    """The float experts and a copy calibrated (b_min, the default) so that STARVED take the
    pooled statistics, converted."""
    float_holder = standalone_experts()
    holder = copy.deepcopy(float_holder)
    prepare(holder, weight_scale="max")
    with torch.no_grad():
        for batch in [routed_batch(64, seed, experts=range(6)) for seed in range(2)]:
            holder.experts(*batch)
        holder.experts(*routed_batch(2, seed=7, experts=[5, 6]))
    with pytest.warns(UserWarning, match="experts 6, 7 saw fewer"):
        convert(holder, weight_scale="max")
    return float_holder, holder


def quiet_batch_with_one_outlier(experts, expert: int, tokens: int = 12):
    """A batch far inside every expert's range, over all experts, and one more token routed to
    ``expert`` alone whose first element is twice that expert's static gate/up amax."""
    hidden, index, weights = routed_batch(tokens, seed=21)
    hidden = hidden * 1e-3
    outlier = torch.zeros(1, HIDDEN)
    outlier[0, 0] = 2 * float(experts.gate_up_proj.act_global_amax[expert])
    return (
        torch.cat([hidden, outlier]),
        torch.cat([index, torch.tensor([[expert, EXPERTS]])]),  # EXPERTS: its second slot nowhere
        torch.cat([weights, torch.tensor([[1.0, 0.0]])]),
    )


def rows_of(index, expert):
    """The tokens routed to ``expert``, in transformers' order."""
    return torch.where((index == expert).t())[1]


def test_diagnostics_report_each_experts_gemms_with_their_calibration(float_and_starved):
    float_holder, holder = float_and_starved
    experts = holder.experts
    batch = routed_batch(24, seed=5)
    report = {d.name: d for d in layer_diagnostics(holder, batch, reference_model=float_holder)}
    ran = [e for e in range(EXPERTS) if len(rows_of(batch[1], e))]
    assert list(report) == [f"experts.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in ran]
    tokens = experts.calibration_stats["tokens_per_expert"]
    assert tokens[6:] == [2, 0]
    for expert in ran:
        for projection in ("gate_up_proj", "down_proj"):
            d = report[f"experts.{projection}.{expert}"]
            amax = getattr(experts, projection).act_global_amax[expert]
            assert d.act_global_amax == pytest.approx(float(amax), rel=1e-6)
            stats = d.calibration_stats
            assert stats["g_amax"] == pytest.approx(d.act_global_amax, rel=1e-6)
            assert stats["tokens"] == tokens[expert] and stats["pooled"] == (expert in STARVED)
            assert stats["set_by"] in ("rho*B_min", "margin*B_max")
            assert d.weight_snr_db > 12 and d.output_snr_db > 12 and d.act_snr_db > 12
        # The gate/up input SNR recomputed from the rows transformers gives the expert.
        x = batch[0][rows_of(batch[1], expert)]
        static = fake_quantize_nvfp4(x, experts.gate_up_proj.act_per_tensor_scale[expert])
        assert report[f"experts.gate_up_proj.{expert}"].act_snr_db == pytest.approx(snr_db(x, static), abs=1e-9)
    # The starved experts carry the pooled calibrator's g_amax, and the table says so.
    pooled = report["experts.gate_up_proj.6"].calibration_stats["g_amax"]
    assert report["experts.gate_up_proj.7"].calibration_stats["g_amax"] == pooled
    assert pooled != report["experts.gate_up_proj.0"].calibration_stats["g_amax"]
    rows = {line.split()[0]: line for line in format_diagnostics(report.values()).splitlines()[2:]}
    assert "pooled" in rows["experts.gate_up_proj.7"] and "pooled" not in rows["experts.gate_up_proj.0"]
    assert not any(m._forward_hooks for m in holder.modules())


def test_diagnostics_show_clipping_for_the_expert_whose_rows_clip_only(float_and_starved):
    _, holder = float_and_starved
    batch = quiet_batch_with_one_outlier(holder.experts, expert=3)
    report = {d.name: d for d in layer_diagnostics(holder, batch)}
    gate_up = {name: d for name, d in report.items() if ".gate_up_proj." in name}
    rows = len(rows_of(batch[1], 3))
    assert gate_up["experts.gate_up_proj.3"].clipped_fraction == 1 / (rows * HIDDEN)
    assert all(d.clipped_fraction == 0 for name, d in gate_up.items() if name != "experts.gate_up_proj.3")


def test_diagnostics_of_a_moe_model_cover_its_linears_and_its_experts(converted_model):
    report = [d.name for d in layer_diagnostics(converted_model, token_ids(3), reference_model=tiny_model("qwen3_moe"))]
    assert "model.layers.0.self_attn.q_proj" in report
    assert "model.layers.1.mlp.experts.gate_up_proj.0" in report and "model.layers.1.mlp.experts.down_proj.0" in report


def test_diagnostics_refuse_a_reference_whose_experts_are_not_float_experts(float_and_starved):
    _, holder = float_and_starved
    with pytest.raises(ValueError, match="reference_model's 'experts' is a Linear, expected the float experts module"):
        layer_diagnostics(holder, routed_batch(4, seed=0), reference_model=Holder(torch.nn.Linear(2, 2)))
    assert not any(m._forward_hooks for m in holder.modules())  # no hook left behind


def expected_clip_counts(experts, batches) -> dict:
    """Each expert GEMM's clipped and seen input elements and max magnitude over ``batches``,
    from the rows transformers routes to each expert and per-expert ``NVFP4StaticLinear``s."""
    counts = {}
    for hidden, index, _ in batches:
        for expert in range(EXPERTS):
            x = hidden[rows_of(index, expert)]
            gate, up = per_expert_linear(experts.gate_up_proj, expert)(x).chunk(2, dim=-1)
            for projection, rows in (("gate_up_proj", x), ("down_proj", experts.act_fn(gate) * up)):
                limit = getattr(experts, projection).act_global_amax[expert]
                clipped, seen, max_abs = counts.get(f"experts.{projection}.{expert}", (0, 0, 0.0))
                counts[f"experts.{projection}.{expert}"] = (
                    clipped + int((rows.abs() > limit).sum()),
                    seen + rows.numel(),
                    max(max_abs, float(rows.abs().amax())) if len(rows) else max_abs,
                )
    return counts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_clip_monitor_counts_each_experts_clipped_inputs(float_and_starved, compiled):
    _, holder = float_and_starved
    experts = holder.experts
    batches = [quiet_batch_with_one_outlier(experts, expert=3), routed_batch(9, seed=8), routed_batch(9, seed=9)]
    enable_clip_monitor(holder)
    run = torch.compile(experts, fullgraph=True) if compiled else experts
    try:
        with torch.no_grad():
            for batch in batches:
                run(*batch)
        counts = clip_counts(holder)
    finally:
        disable_clip_monitor(holder)
    expected = expected_clip_counts(experts, batches)
    assert {name: (c.clipped, c.seen, c.max_abs) for name, c in counts.items()} == expected
    assert counts["experts.gate_up_proj.3"].act_global_amax == float(experts.gate_up_proj.act_global_amax[3])
    assert clip_counts(holder) == {}


def test_clip_monitor_sees_only_the_outlier_expert_clip(float_and_starved):
    _, holder = float_and_starved
    enable_clip_monitor(holder)
    with torch.no_grad():
        holder.experts(*quiet_batch_with_one_outlier(holder.experts, expert=3))
    counts = clip_counts(holder)
    disable_clip_monitor(holder)
    assert counts["experts.gate_up_proj.3"].clipped == 1
    assert all(c.clipped == 0 for name, c in counts.items() if name.startswith("experts.gate_up_proj.") and name != "experts.gate_up_proj.3")


# --- GPU ---------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_gpu_grouped_gemm_matches_the_torch_reference(dtype, tokens):
    counts = torch.multinomial(torch.ones(32), tokens * 4, replacement=True, generator=torch.Generator().manual_seed(tokens))
    counts = torch.bincount(counts, minlength=32).tolist()
    operands = grouped_operands(counts, 768, 2048, seed=tokens, tail=0)
    operands = (operands[0].to(dtype), *operands[1:])
    expected = grouped_static_nvfp4_linear(*operands)
    from nvfp4_static.kernels import grouped_static_nvfp4_linear as op

    out = op(*(t.cuda() for t in operands))
    assert relative_error(out.cpu(), expected) <= gpu_tolerance(2048, dtype)


@requires_cuda
def test_gpu_converted_experts_match_cpu_and_compile_without_recompiling():
    holder = convert(calibrated_experts([routed_batch(48, seed) for seed in range(2)]))
    batches = [routed_batch(10, seed, **routing) for seed, routing in enumerate(ROUTINGS.values())]
    with torch.no_grad():
        expected = [holder.experts(*batch) for batch in batches]
    holder.to("cuda")
    compiled = torch.compile(holder.experts, fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for batch, reference in zip(batches, expected):
            out = compiled(*(t.cuda() for t in batch))
            # The GEMMs sum in another order, and a last-bit difference in the intermediate can
            # move one of its E2M1 codes a step before the down projection: far below the 1e-1
            # a wrong expert or scale gives.
            assert relative_error(out.cpu(), reference) <= 2e-2


@requires_cuda
def test_gpu_compiled_experts_route_and_combine_by_kernel_as_eager_calls_do_bit_for_bit(converted_holder):
    """One graph for 3 to 300 tokens (up to 600 pairs: the route kernel in chunks past 512)
    holding the two routing ops, each call equal to the eager one, which launches the same
    kernels."""
    holder = copy.deepcopy(converted_holder).to("cuda")
    batches = [[t.cuda() for t in routed_batch(tokens, seed=tokens)] for tokens in (3, 10, 64, 300)]
    assert {"route_experts", "combine_experts"} <= graph_ops(holder.experts, *batches[1])
    compiled = torch.compile(holder.experts, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            assert torch.equal(compiled(*batch), holder.experts(*batch))


@requires_cuda
@pytest.mark.parametrize("indices", [[-1], [-100], [EXPERTS + 1], [1000, -1, EXPERTS + 1]], ids=str)
def test_gpu_converted_experts_refuse_the_call_after_one_with_an_index_outside_the_experts(converted_holder, indices):
    """On CUDA the count travels behind the call and is read at the next one (a read at the call
    would stall every layer): the call after the bad one raises, naming the layer and the count,
    and the call after that runs. Calls with the no-expert index never raise, nor do copies."""
    experts = copy.deepcopy(converted_holder.experts).to("cuda")
    good = [t.cuda() for t in routed_batch(6, seed=3)]
    hidden, bad_index, weights = routed_batch(6, seed=4)
    bad_index[0, 1] = EXPERTS
    for pair, index in enumerate(indices):
        bad_index[1 + pair, 0] = index
    bad = [t.cuda() for t in (hidden, bad_index, weights)]
    nowhere = good[1].clone()
    nowhere[:, 1] = EXPERTS
    with torch.no_grad():
        expected = experts(*good)
        experts(good[0], nowhere, good[2])
        experts(*bad)
        copied = copy.deepcopy(experts)
        assert torch.equal(copied(*good), expected)
        with pytest.raises(ValueError, match=rf"experts 'experts': the call before this one had {len(indices)} expert "
                                             rf"indices outside 0..{EXPERTS} in its top_k_index \[6, {TOP_K}\]"):
            experts(*good)
        assert torch.equal(experts(*good), expected)
        assert torch.equal(experts(*good), expected)


@requires_cuda
@pytest.mark.parametrize("rows_dtype, weights_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float16, torch.float16)], ids=str)
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 8, 128), (16, 8, 128), (64, 8, 128), (3, 2, 8), (200, 2, 60)], ids=str)
def test_gpu_route_and_combine_kernels_equal_the_torch_ops_bit_for_bit(tokens, top_k, experts, rows_dtype, weights_dtype, monkeypatch):
    """An eager call on CUDA routes and sums in one launch each (counted), with the torch ops'
    integers and sums exactly, on Qwen3-MoE-sized routings with the no-expert index, an index
    outside 0..E and NaN in the rows routed nowhere."""
    from nvfp4_static.experts import routing as routing_module
    from nvfp4_static.kernels.launch import recording_launches

    index = routing_case(tokens, top_k, experts, [experts, -1], torch.int64, "contiguous", seed=tokens).cuda()
    generator = torch.Generator("cuda").manual_seed(tokens)
    rows = (torch.randn(tokens * top_k, 2048, generator=generator, device="cuda") * 8).to(rows_dtype)
    weights = torch.rand(tokens, top_k, generator=generator, device="cuda").to(weights_dtype)
    with recording_launches() as calls:
        kernel_routing = route(index, experts)
        rows[int(kernel_routing.expert_offsets[-1]):] = float("nan")
        combined = combine(rows, kernel_routing, weights, rows_dtype)
    assert len(calls) == 2
    monkeypatch.setattr(routing_module, "HAS_TRITON", False)
    ops_routing = route(index, experts)
    for field in ("pair_of_row", "expert_offsets", "pairs_in_range", "row_of_pair", "token_of_row"):
        assert torch.equal(getattr(kernel_routing, field), getattr(ops_routing, field)), field
    assert torch.equal(combined, combine(rows, ops_routing, weights, rows_dtype))


@requires_cuda
def test_gpu_converted_experts_give_the_torch_ops_routings_output_bit_for_bit(converted_holder, monkeypatch):
    """The whole forward on CUDA with the route and combine kernels and with the torch ops."""
    from nvfp4_static.experts import routing as routing_module

    experts = copy.deepcopy(converted_holder.experts).to("cuda")
    batches = [[t.cuda() for t in routed_batch(tokens, seed=tokens, **routing)] for tokens, routing in
               ((1, {}), (10, ROUTINGS["some experts idle"]), (48, ROUTINGS["two experts take all"]))]
    with torch.no_grad():
        outputs = [experts(*batch) for batch in batches]
        monkeypatch.setattr(routing_module, "HAS_TRITON", False)
        for batch, out in zip(batches, outputs):
            assert torch.equal(out, experts(*batch))


@requires_cuda
def test_gpu_experts_pick_their_route_again_on_the_gpu_and_a_forced_cpu_route_stays_the_reference():
    batches = [routed_batch(48, seed) for seed in range(2)]
    auto = convert(calibrated_experts(batches, act_calibration="max", weight_scale="max"), act_calibration="max", weight_scale="max")
    forced = convert(calibrated_experts(batches, act_calibration="max", weight_scale="max"), act_calibration="max", weight_scale="max", backend="cpu")
    batch = routed_batch(10, seed=1)
    with torch.no_grad():
        expected = auto.experts(*batch)
    cuda_batch = [t.cuda() for t in batch]
    auto.to("cuda")
    forced.to("cuda")
    assert auto.experts.backend == "triton" and forced.experts.backend == "cpu"
    assert grouped_ops_run(forced.experts, cuda_batch) == {"nvfp4_static::grouped_static_nvfp4_linear_reference"}
    enable_clip_monitor(forced)
    compiled = torch.compile(forced.experts, fullgraph=True)
    with torch.no_grad():
        for run in (auto.experts, forced.experts, compiled):
            out = run(*cuda_batch)
            assert out.is_cuda and relative_error(out.cpu(), expected) <= 2e-2  # as the GPU test above says
    # The gate/up inputs are the batch's rows themselves (the down inputs may round otherwise on the GPU).
    counts = {name: (c.clipped, c.seen) for name, c in clip_counts(forced).items() if ".gate_up_proj." in name}
    recount = expected_clip_counts(forced.to("cpu").experts, [batch, batch])
    assert counts == {name: c[:2] for name, c in recount.items() if ".gate_up_proj." in name}
