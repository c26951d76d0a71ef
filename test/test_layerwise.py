"""Layer-by-layer calibration (nvfp4_static.layerwise) against whole-model calibration."""

import pytest
import torch

from distributed_worker import converted_scales
from tiny_llama import all_but_lm_head, convert_llama, logits, prepared_and_calibrated, tiny_llama, token_ids

from nvfp4_static import NVFP4StaticActivationConfig, calibrate_layer_by_layer
from nvfp4_static.layerwise import find_decoder_layers
from nvfp4_static.linear import NVFP4StaticLinear

BATCHES = (0, 1)  # the token_ids seeds prepared_and_calibrated feeds the whole model


def whole_model(act, weight):
    config = dict(act_calibration=act, weight_scale=weight)
    return convert_llama(prepared_and_calibrated(tiny_llama(), **config), **config)


def layer_by_layer(act, weight, **options):
    config = NVFP4StaticActivationConfig(act_calibration=act, weight_scale=weight)
    batches = [token_ids(seed) for seed in BATCHES]
    options.setdefault("device", "cpu")  # the whole-model runs it is compared with are on CPU
    return calibrate_layer_by_layer(
        tiny_llama(), batches, config, filter_fn=all_but_lm_head, progress=False, **options
    )


@pytest.mark.parametrize(
    "act, weight, cache_device",
    [("b_min", "hessian_mse", "cpu"), ("mse", "mse", None), ("percentile", "max", None), ("max", "hessian_mse", None)],
)
def test_layer_by_layer_equals_whole_model_bit_for_bit(act, weight, cache_device):
    whole = whole_model(act, weight)
    layered = layer_by_layer(act, weight, cache_device=cache_device)
    a, b = converted_scales(whole), converted_scales(layered)
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name
    assert not isinstance(layered.lm_head, NVFP4StaticLinear)
    assert torch.equal(logits(whole, seed=7), logits(layered, seed=7))


def test_propagating_the_quantized_outputs_changes_only_the_later_layers():
    plain = converted_scales(layer_by_layer("b_min", "hessian_mse"))
    propagated = converted_scales(layer_by_layer("b_min", "hessian_mse", propagate_quantized=True))
    for name in plain:
        same = all(torch.equal(x, y) for x, y in zip(plain[name], propagated[name]))
        assert same == name.startswith("model.layers.0."), name


def test_dict_batches_and_kwargs_reach_every_layer():
    batches = [{"input_ids": token_ids(seed), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
               for seed in BATCHES]
    model = calibrate_layer_by_layer(
        tiny_llama(), batches, NVFP4StaticActivationConfig(weight_scale="max"),
        filter_fn=all_but_lm_head, progress=False, device="cpu",
    )
    assert sum(isinstance(m, NVFP4StaticLinear) for m in model.modules()) == 14


def test_a_model_without_decoder_layers_is_refused_clearly():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="ModuleList named 'layers'"):
        calibrate_layer_by_layer(model, [torch.randn(2, 32)], progress=False, device="cpu")


def test_finds_hugging_face_decoder_layers():
    model = tiny_llama()
    assert find_decoder_layers(model) == ("model.layers", model.model.layers)


def test_calibrate_large_example_checks_its_scales(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "calibrate_large.py"
    spec = importlib.util.spec_from_file_location("calibrate_large", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--batches", "2", "--batch-size", "2", "--seq-len", "16", "--weight", "max"])
    out = capsys.readouterr().out
    assert "layer by layer in" in out
    assert "scales equal to one process calibrating the whole model (28 layers): True" in out
