"""fuse_sibling_linears: a layer's q/k/v and gate/up run as one GEMM and give the members' outputs."""

import copy
import io

import pytest
import torch
from safetensors.torch import load_file
from torchao.utils import unwrap_tensor_subclass
from conftest import requires_cuda
from tiny_llama import convert_llama, converted_llama, logits, prepared_and_calibrated, tiny_llama

import nvfp4_static.tensor
from nvfp4_static import NVFP4StaticLinear, export_checkpoint, fuse_sibling_linears, tie_fused_layers
from nvfp4_static.backends.cpu_eager import EagerCpuKernelCalls
from nvfp4_static.tensor import NVFP4StaticTensor

ATTENTION = "model.layers.0.self_attn"
QKV = tuple(f"{ATTENTION}.{name}" for name in ("q_proj", "k_proj", "v_proj"))
GATE_UP = tuple(f"model.layers.0.mlp.{name}" for name in ("gate_proj", "up_proj"))
HIDDEN = 64


@pytest.fixture(scope="module")
def reference():
    return converted_llama()


def other_llama(seed=1, **config_changes):
    """``converted_llama()`` from other random weights (or another config)."""
    model = prepared_and_calibrated(tiny_llama(seed=seed, **config_changes), weight_scale="max")
    tie_fused_layers(model)
    return convert_llama(model, weight_scale="max")


def fused_copy(model):
    fused = copy.deepcopy(model)
    fuse_sibling_linears(fused)
    return fused


def members(model, names=QKV) -> list[NVFP4StaticLinear]:
    return [model.get_submodule(name) for name in names]


def gemm_counter(monkeypatch) -> list:
    """Records the output width of every linear the layers and the sibling GEMMs run on CPU
    tensors: through their prepared CPU kernel calls (``EagerCpuKernelCalls``), or where those
    do not take a call, through ``static_linear`` (which ``EagerTritonLaunches.linear`` reaches)."""
    widths = []
    original_route, original_call = nvfp4_static.tensor.static_linear, EagerCpuKernelCalls.__call__

    def counting_route(x, weight, bias):
        widths.append(weight.shape[0])
        return original_route(x, weight, bias)

    def counting_call(self, x, weight, bias):
        out = original_call(self, x, weight, bias)
        if out is not None:
            widths.append(weight.shape[0])
        return out

    monkeypatch.setattr(nvfp4_static.tensor, "static_linear", counting_route)
    monkeypatch.setattr(EagerCpuKernelCalls, "__call__", counting_call)
    return widths


def test_each_group_runs_one_gemm_and_the_model_gives_the_same_logits(reference, monkeypatch):
    fused = copy.deepcopy(reference)
    groups = fuse_sibling_linears(fused)
    assert len(groups) == 4 and QKV in groups
    widths = gemm_counter(monkeypatch)
    out = logits(fused)
    per_layer = sorted(widths[: len(widths) // 2])
    # q/k/v (64 + 32 + 32) and gate/up (2 x 128) as one GEMM each; o and down alone.
    assert per_layer == sorted([128, 64, 256, 64]), widths
    monkeypatch.undo()
    torch.testing.assert_close(out, logits(reference), rtol=1e-6, atol=1e-6)


def biased_llama():
    """``other_llama`` with q/k/v, o and MLP biases, drawn at random (transformers starts them at
    zero, which a lost bias would not change)."""
    model = other_llama(seed=2, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, NVFP4StaticLinear):
            module.bias.data.normal_()
    return model


def test_biased_members_give_their_outputs_through_the_groups_bias():
    reference = biased_llama()
    assert reference.get_submodule(QKV[1]).bias is not None
    fused = fused_copy(reference)
    assert fused.get_submodule(QKV[0]).sibling_gemm.bias is not None
    torch.testing.assert_close(logits(fused), logits(reference), rtol=1e-6, atol=1e-6)


CALL_ORDERS = {
    "q, k, v": ["q", "k", "v"],
    "k first": ["k", "q", "v"],
    "q twice": ["q", "q", "k", "v"],
    "v alone": ["v"],
    "k on another input": ["q", "k other", "v", "k"],
    "input changed in place after q": ["q", "change", "k", "v"],
}


@pytest.mark.parametrize("order", CALL_ORDERS.values(), ids=CALL_ORDERS.keys())
@pytest.mark.parametrize("inference_mode", [False, True], ids=["no_grad", "inference_mode"])
def test_members_called_in_any_order_give_their_own_outputs(reference, order, inference_mode):
    """Each member's output is its own: taken from the group's GEMM where that ran on the same,
    unchanged input, computed otherwise."""
    fused = fused_copy(reference)
    own, alone = dict(zip("qkv", members(fused))), dict(zip("qkv", members(reference)))
    torch.manual_seed(0)
    x, other = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    with torch.inference_mode() if inference_mode else torch.no_grad():
        x, other = x.clone(), other.clone()
        for step in order:
            if step == "change":
                x.mul_(2)
                continue
            name, _, which = step.partition(" ")
            given = other if which else x
            torch.testing.assert_close(own[name](given), alone[name](given), rtol=1e-6, atol=1e-6, msg=step)
    assert own["q"].sibling_gemm is not None


def test_under_inference_mode_the_members_run_alone(reference, monkeypatch):
    fused = fused_copy(reference)
    tokens = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    widths = gemm_counter(monkeypatch)
    with torch.inference_mode():
        out = fused(tokens).logits
    # Alone: q 64, k and v 32, o 64, gate and up 128, down 64 wide (fused: q/k/v 128, gate/up 256).
    assert sorted(widths) == sorted([64, 32, 32, 64, 128, 128, 64] * 2), widths
    monkeypatch.undo()
    with torch.inference_mode():
        torch.testing.assert_close(out, reference(tokens).logits, rtol=1e-6, atol=1e-6)


def negated(state_dict: dict) -> dict:
    """``state_dict`` with every NVFP4 weight negated in its packed values alone (each E2M1
    code's sign bit flipped): the scales, and so the weights' metadata, stay."""
    changed = {}
    for key, value in state_dict.items():
        if isinstance(value, NVFP4StaticTensor):
            value = copy.deepcopy(value)
            value.qdata.bitwise_xor_(0x88)
        changed[key] = value
    return changed


def unfused_copy(model):
    """A copy of ``model`` whose members run alone (the reference for its outputs)."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, NVFP4StaticLinear):
            module.sibling_gemm = None
    return copied


def assert_same_global_scales(model, other, names):
    """Each named linear of ``model`` has the global scales of ``other``'s."""
    for name in names:
        got, want = model.get_submodule(name).weight, other.get_submodule(name).weight
        assert torch.equal(got.per_tensor_scale, want.per_tensor_scale), name
        assert torch.equal(got.act_per_tensor_scale, want.act_per_tensor_scale), name


def test_a_checkpoint_with_the_groups_global_scales_loads_into_the_group(reference):
    fused = fused_copy(reference)
    loaded = negated(fused.state_dict())
    before = logits(fused)
    fused.load_state_dict(loaded)
    assert all(m.sibling_gemm is not None for m in members(fused))
    after = logits(fused)
    torch.testing.assert_close(after, logits(unfused_copy(fused)), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(after, before, rtol=1e-2, atol=1e-2)


CHECKPOINTS_WITH_OTHER_SCALES = {
    "tied": lambda: other_llama(),
    "untied": lambda: converted_llama(tie=False),  # q/k/v and gate/up each with their own scales
}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS_WITH_OTHER_SCALES.values(), ids=CHECKPOINTS_WITH_OTHER_SCALES.keys())
def test_a_checkpoint_with_other_global_scales_dissolves_the_group_and_each_member_takes_its_own(reference, checkpoint):
    """The members share the group's global-scale tensors: loaded into them in place, an untied
    checkpoint's scales would overwrite one another."""
    fused, other = fused_copy(reference), checkpoint()
    fused.load_state_dict(other.state_dict())
    assert all(m.sibling_gemm is None for m in members(fused) + members(fused, GATE_UP))
    assert_same_global_scales(fused, other, QKV + GATE_UP)
    torch.testing.assert_close(logits(fused), logits(other), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("member", [QKV[1], GATE_UP[1]], ids=["k_proj", "up_proj"])
def test_a_weight_with_other_global_scales_copied_into_a_member_changes_that_member_alone(reference, member):
    """``copy_`` on a member's weight, not through ``load_state_dict``: its siblings keep their
    scales and outputs, and the member gives the copied weight's."""
    fused, other = fused_copy(reference), other_llama()
    expected = copy.deepcopy(reference)  # unfused: each member holds scale tensors of its own
    with torch.no_grad():
        expected.get_submodule(member).weight.copy_(other.get_submodule(member).weight)
        fused.get_submodule(member).weight.copy_(other.get_submodule(member).weight)
    assert fused.get_submodule(member).sibling_gemm is None
    siblings = [name for name in QKV + GATE_UP if name != member and name.rpartition(".")[0] == member.rpartition(".")[0]]
    assert siblings
    assert_same_global_scales(fused, expected, siblings + [member])
    torch.testing.assert_close(logits(fused), logits(expected), rtol=1e-6, atol=1e-6)


def test_a_weight_with_the_groups_global_scales_copied_into_a_member_keeps_the_group(reference):
    fused = fused_copy(reference)
    source = negated({"w": fused.get_submodule(QKV[1]).weight})["w"]
    with torch.no_grad():
        fused.get_submodule(QKV[1]).weight.copy_(source)
    assert all(m.sibling_gemm is not None for m in members(fused))
    torch.testing.assert_close(logits(fused), logits(unfused_copy(fused)), rtol=1e-6, atol=1e-6)


def test_members_of_a_dissolved_group_take_their_own_global_scales_from_a_checkpoint(reference):
    fused = fused_copy(reference)
    replace_k_weight(fused)  # dissolves the group; q and v still hold its rows
    untied = converted_llama(tie=False)
    fused.load_state_dict(untied.state_dict())
    for name in QKV:
        assert torch.equal(fused.get_submodule(name).weight.per_tensor_scale, untied.get_submodule(name).weight.per_tensor_scale)
    torch.testing.assert_close(logits(fused), logits(untied), rtol=1e-6, atol=1e-6)


def test_a_fused_models_checkpoint_loads_into_an_unfused_one(reference):
    fused = fused_copy(reference)
    state = fused.state_dict()
    assert state.keys() == reference.state_dict().keys()
    unfused = other_llama()
    unfused.load_state_dict(state)
    torch.testing.assert_close(logits(unfused), logits(reference), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("format", ["compressed-tensors", "modelopt"])
def test_a_fused_model_exports_the_files_of_the_unfused_one(reference, format, tmp_path):
    export_checkpoint(reference, tmp_path / "unfused", format=format)
    export_checkpoint(fused_copy(reference), tmp_path / "fused", format=format)
    files = sorted(path.name for path in (tmp_path / "unfused").glob("*.safetensors"))
    assert files and files == sorted(path.name for path in (tmp_path / "fused").glob("*.safetensors"))
    for name in files:
        unfused, fused = load_file(tmp_path / "unfused" / name), load_file(tmp_path / "fused" / name)
        assert unfused.keys() == fused.keys()
        assert all(torch.equal(unfused[key], fused[key]) for key in unfused), name


def replace_k_weight(model):
    model.get_submodule(QKV[1]).weight = other_llama().get_submodule(QKV[1]).weight


CHANGES = {
    "a member's weight replaced": replace_k_weight,
    "a member's weight loaded with assign": lambda model: model.load_state_dict(
        other_llama().state_dict(), assign=True
    ),
    "the model moved": lambda model: model.to("cpu"),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_member_no_longer_holding_its_slice_runs_alone(reference, change):
    """Replaced, reloaded with assign, moved or copied apart from the group's weight, the
    members run alone and give their own weights' outputs."""
    fused = fused_copy(reference)
    changed = change(fused)
    model = changed if isinstance(changed, torch.nn.Module) and changed is not fused else fused
    torch.testing.assert_close(logits(model), logits(unfused_copy(model)), rtol=1e-6, atol=1e-6)
    assert all(m.sibling_gemm is None for m in members(model))


@pytest.mark.parametrize("cast", [lambda m: m.double(), lambda m: m.to(torch.float64), lambda m: m.to("cpu", torch.float64)],
                         ids=["double", "to dtype", "to device and dtype"])
def test_a_cast_to_float64_is_refused_naming_the_layer_and_leaves_its_weight(reference, cast):
    """The group dissolves (its members run alone, with the same outputs)."""
    fused = fused_copy(reference)
    expected = logits(fused)
    q_proj = fused.get_submodule(QKV[0])
    weight = q_proj.weight
    with pytest.raises(ValueError, match=rf"layer '{QKV[0]}' cannot become torch.float64.*model.to\(torch.float32\)"):
        cast(q_proj)
    assert q_proj.weight is weight and weight.dtype == torch.float32
    with pytest.raises(ValueError, match=rf"layer '{QKV[0]}' cannot become torch.float64"):
        cast(fused)  # the embedding, reached first, is cast
    assert fused.model.embed_tokens.weight.dtype == torch.float64
    assert torch.equal(logits(fused.to(torch.float32)), expected)


def test_an_untied_group_is_refused_and_nothing_changes():
    model = converted_llama(tie=False)
    before = [(m.weight, m.weight.qdata.data_ptr()) for m in members(model)]
    with pytest.raises(ValueError, match=r"cannot fuse .*q_proj.*k_proj.*global scale.*tie_fused_layers"):
        fuse_sibling_linears(model)
    assert [(m.weight, m.weight.qdata.data_ptr()) for m in members(model)] == before
    assert all(m.sibling_gemm is None for m in model.modules() if isinstance(m, NVFP4StaticLinear))


def test_a_model_unwrapped_before_fusing_is_refused_and_nothing_changes(reference):
    model = copy.deepcopy(reference)
    unwrap_tensor_subclass(model)
    before = logits(model)
    with pytest.raises(ValueError, match=r"cannot fuse .*q_proj.*unwrap_tensor_subclass.*before unwrapping"):
        fuse_sibling_linears(model)
    assert all(m.sibling_gemm is None for m in model.modules() if isinstance(m, NVFP4StaticLinear))
    assert torch.equal(logits(model), before)


def test_a_model_unwrapped_after_fusing_keeps_its_groups(reference):
    model = fused_copy(reference)
    gemm = model.get_submodule(QKV[0]).sibling_gemm
    unwrap_tensor_subclass(model)
    assert fuse_sibling_linears(model) and model.get_submodule(QKV[0]).sibling_gemm is gemm
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-6, atol=1e-6)
    assert model.get_submodule(QKV[0]).sibling_gemm is gemm  # its eager calls run alone, keeping it


def test_groups_with_a_float_member_are_left_alone_and_fusing_again_changes_nothing(reference):
    model = copy.deepcopy(reference)
    attention = model.get_submodule(ATTENTION)
    attention.k_proj = torch.nn.Linear(HIDDEN, 32, bias=False)
    groups = fuse_sibling_linears(model)
    assert QKV not in groups and len(groups) == 3
    assert model.get_submodule(QKV[0]).sibling_gemm is None
    gemms = [m.sibling_gemm for m in model.modules() if isinstance(m, NVFP4StaticLinear)]
    assert fuse_sibling_linears(model) == groups
    assert [m.sibling_gemm for m in model.modules() if isinstance(m, NVFP4StaticLinear)] == gemms


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copied", [copy.deepcopy, saved_and_loaded], ids=["deepcopy", "torch.save and load"])
def test_a_copied_model_keeps_working_groups(reference, monkeypatch, copied):
    """A copy holds its members' weights as rows of its own group weight: its groups are intact,
    fusing again keeps them, and each runs one GEMM."""
    fused = fused_copy(reference)
    model = copied(fused)
    gemms = [m.sibling_gemm for m in members(model)]
    assert gemms[0] is not fused.get_submodule(QKV[0]).sibling_gemm and gemms[0]._intact()
    assert fuse_sibling_linears(model) and [m.sibling_gemm for m in members(model)] == gemms
    widths = gemm_counter(monkeypatch)
    out = logits(model)
    monkeypatch.undo()
    assert 256 in widths and 32 not in widths
    torch.testing.assert_close(out, logits(reference), rtol=1e-6, atol=1e-6)
    assert all(m.sibling_gemm is gemms[0] for m in members(model))


def test_compiled_members_run_alone_on_their_slices(reference):
    fused = fused_copy(reference)
    compiled = torch.compile(fused, fullgraph=True)
    torch.testing.assert_close(logits(compiled), logits(reference), rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_fused_members_give_their_outputs_through_the_triton_route(tokens):
    """On the GPU the group's GEMM (its launches replayed eagerly) gives each member's output up
    to the order of fp32 sums (the fused width splits K differently), at decode and mid sizes."""
    reference = converted_llama(torch.bfloat16).cuda()
    assert reference.get_submodule(QKV[0]).weight.linear_backend == "triton"
    fused = fused_copy(reference)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # the first call records the launches, the second checks a replay, the third replays
            outputs = [member(x) for member in members(fused)]
        expected = [member(x) for member in members(reference)]
    assert fused.get_submodule(QKV[0]).sibling_gemm is not None
    for out, want in zip(outputs, expected):
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
