"""Layer-by-layer calibration (nvfp4_static.layerwise) against whole-model calibration."""

import functools
import threading
import time

import pytest
import torch
from conftest import requires_cuda

from distributed_worker import converted_scales
from tiny_llama import all_but_lm_head, convert_llama, logits, prepared_and_calibrated, tiny_llama, token_ids

from nvfp4_static import (
    NVFP4StaticActivationConfig,
    calibrate_layer_by_layer,
    calibrate_model,
    smooth_norm_inputs,
    workflow,
)
from nvfp4_static.layer_mover import LayerMover
from nvfp4_static.layerwise import (
    _capture_layer_inputs,
    _default_forward,
    _move_outside,
    _put_back,
    find_decoder_layers,
)
from nvfp4_static.linear import NVFP4StaticLinear

BATCHES = (0, 1)  # the token_ids seeds prepared_and_calibrated feeds the whole model


def whole_model(act, weight, smooth=True):
    """The whole-model run calibrate_layer_by_layer's defaults equal: the norms smoothed from
    the first batch, then prepare, both batches, convert."""
    config = dict(act_calibration=act, weight_scale=weight)
    model = tiny_llama()
    if smooth:
        smooth_norm_inputs(model, lambda m: m(token_ids(BATCHES[0])))
    return convert_llama(prepared_and_calibrated(model, **config), **config)


def layer_by_layer(act, weight, model=None, seeds=BATCHES, **options):
    config = NVFP4StaticActivationConfig(act_calibration=act, weight_scale=weight)
    batches = [token_ids(seed) for seed in seeds]
    options.setdefault("device", "cpu")  # the whole-model runs it is compared with are on CPU
    options.setdefault("filter_fn", all_but_lm_head)
    return calibrate_layer_by_layer(model or tiny_llama(), batches, config, progress=False, **options)


@pytest.mark.parametrize(
    "act, weight, cache_device, smooth",
    [("b_min", "hessian_mse", "cpu", True), ("mse", "mse", None, True), ("percentile", "max", None, True),
     ("max", "hessian_mse", None, True), ("b_min", "hessian_mse", None, False)],
)
def test_layer_by_layer_equals_whole_model_bit_for_bit(act, weight, cache_device, smooth):
    whole = whole_model(act, weight, smooth)
    layered = layer_by_layer(act, weight, cache_device=cache_device, smooth_alpha=0.5 if smooth else None)
    a, b = converted_scales(whole), converted_scales(layered)
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name
    assert not isinstance(layered.lm_head, NVFP4StaticLinear)
    assert torch.equal(logits(whole, seed=7), logits(layered, seed=7))


def with_outlier_channels(model):
    """A few channels of every norm 30x the others, as in trained models' norms."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[::9] *= 30
            layer.post_attention_layernorm.weight[::9] *= 30
    return model


def test_smoothing_changes_the_norm_fed_layers_scales_and_lowers_their_error():
    float_logits = logits(with_outlier_channels(tiny_llama()), seed=7)
    smoothed = layer_by_layer("b_min", "hessian_mse", model=with_outlier_channels(tiny_llama()))
    plain = layer_by_layer("b_min", "hessian_mse", model=with_outlier_channels(tiny_llama()),
                           smooth_alpha=None)
    a, b = converted_scales(smoothed), converted_scales(plain)
    for name in a:
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert not all(torch.equal(x, y) for x, y in zip(a[name], b[name])), name
    error = {key: (logits(model, seed=7) - float_logits).square().mean()
             for key, model in (("smoothed", smoothed), ("plain", plain))}
    assert error["smoothed"] < 0.9 * error["plain"]


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_a_bad_smoothing_alpha_is_refused_and_nothing_changes(alpha):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"smooth_alpha={alpha!r} must be a number in"):
        layer_by_layer("b_min", "mse", model=model, smooth_alpha=alpha)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(seeds=()), "needs at least one calibration batch"),
        (dict(filter_fn=lambda m, fqn: False), r"filter_fn selects no linear layer .* in model.layers"),
        (dict(filter_fn=lambda m, fqn: fqn == "lm_head"), r"filter_fn selects no linear layer .* in model.layers"),
        (dict(filter_fn=lambda m, fqn: fqn.startswith("layers.")), r"filter_fn selects no linear layer"),
    ],
    ids=["no batches", "filter selects nothing", "filter selects only lm_head", "filter of names without the prefix"],
)
def test_a_call_with_nothing_to_calibrate_is_refused_and_nothing_changes(options, message):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=message):
        layer_by_layer("b_min", "hessian_mse", model=model, **options)
    assert [type(m) for m in model.modules()] == kinds
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "flag, value",
    [("propagate_quantized", "False"), ("offload", "no"), ("progress", 0), ("prefetch", "yes")],
    ids=["propagate_quantized string", "offload string", "progress zero", "prefetch string"],
)
def test_a_flag_that_is_not_a_bool_is_refused_and_nothing_changes(flag, value):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"progress": False, flag: value}
    with pytest.raises(TypeError, match=f"calibrate_layer_by_layer: {flag}={value!r} must be True or False"):
        calibrate_layer_by_layer(model, [token_ids(0)], filter_fn=all_but_lm_head, device="cpu", **options)
    assert all(type(m) is not NVFP4StaticLinear for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


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


def test_recording_the_first_layer_inputs_moves_only_what_runs_before_it():
    """lm_head (a GiB at a 128k vocabulary) must not reach the device for the recording."""
    model, cpu = tiny_llama(), torch.device("cpu")
    _, layers = find_decoder_layers(model)
    hooks, moves = _move_outside(model, layers, cpu)
    _capture_layer_inputs(model, layers, [token_ids(0)], _default_forward, cpu, cpu)
    for hook in hooks:
        hook.remove()
    moved = [slot[0] for slot, _, _ in moves]
    assert {name for name, m in model.named_modules() if any(m is x for x in moved)} == {
        "model.embed_tokens", "model.rotary_emb"}


def test_after_the_recording_the_moved_modules_get_their_own_tensors_back(monkeypatch):
    """Put back, not copied back (a GiB for a 128k-vocabulary embedding), except a buffer the
    forward replaced, which is moved home."""
    model, cpu = tiny_llama(), torch.device("cpu")
    _, layers = find_decoder_layers(model)
    embedding, rotary = model.model.embed_tokens, model.model.rotary_emb
    weight, inv_freq = embedding.weight.data, rotary.inv_freq
    replaced = torch.full_like(inv_freq, 3.0)
    hooks, moves = _move_outside(model, layers, cpu)
    hooks.append(rotary.register_forward_pre_hook(  # after the move, as dynamic RoPE does
        lambda module, args: module.register_buffer("inv_freq", replaced, persistent=False)))
    _capture_layer_inputs(model, layers, [token_ids(0)], _default_forward, cpu, cpu)
    for hook in hooks:
        hook.remove()
    copied, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copied.append(self) or to(self, *a, **k))
    _put_back(moves, cpu)
    assert len(copied) == 1 and copied[0] is replaced
    assert embedding.weight.data.data_ptr() == weight.data_ptr()
    assert rotary.inv_freq is replaced and rotary.inv_freq is not inv_freq
    assert moves == []  # nothing keeps the device copies alive


def sliding_window_qwen3():
    """Layers 0 and 2 attend to every earlier token, layer 1 to the last 4: the model hands
    layer 1 another attention mask than the others."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, use_sliding_window=True,
                         sliding_window=4, layer_types=["full_attention", "sliding_attention", "full_attention"])
    return Qwen3ForCausalLM._from_config(config, dtype=torch.float32).eval()


def test_a_model_left_in_training_mode_is_calibrated_in_eval_mode_and_given_its_modes_back():
    """With attention dropout on, calibration would see activations the served model never does."""
    evaluated = layer_by_layer("max", "max", tiny_llama(attention_dropout=0.5).eval())
    trained = tiny_llama(attention_dropout=0.5).train()
    trained.model.norm.eval()  # a module's own mode comes back too
    layer_by_layer("max", "max", trained)
    a, b = converted_scales(evaluated), converted_scales(trained)
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name])), name
    assert trained.training and trained.model.layers[1].self_attn.training and not trained.model.norm.training
    assert all(m.training for m in trained.modules() if isinstance(m, NVFP4StaticLinear))
    assert not any(m.training for m in evaluated.modules())


def test_each_layer_is_replayed_with_the_arguments_the_model_gives_it():
    model, cpu = sliding_window_qwen3(), torch.device("cpu")
    _, layers = find_decoder_layers(model)
    hidden, calls = _capture_layer_inputs(model, layers, [token_ids(0), token_ids(1)], _default_forward, cpu, cpu)
    assert len(hidden) == len(calls) == 2 and all(len(batch) == 3 for batch in calls)
    for first, sliding, last in calls:
        assert last is first  # the same objects: recorded once
        full_mask, sliding_mask = first[1]["attention_mask"], sliding[1]["attention_mask"]
        assert torch.is_tensor(sliding_mask)  # full attention's may be None (causal in the kernel)
        assert full_mask is None or not torch.equal(full_mask, sliding_mask)
        assert first[0][0] is None and sliding[0][0] is None  # the hidden states, given positionally
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_layer_by_layer_equals_whole_model_where_layers_get_different_masks():
    config = NVFP4StaticActivationConfig(weight_scale="mse")
    batches = [token_ids(seed, length=32) for seed in BATCHES]
    whole = calibrate_model(sliding_window_qwen3(), batches, config, filter_fn=all_but_lm_head, progress=False)
    layered = calibrate_layer_by_layer(sliding_window_qwen3(), batches, config, device="cpu",
                                       filter_fn=all_but_lm_head, progress=False)
    a, b = converted_scales(whole), converted_scales(layered)
    assert a.keys() == b.keys() and len(a) == 21
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name])), name


def test_a_forward_of_its_own_that_a_layer_holds_is_given_back():
    """accelerate's hooks replace a module's forward on the instance."""
    model = tiny_llama()
    _, layers = find_decoder_layers(model)
    wrapped = layers[1].forward
    layers[1].forward = lambda *args, **kwargs: wrapped(*args, **kwargs)
    own = layers[1].forward
    layer_by_layer("b_min", "max", model=model)
    assert layers[1].__dict__["forward"] is own and "forward" not in layers[0].__dict__


class Stack(torch.nn.Module):
    """Three layers, called in the order ``calls`` gives (indices into them)."""

    def __init__(self, calls):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32)) for _ in range(3))
        self.calls = calls

    def forward(self, x, use_cache=False):
        for index in self.calls:
            x = self.layers[index](x)
        return x


@pytest.mark.parametrize("model, message", [
    (Stack(calls=[2, 1, 0]), "called decoder layer 2 after 0 of its layers"),
    (Stack(calls=[0, 0, 1, 2]), "called decoder layer 0 after 1 of its layers"),
    (Stack(calls=[0, 1]), "called 2 of its 3 decoder layers"),
    (Stack(calls=[]), "called 0 of its 3 decoder layers"),
], ids=["reversed", "a_layer_called_twice", "the_last_layer_never_called", "no_layer_called"])
def test_a_forward_that_does_not_call_each_layer_once_in_order_is_refused(model, message):
    with pytest.raises(RuntimeError, match=message):
        calibrate_layer_by_layer(model, [torch.randn(4, 32)], device="cpu", progress=False, smooth_alpha=None)
    assert all(type(layer[0]) is torch.nn.Linear and "forward" not in layer.__dict__ for layer in model.layers)


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
    assert "where it went (s, rank 0): record inputs " in out and ", calibrate " in out
    assert "scales equal to one process calibrating the whole model (28 layers): True" in out


# --- moving layers: prefetched, moved back in the background, timed --------------------------------


def assert_same_scales(a, b):
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name])), name


def mover_threads() -> int:
    return sum(t.name.startswith("nvfp4_static-layer-mover") for t in threading.enumerate())


def test_prefetched_layers_give_the_whole_model_scales(monkeypatch):
    copied, stage = [], LayerMover._stage
    monkeypatch.setattr(LayerMover, "_stage", lambda self, sources: copied.append(len(sources))
                        or stage(self, sources))
    layered = layer_by_layer("b_min", "mse", prefetch=True)
    assert len(copied) == 2  # each layer's tensors went through the worker
    assert_same_scales(converted_scales(whole_model("b_min", "mse")), converted_scales(layered))
    assert mover_threads() == 0


def test_a_failure_mid_layer_raises_it_and_stops_the_mover():
    model = tiny_llama()
    with pytest.raises(Interrupted):
        layer_by_layer("b_min", "mse", model=model, prefetch=True, filter_fn=interrupted_after_layer_0)
    assert mover_threads() == 0
    assert {name.split(".")[2] for name in converted_layers(model)} == {"0"}


def test_the_phase_timings_cover_each_step_and_add_up_to_at_most_the_wall_time():
    timings = {}
    start = time.perf_counter()
    layer_by_layer("b_min", "mse", timings=timings, prefetch=True)
    wall = time.perf_counter() - start
    assert {"record inputs", "move in", "prepare", "calibrate", "convert", "move back"} <= timings.keys()
    assert all(seconds >= 0 for seconds in timings.values())
    assert sum(timings.values()) <= wall


def device_types(model) -> set:
    """Where the state dict's tensors are (a converted layer's entries include a dict)."""
    return {t.device.type for t in model.state_dict().values() if isinstance(t, torch.Tensor)}


@requires_cuda
@pytest.mark.parametrize("cache_device", [None, "cpu"], ids=["cache on GPU", "cache on CPU"])
def test_on_cuda_prefetch_equals_plain_moves_and_every_layer_goes_home(cache_device):
    plain = layer_by_layer("b_min", "mse", device="cuda", prefetch=False, cache_device=cache_device)
    prefetched = layer_by_layer("b_min", "mse", device="cuda", prefetch=True, cache_device=cache_device)
    assert_same_scales(converted_scales(plain), converted_scales(prefetched))
    for model in (plain, prefetched):
        assert device_types(model) == {"cpu"}


@requires_cuda
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_on_cuda_a_failure_mid_layer_leaves_every_layer_home(prefetch):
    model = tiny_llama()
    with pytest.raises(Interrupted):
        layer_by_layer("b_min", "mse", model=model, device="cuda", prefetch=prefetch,
                       filter_fn=interrupted_after_layer_0)
    assert device_types(model) == {"cpu"}


# --- resuming from a folder of finished layers ---------------------------------------------------


class Interrupted(Exception):
    pass


def interrupted_after_layer_0(module, fqn):
    if fqn.startswith("model.layers.1."):
        raise Interrupted  # as a crash would, after layer 0 is converted and saved
    return all_but_lm_head(module, fqn)


def converted_layers(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)}


@pytest.mark.parametrize("propagate", [False, True], ids=["float outputs", "propagated"])
def test_a_run_resumed_after_a_crash_equals_one_that_never_stopped(tmp_path, monkeypatch, propagate):
    recipe = ("b_min", "hessian_mse")
    uninterrupted = layer_by_layer(*recipe, propagate_quantized=propagate)
    with pytest.raises(Interrupted):
        layer_by_layer(*recipe, propagate_quantized=propagate, resume_dir=tmp_path,
                       filter_fn=interrupted_after_layer_0)
    swept = []
    sweep = workflow.sweep_weight_block_scales
    monkeypatch.setattr(workflow, "sweep_weight_block_scales",
                        lambda module, *args: swept.append(module.layer_name) or sweep(module, *args))
    resumed = layer_by_layer(*recipe, propagate_quantized=propagate, resume_dir=tmp_path)
    assert len(swept) == 7 and all(name.startswith("model.layers.1.") for name in swept)
    ours, theirs = converted_scales(resumed), converted_scales(uninterrupted)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name in ours:
        assert all(torch.equal(x, y) for x, y in zip(ours[name], theirs[name])), name
    for (name, a), (_, b) in zip(converted_layers(resumed).items(), converted_layers(uninterrupted).items()):
        assert (a.layer_name, a.calibration_stats) == (b.layer_name, b.calibration_stats)
    assert torch.equal(logits(resumed, seed=7), logits(uninterrupted, seed=7))


def without_q_proj(module, fqn):
    return all_but_lm_head(module, fqn) and not fqn.endswith("q_proj")


def run_on_prefix(model, batch, length):
    return model(batch[:, :length], use_cache=False)


def test_a_forward_resumes_where_its_code_is_the_same(tmp_path):
    """A rerun's forward is defined anew, elsewhere in the script: the same code resumes, other
    code is refused."""
    first = lambda model, batch: model(batch, use_cache=False)  # noqa: E731

    with pytest.raises(Interrupted):
        layer_by_layer("max", "max", resume_dir=tmp_path, filter_fn=interrupted_after_layer_0, forward=first)
    other = lambda model, batch: model(batch[:, :8], use_cache=False)  # noqa: E731
    with pytest.raises(ValueError, match="'forward.code sha256' is '[0-9a-f]+' there and '[0-9a-f]+' now"):
        layer_by_layer("max", "max", resume_dir=tmp_path, forward=other)
    second = lambda model, batch: model(batch, use_cache=False)  # noqa: E731
    resumed = converted_scales(layer_by_layer("max", "max", resume_dir=tmp_path, forward=second))
    uninterrupted = converted_scales(layer_by_layer("max", "max"))
    assert resumed.keys() == uninterrupted.keys() and len(resumed) == 14
    for name in resumed:
        assert all(torch.equal(x, y) for x, y in zip(resumed[name], uninterrupted[name])), name


@pytest.mark.parametrize(
    "rerun, names",
    [
        (dict(act="percentile"), "'config.act_calibration' is 'b_min' there and 'percentile' now"),
        (dict(weight="hessian_mse"), "'config.weight_scale' is 'mse' there and 'hessian_mse' now"),
        (dict(seeds=(0, 2)), "'batches of each rank[0]'"),
        (dict(propagate_quantized=True), "'propagate_quantized' is False there and True now"),
        (dict(model_seed=1), "layer 0 (model.layers.0) differs at 'tensors.mlp.down_proj.weight.sampled sha256'"),
        (dict(filter_fn=without_q_proj), "layer 0 (model.layers.0) differs at 'selected"),
        (dict(smooth_alpha=None), "'smooth_alpha' is 0.5 there and None now"),
        (dict(smooth_alpha=0.25), "'smooth_alpha' is 0.5 there and 0.25 now"),
        (dict(forward=functools.partial(run_on_prefix, length=8)),
         "'forward.name' is 'nvfp4_static.layerwise._default_forward' there and 'test_layerwise.run_on_prefix' now"),
    ],
    ids=["act recipe", "weight recipe", "data", "propagation", "weights", "filter", "no smoothing",
         "smoothing alpha", "forward"],
)
def test_a_resume_folder_of_another_run_is_refused_and_nothing_changes(tmp_path, rerun, names):
    with pytest.raises(Interrupted):
        layer_by_layer("b_min", "mse", resume_dir=tmp_path, filter_fn=interrupted_after_layer_0)
    saved = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    options = {"act": "b_min", "weight": "mse", **rerun}
    model = tiny_llama(seed=options.pop("model_seed", 0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="holds layers of another run") as refused:
        layer_by_layer(options.pop("act"), options.pop("weight"), model=model, resume_dir=tmp_path, **options)
    assert names in str(refused.value)
    assert not converted_layers(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == saved


def test_a_damaged_resume_folder_is_refused_clearly(tmp_path):
    with pytest.raises(Interrupted):
        layer_by_layer("b_min", "mse", resume_dir=tmp_path, filter_fn=interrupted_after_layer_0)
    (tmp_path / "layer_00000.pt").unlink()
    with pytest.raises(ValueError, match="layer_00000.pt, which progress.json lists, is missing"):
        layer_by_layer("b_min", "mse", resume_dir=tmp_path)
    (tmp_path / "progress.json").write_text("{not json")
    with pytest.raises(ValueError, match="its progress.json cannot be read"):
        layer_by_layer("b_min", "mse", resume_dir=tmp_path)


def test_a_linear_two_decoder_layers_share_is_refused_and_nothing_changes():
    """Calibrated with the first layer's inputs alone, it would serve the second layer too."""
    model = tiny_llama()
    model.model.layers[1].self_attn.o_proj = model.model.layers[0].self_attn.o_proj
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj' is the module 'model.layers.0.self_attn.o_proj' "
                                         r"of another decoder layer.*calibrate_model, or leave it out with filter_fn"):
        layer_by_layer("max", "max", model)
    assert not converted_layers(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # Left out by the filter, it stays float and the rest calibrates.
    def without_o_proj(module, fqn):
        return all_but_lm_head(module, fqn) and not fqn.endswith("o_proj")

    layered = layer_by_layer("max", "max", model, filter_fn=without_o_proj)
    assert len(converted_layers(layered)) == 12


def test_a_weight_two_decoder_layers_share_stays_float_and_tied_as_in_the_whole_model_run():
    def tied():
        model = tiny_llama()
        model.model.layers[1].self_attn.o_proj.weight = model.model.layers[0].self_attn.o_proj.weight
        return model

    config = NVFP4StaticActivationConfig(act_calibration="max", weight_scale="max")
    batches = [token_ids(seed) for seed in BATCHES]
    with pytest.warns(UserWarning, match="'model.layers.0.self_attn.o_proj' is left unquantized: its weight is tied"):
        whole = calibrate_model(tied(), batches, config, filter_fn=all_but_lm_head, progress=False, smooth_alpha=None)
    with pytest.warns(UserWarning, match="'model.layers.0.self_attn.o_proj' is left unquantized: its weight is tied"):
        layered = layer_by_layer("max", "max", tied(), smooth_alpha=None)
    layers = layered.model.layers
    assert layers[1].self_attn.o_proj.weight is layers[0].self_attn.o_proj.weight
    a, b = converted_scales(whole), converted_scales(layered)
    assert a.keys() == b.keys() and len(a) == 12
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name])), name
    assert torch.equal(logits(whole, seed=7), logits(layered, seed=7))
