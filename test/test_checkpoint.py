"""load_quantized: a converted model's state_dict loads into a freshly built float model with
nothing but the checkpoint, and a refused load leaves the model as it was."""

import pytest
import torch
from torchao.quantization import quantize_

from conftest import DIM, all_but_lm_head, calibration_batches, make, quantized
from models import MLP, TransformerBlock
from nvfp4_static import (
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    load_quantized,
)


class TinyLM(torch.nn.Module):
    """An embedding, two blocks and an ``lm_head``: the layout LLM checkpoints have."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, DIM)
        self.layers = torch.nn.ModuleList([TransformerBlock(), TransformerBlock()])
        self.lm_head = torch.nn.Linear(DIM, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def converted_tiny_lm(**config):
    model = make(TinyLM)
    prepare = NVFP4StaticActivationConfig(step="prepare", **config)
    quantize_(model, prepare, filter_fn=all_but_lm_head)
    with torch.no_grad():
        for seed in range(3):
            model(torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(seed)))
    convert = NVFP4StaticActivationConfig(step="convert", **config)
    quantize_(model, convert, filter_fn=all_but_lm_head)
    return model


@pytest.mark.parametrize("weight_scale", ["mse", "max"])
def test_a_model_quantized_with_a_filter_loads_with_no_filter_and_no_config(weight_scale):
    model = converted_tiny_lm(weight_scale=weight_scale)
    fresh = make(TinyLM, seed=1)
    load_quantized(fresh, model.state_dict())
    assert type(fresh.lm_head) is torch.nn.Linear
    converted = [n for n, m in fresh.named_modules() if isinstance(m, NVFP4StaticLinear)]
    assert converted == [n for n, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)]
    assert len(converted) == 2 * 4  # qkv, proj, mlp.up, mlp.down per block
    assert fresh.layers[0].qkv.recipe == {"act_calibration": "b_min", "weight_scale": weight_scale}
    assert fresh.layers[1].mlp.down.layer_name == "layers.1.mlp.down"
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_a_checkpoint_file_loads_from_its_path(tmp_path):
    model = quantized(make(MLP))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = load_quantized(make(MLP, seed=1), tmp_path / "model.pt")
    x = calibration_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_a_float_checkpoint_loads_as_float():
    state = make(MLP).state_dict()
    fresh = load_quantized(make(MLP, seed=1), state)
    assert type(fresh.up) is torch.nn.Linear and torch.equal(fresh.up.weight, state["up.weight"])


def unchanged(model, before):
    """Every module is the one it was and every float tensor holds what it held."""
    assert [type(m) for m in model.modules()] == [type(m) for m in before["types"]]
    for name, tensor in model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(tensor, before["state"][name]), name


def snapshot(model):
    return {"types": list(model.modules()), "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize(
    "make_target, match",
    [
        (lambda: MLP(dim=DIM, hidden=256), "size mismatch"),
        (lambda: torch.nn.Sequential(), "does not have"),
        (lambda: TransformerBlock(), "does not have"),
    ],
    ids=["other_shapes", "empty_model", "other_architecture"],
)
def test_a_checkpoint_of_another_model_is_refused_and_leaves_the_model_as_it_was(make_target, match):
    state = quantized(make(MLP)).state_dict()
    torch.manual_seed(1)
    target = make_target()
    before = snapshot(target)
    with pytest.raises((RuntimeError, ValueError), match=match):
        load_quantized(target, state)
    unchanged(target, before)


@pytest.mark.parametrize(
    "backend, match",
    [("blackwell", r"load_quantized into a model: backend 'blackwell' .*sm100\+\), but it is on cpu"),
     ("", r"unknown backend '' \(from the backend argument\)"), (False, "unknown backend False"),
     ("gpu", "unknown backend 'gpu'")],
    ids=["blackwell on cpu", "empty string", "false", "unknown name"],
)
def test_a_backend_that_cannot_run_here_is_refused_and_leaves_the_model_as_it_was(backend, match):
    """The blackwell route loaded on a CPU failed at the first forward, deep in the GEMM; an
    empty or false backend meant auto."""
    state = quantized(make(MLP)).state_dict()
    target = make(MLP, seed=1)
    before = snapshot(target)
    with pytest.raises(ValueError, match=match):
        load_quantized(target, state, backend=backend)
    unchanged(target, before)


def test_loading_into_a_prepared_model_is_refused_and_leaves_it_as_it_was():
    """Layers the checkpoint leaves float stayed prepared, observing every later call."""
    state = quantized(make(MLP)).state_dict()
    target = make(MLP, seed=1)
    quantize_(target, NVFP4StaticActivationConfig(step="prepare"), filter_fn=all_but_lm_head)
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"load_quantized: the model holds prepared layers \(first: 'up'\)"):
        load_quantized(target, state)
    unchanged(target, before)


def test_a_converted_layer_where_the_model_has_no_linear_is_refused():
    state = quantized(make(MLP)).state_dict()

    class NotLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Conv1d(DIM, 128, 1)
            self.down = torch.nn.Linear(128, DIM)

    target = NotLinear()
    before = snapshot(target)
    with pytest.raises(ValueError, match="'up'.*Conv1d"):
        load_quantized(target, state)
    unchanged(target, before)


def test_a_checkpoint_missing_a_tensor_is_refused_and_the_model_stays_float():
    state = quantized(make(MLP)).state_dict()
    del state["down.bias"]
    target = make(MLP, seed=1)
    before = snapshot(target)
    with pytest.raises(RuntimeError, match="down.bias"):
        load_quantized(target, state)
    unchanged(target, before)


def test_a_float_weight_where_the_model_expects_nvfp4_is_refused_before_anything_is_copied():
    """A checkpoint that marks 'up' converted but carries a float weight for it."""
    state = quantized(make(MLP)).state_dict()
    state["up.weight"] = torch.zeros(128, DIM)
    target = make(MLP, seed=1)
    before = snapshot(target)
    with pytest.raises(RuntimeError, match="'up.weight' is a Tensor in the checkpoint"):
        load_quantized(target, state)
    unchanged(target, before)
