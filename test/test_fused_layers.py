"""Fusion-group tying: layers an engine runs as one GEMM convert with one weight and one
activation global amax, the weight's fixed before the FP8 block-scale sweep."""

import copy

import pytest
import torch
from torchao.quantization import quantize_

from tiny_llama import all_but_lm_head, convert_llama, prepared_and_calibrated, tiny_llama
from nvfp4_static import (
    NVFP4BMinCalibrator,
    NVFP4MSECalibrator,
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    export_checkpoint,
    find_fusion_groups,
    is_quantizable,
    tie_fused_layers,
)
from nvfp4_static.numerics import BLOCK_SIZE, per_tensor_amax_to_scale, quantize_nvfp4

LAYER0 = "model.layers.0"
QKV = tuple(f"{LAYER0}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj"))


def test_find_fusion_groups_names_each_llama_group():
    groups = find_fusion_groups(tiny_llama())
    assert len(groups) == 4  # q/k/v and gate/up in each of the two layers
    assert QKV in groups
    assert (f"{LAYER0}.mlp.gate_proj", f"{LAYER0}.mlp.up_proj") in groups


def test_after_convert_every_group_shares_its_weight_and_input_scales():
    model = prepared_and_calibrated(tiny_llama(), weight_scale="max")
    weight_amaxes = {n: float(model.get_submodule(n).weight.detach().abs().amax()) for n in QKV}
    tied = tie_fused_layers(model)
    convert_llama(model, weight_scale="max")
    assert len(tied) == 4
    for names in tied:
        weights = [model.get_submodule(name).weight for name in names]
        assert all(torch.equal(w.per_tensor_scale, weights[0].per_tensor_scale) for w in weights)
        assert all(torch.equal(w.act_per_tensor_scale, weights[0].act_per_tensor_scale) for w in weights)
    group_amax = torch.tensor(max(weight_amaxes.values()))
    assert torch.equal(
        model.get_submodule(QKV[1]).weight.per_tensor_scale, per_tensor_amax_to_scale(group_amax)
    )


def test_the_block_scale_sweep_runs_against_the_shared_weight_amax():
    """k_proj's weight is shrunk so that its own max is a quarter of the group's: block scales
    swept under its own amax, then stored under the shared one, would differ (checked below), so
    this fails if the tie happened after the sweep."""
    model = tiny_llama()
    with torch.no_grad():
        model.get_submodule(QKV[1]).weight.mul_(0.25)
    k_weight = model.get_submodule(QKV[1]).weight.detach().clone()
    group_amax = max(model.get_submodule(n).weight.detach().abs().amax() for n in QKV)
    prepared_and_calibrated(model, weight_scale="mse")
    tie_fused_layers(model)
    convert_llama(model, weight_scale="mse")

    blocks = torch.empty(k_weight.shape[0], k_weight.shape[1] // BLOCK_SIZE)
    swept_shared = NVFP4MSECalibrator(blocks, group_amax)
    swept_shared.collect(k_weight)
    swept_own = NVFP4MSECalibrator(blocks, k_weight.abs().amax())
    swept_own.collect(k_weight)
    assert not torch.equal(
        swept_own.block_scales_e4m3.float(), swept_shared.block_scales_e4m3.float()
    )

    stored = model.get_submodule(QKV[1]).weight
    assert torch.equal(stored.scale.float(), swept_shared.block_scales_e4m3.float())
    qdata, _ = quantize_nvfp4(
        k_weight, per_tensor_amax_to_scale(group_amax), swept_shared.block_scales_e4m3
    )
    assert torch.equal(stored.qdata, qdata)


class _TwoInputs(torch.nn.Module):
    """Siblings ``a`` and ``b`` read different inputs, so tying has something to merge."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.a(x) + self.b(3 * x)


@pytest.mark.parametrize("act_calibration", ["max", "mse"])
def test_user_groups_share_the_larger_input_scale(act_calibration):
    """max calibrators are merged (the max of both); the MSE search cannot be merged, so the group
    takes the member calibrator with the larger amax. Either way b's 3x larger input sets it."""
    model, untied = _two_inputs_tied_and_untied(act_calibration)
    for name in ("a", "b"):
        assert torch.equal(
            model.get_submodule(name).weight.act_per_tensor_scale,
            untied.b.weight.act_per_tensor_scale,
        )
    assert untied.a.weight.act_per_tensor_scale < untied.b.weight.act_per_tensor_scale


def test_user_groups_merge_their_histograms():
    """The B_min recipe reads percentiles of the merged histogram: as if one calibrator had
    seen both layers' inputs."""
    model, _ = _two_inputs_tied_and_untied("b_min")
    both = NVFP4BMinCalibrator()
    both.collect(_TWO_INPUTS_BATCH)
    both.collect(3 * _TWO_INPUTS_BATCH)
    expected = per_tensor_amax_to_scale(both.compute_amax())
    for name in ("a", "b"):
        assert torch.equal(model.get_submodule(name).weight.act_per_tensor_scale, expected)


_TWO_INPUTS_BATCH = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))


def _two_inputs_tied_and_untied(act_calibration):
    torch.manual_seed(0)
    model = _TwoInputs()
    config = dict(act_calibration=act_calibration, weight_scale="max")
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", **config), filter_fn=is_quantizable)
    with torch.no_grad():
        model(_TWO_INPUTS_BATCH)
    untied = convert_llama(copy.deepcopy(model), filter_fn=is_quantizable, **config)
    assert tie_fused_layers(model, groups=[("a", "b")]) == [("a", "b")]
    return convert_llama(model, filter_fn=is_quantizable, **config), untied


def test_tying_twice_changes_nothing():
    model = prepared_and_calibrated(tiny_llama(), weight_scale="max")
    tie_fused_layers(model)
    once = copy.deepcopy(model)
    tie_fused_layers(model)
    convert_llama(model, weight_scale="max")
    convert_llama(once, weight_scale="max")
    for name in QKV:
        a, b = model.get_submodule(name).weight, once.get_submodule(name).weight
        assert torch.equal(a.act_per_tensor_scale, b.act_per_tensor_scale)
        assert torch.equal(a.per_tensor_scale, b.per_tensor_scale)


def test_tying_a_converted_model_is_refused_and_changes_nothing():
    model = convert_llama(prepared_and_calibrated(tiny_llama(), weight_scale="max"), weight_scale="max")
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"q_proj.*already converted.*before quantize_"):
        tie_fused_layers(model)
    for (name, layer), original in zip(model.named_modules(), before.modules()):
        if isinstance(layer, NVFP4StaticLinear):
            for field in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
                assert torch.equal(getattr(layer.weight, field), getattr(original.weight, field)), name


@pytest.mark.parametrize(
    "groups, widths",
    [([("gate_proj", "down_proj")], r"\{'model.layers.0.mlp.gate_proj': 64, 'model.layers.0.mlp.down_proj': 128\}"),
     ([("q_proj", "k_proj"), ("up_proj", "down_proj")], r"\{'model.layers.0.mlp.up_proj': 64, '.*down_proj': 128\}"),
     ([("gate_proj", "up_proj", "down_proj")], r"\{'.*gate_proj': 64, '.*up_proj': 64, '.*down_proj': 128\}")],
    ids=["gate with down", "a good group, then a bad one", "three members"],
)
def test_a_group_of_linears_reading_different_widths_is_refused_and_changes_nothing(groups, widths):
    model = prepared_and_calibrated(tiny_llama(), weight_scale="max")
    calibrators = {name: m.act_calibrator for name, m in model.named_modules() if hasattr(m, "act_calibrator")}
    with pytest.raises(ValueError, match=rf"cannot tie fusion group .* different widths {widths}"):
        tie_fused_layers(model, groups=groups)
    for name, module in model.named_modules():
        if name in calibrators:
            assert module.act_calibrator is calibrators[name] and module.tied_weight_global_amax is None, name


def test_untied_groups_are_refused_at_export_unless_the_check_is_skipped(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.get_submodule(QKV[1]).weight.mul_(0.25)  # k_proj's own scale now differs
    convert_llama(prepared_and_calibrated(model, weight_scale="max"), weight_scale="max")
    with pytest.raises(ValueError, match=r"q_proj.*k_proj.*v_proj.*not tied.*tie_fused_layers"):
        export_checkpoint(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    export_checkpoint(model, tmp_path / "export", fusion_groups=())
    assert (tmp_path / "export" / "config.json").is_file()


def test_a_partly_quantized_group_is_refused_at_export(tmp_path):
    def without_k_proj(module, fqn):
        return all_but_lm_head(module, fqn) and not fqn.endswith("k_proj")

    model = prepared_and_calibrated(tiny_llama(), filter_fn=without_k_proj, weight_scale="max")
    tie_fused_layers(model)
    convert_llama(model, filter_fn=without_k_proj, weight_scale="max")
    assert isinstance(model.get_submodule(QKV[0]), NVFP4StaticLinear)
    with pytest.raises(ValueError, match=r"partly quantized.*k_proj"):
        export_checkpoint(model, tmp_path / "export")


@pytest.mark.parametrize(
    "groups, error, message",
    [("q_proj", TypeError, "fusion groups must be"), (["q_proj", "k_proj"], TypeError, "each fusion group must"),
     ([("self_attn.q_proj", "x")], ValueError, "names a nested module"), ([3], TypeError, "each fusion group must"),
     ([("q_proj", "q_proj")], ValueError, r"\('q_proj', 'q_proj'\) names a linear twice"),
     ([("gate_proj", "up_proj", "up_proj")], ValueError, "names a linear twice"),
     ([("q_proj", "k_proj"), ("k_proj", "v_proj")], ValueError,
      r"'model.layers.0.self_attn.k_proj' is in two fusion groups"),
     ([("gate_proj", "up_proj"), ("up_proj", "gate_proj")], ValueError, "is in two fusion groups")],
    ids=["a string", "a list of strings", "a dotted name", "a number", "a name twice", "a name twice of three",
         "overlapping groups", "one group twice"],
)
def test_malformed_groups_are_refused_and_change_nothing(groups, error, message):
    """A name twice fused a linear with itself (its weight stored twice in the group's GEMM);
    overlapping groups reported both tied while their members' scales differed."""
    model = prepared_and_calibrated(tiny_llama(), weight_scale="max")
    calibrators = {name: m.act_calibrator for name, m in model.named_modules() if hasattr(m, "act_calibrator")}
    with pytest.raises(error, match=message):
        tie_fused_layers(model, groups=groups)
    with pytest.raises(error, match=message):
        find_fusion_groups(model, groups)
    for name, module in model.named_modules():
        if name in calibrators:
            assert module.act_calibrator is calibrators[name] and module.tied_weight_global_amax is None, name


def test_groups_given_as_iterators_are_read_once_and_found():
    """The check read a generator to its end, leaving the search nothing: no group tied."""
    model = prepared_and_calibrated(tiny_llama(), weight_scale="max")
    standard = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    expected = find_fusion_groups(model, standard)
    assert find_fusion_groups(model, (group for group in standard)) == expected
    assert find_fusion_groups(model, [iter(group) for group in standard]) == expected
    assert tie_fused_layers(model, (group for group in standard)) == expected
