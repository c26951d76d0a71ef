"""Export to compressed-tensors and ModelOpt folders, and import of such folders, checked against
the other side's own code: compressed-tensors' decompressor, fake quantizer and compressor, and
transformers' loader (ModelOpt's own exporter and dequantizer: test_modelopt_format.py).

Where the two sides cannot agree bit for bit the tests say why and bound the difference:
compressed-tensors stores the reciprocal global scale ``G = 1 / p`` and computes ``s / G`` where
we compute ``s * p`` (one rounding apart in float32), and its CPU fake quantizer rounds each
block's ``amax / 6`` to the activation dtype (bf16 moves about 5% of block scales one FP8 step).
"""

import copy
import json
import math
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import calibration_batches, make, quantized, relative_error
from models import MLP, aliased_linear
from tiny_llama import convert_llama, converted_llama, logits, prepared_and_calibrated, tiny_llama
from nvfp4_static import NVFP4StaticLinear, export_checkpoint, import_checkpoint, is_quantizable, tie_fused_layers
from nvfp4_static.numerics import (
    compute_block_scales,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    quantize_nvfp4_unpacked,
)

compressed_tensors = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.utils import match_named_modules  # noqa: E402
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import (  # noqa: E402
    dequantize,
    forward_quantize,
    quantize,
)
from compressed_tensors.quantization.utils import (  # noqa: E402
    calculate_qparams,
    compute_dynamic_scales_and_zp,
    generate_gparam,
)
from transformers import AutoModelForCausalLM  # noqa: E402

FORMATS = ("compressed-tensors", "modelopt")
# One float32 rounding of a product apart (s / G against s * p), then one more of the product
# with the E2M1 value: at most 2 ulp.
FLOAT32_ONE_PRODUCT = 2.0**-22
# One bf16 ulp, relative: the bf16 roundings of two values one float32 rounding apart can land on
# neighbouring bf16 values when the float32 value sits on a bf16 tie.
BF16_ULP = 2.0**-7


@pytest.fixture(scope="module")
def llama_fp32():
    return converted_llama(torch.float32)


@pytest.fixture(scope="module")
def llama_bf16():
    """The converted bf16 model and its float original (transformers runs compressed-tensors
    NVFP4 checkpoints on CPU in bf16 only: its decompressor returns bf16 weights)."""
    return converted_llama(torch.bfloat16), tiny_llama(torch.bfloat16)


def converted_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)}


def read_folder(folder):
    tensors = {}
    for file in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values():
        tensors.update(load_file(folder / file))
    return tensors


def ct_scheme(folder):
    """The exported config group, parsed by compressed-tensors' own config model."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate(config).config_groups["group_0"]


# --- compressed-tensors' own code reads our tensors ------------------------------------------------


def test_compressed_tensors_decompressor_reads_our_weights(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    tensors, scheme = read_folder(tmp_path / "ct"), ct_scheme(tmp_path / "ct")
    for name, layer in converted_layers(llama_fp32).items():
        weight = layer.weight
        state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(f"{name}.")}
        decompressed = NVFP4PackedCompressor.decompress(state, scheme)
        # Exactly our E2M1 codes and FP8 block scales.
        e2m1 = unpack_fp4_from_uint8(state["weight_packed"], *weight.shape, dtype=torch.float32)
        ones = torch.ones_like(weight.scale, dtype=torch.float32).to(torch.float8_e4m3fn)
        assert torch.equal(e2m1, dequantize_nvfp4(weight.qdata, ones)), name
        assert torch.equal(decompressed["weight_scale"].float(), weight.scale.float()), name
        # The values: compressed-tensors multiplies by s / G, we by s * p, one rounding apart.
        ours = dequantize_nvfp4(weight.qdata, weight.scale, weight.per_tensor_scale)
        theirs_fp32 = dequantize(
            e2m1, weight.scale.float(), args=scheme.weights,
            global_scale=state["weight_global_scale"], dtype=torch.float32,
        )
        torch.testing.assert_close(theirs_fp32, ours, rtol=FLOAT32_ONE_PRODUCT, atol=0)
        # Its decompressor rounds to bf16.
        assert decompressed["weight"].dtype == torch.bfloat16
        torch.testing.assert_close(decompressed["weight"].float(), ours, rtol=BF16_ULP, atol=0)


def test_compressed_tensors_fake_quant_of_an_activation_matches_ours(llama_fp32, tmp_path):
    """fp32 activations whose blocks all sit in FP8's normal range: below it compressed-tensors
    keeps subnormal block scales where we clamp to 2^-6 as torchao does."""
    export_checkpoint(llama_fp32, tmp_path / "ct")
    name = "model.layers.0.mlp.down_proj"
    input_global_scale = read_folder(tmp_path / "ct")[f"{name}.input_global_scale"]
    per_tensor_scale = llama_fp32.get_submodule(name).weight.act_per_tensor_scale
    args = ct_scheme(tmp_path / "ct").input_activations
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * float(per_tensor_scale) * 400
    layer = torch.nn.Module()
    layer.quantization_status = QuantizationStatus.FROZEN
    layer.input_global_scale = torch.nn.Parameter(input_global_scale, requires_grad=False)

    scales, zero_point = compute_dynamic_scales_and_zp(x, args, layer, global_scale=input_global_scale)
    our_codes, our_scales = quantize_nvfp4_unpacked(x, per_tensor_scale)
    assert torch.equal(scales.float(), our_scales.float())
    codes = quantize(x, scales, zero_point, args, global_scale=input_global_scale)
    assert torch.equal(codes, our_codes)
    theirs = forward_quantize(layer, x, "input", args)  # what a compressed-tensors layer runs
    ours = fake_quantize_nvfp4(x, per_tensor_scale)
    torch.testing.assert_close(theirs, ours, rtol=FLOAT32_ONE_PRODUCT, atol=0)
    assert bool((compute_block_scales(x, per_tensor_scale).float() > 2.0**-6).all())


def test_transformers_loads_and_runs_the_compressed_tensors_export(llama_bf16, tmp_path):
    """transformers (with compressed-tensors) decompresses the weights to bf16, fake-quantizes
    each linear's input with the exported static global scale and runs bf16 matmuls. It computes
    our model's arithmetic with other roundings (see the module docstring), and W4A4 turns any
    rounding difference that moves an activation across an E2M1 boundary into a code flip that
    later layers carry, so the logits agree within a fraction of the quantization error itself
    (measured 0.5x over 4 seeds; a wrong scale or packing gives more than 1x)."""
    model, float_model = llama_bf16
    export_checkpoint(model, tmp_path / "ct")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "ct")
    theirs = logits(served)  # the first forward decompresses
    assert served.dtype == torch.bfloat16
    exported = read_folder(tmp_path / "ct")
    for name, layer in converted_layers(model).items():
        weight, served_layer = layer.weight, served.get_submodule(name)
        ours = dequantize_nvfp4(weight.qdata, weight.scale, weight.per_tensor_scale)
        torch.testing.assert_close(served_layer.weight.float(), ours, rtol=BF16_ULP, atol=0)
        assert torch.equal(served_layer.input_global_scale, exported[f"{name}.input_global_scale"])
    assert torch.equal(served.lm_head.weight, model.lm_head.weight)
    ours, reference = logits(model), logits(float_model)
    assert relative_error(theirs, ours) < 0.75 * relative_error(ours, reference)


# --- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("format", FORMATS)
def test_export_then_import_is_bit_identical(format, dtype, tmp_path, llama_fp32, llama_bf16):
    model = llama_fp32 if dtype == torch.float32 else llama_bf16[0]
    export_checkpoint(model, tmp_path / "export", format, max_shard_bytes=20_000)
    assert len(list((tmp_path / "export").glob("model-*.safetensors"))) > 1
    imported = import_checkpoint(tmp_path / "export")
    assert type(imported) is type(model) and imported.dtype == dtype
    layers = converted_layers(model)
    assert set(converted_layers(imported)) == set(layers)
    for name, layer in layers.items():
        for field in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
            assert torch.equal(getattr(imported.get_submodule(name).weight, field), getattr(layer.weight, field))
        # The host copy of the scales' product, which the eager large-M GEMM gives cuBLAS.
        assert imported.get_submodule(name).weight.output_scale == layer.weight.output_scale is not None
    floats = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in layers}
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in floats.items())
    assert torch.equal(logits(imported), logits(model))


def test_tied_embeddings_are_written_once_and_tied_again(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    prepared_and_calibrated(model, weight_scale="max")
    tie_fused_layers(model)
    convert_llama(model, weight_scale="max")
    export_checkpoint(model, tmp_path / "ct")
    assert "lm_head.weight" not in read_folder(tmp_path / "ct")
    imported = import_checkpoint(tmp_path / "ct")
    assert imported.lm_head.weight is imported.model.embed_tokens.weight
    assert torch.equal(logits(imported), logits(model))


def test_import_into_a_given_float_model(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    target = tiny_llama(seed=1)
    assert import_checkpoint(tmp_path / "ct", target) is target
    assert torch.equal(logits(target), logits(llama_fp32))


@pytest.mark.parametrize("format", FORMATS)
def test_a_folder_transformers_cannot_build_a_model_from_asks_for_the_model(tmp_path, format):
    """A plain module's export has no model_type: import_checkpoint needs the model given."""
    source = quantized(make(MLP))
    export_checkpoint(source, tmp_path / "plain", format)
    with pytest.raises(ValueError, match=r"config.json names no model_type .* pass it as model="):
        import_checkpoint(tmp_path / "plain")
    x = calibration_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(import_checkpoint(tmp_path / "plain", make(MLP, seed=1))(x), source(x))
    edit_whole_config(tmp_path / "plain", lambda config: config.update(model_type="llama", architectures=["NoSuchModel"]))
    with pytest.raises(ValueError, match=r"transformers has no model class \['NoSuchModel'\] .* pass it as model="):
        import_checkpoint(tmp_path / "plain")


@pytest.mark.parametrize("format", FORMATS)
def test_a_linear_held_under_several_names_is_written_once_and_imported_at_each(tmp_path, format):
    source = quantized(aliased_linear())
    export_checkpoint(source, tmp_path / "aliased", format)
    assert {key.partition(".")[0] for key in read_folder(tmp_path / "aliased")} == {"0"}
    imported = import_checkpoint(tmp_path / "aliased", aliased_linear(seed=1))
    assert isinstance(imported[0], NVFP4StaticLinear) and imported[2] is imported[0] and imported[3] is imported[0]
    x = calibration_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(imported(x), source(x))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_folder_and_its_files_get_the_permissions_the_umask_gives(tmp_path, umask):
    """Staged in an owner-only temporary folder (and safetensors writes its files owner-only),
    the folder was unreadable to a server running as another user."""
    previous = os.umask(umask)
    try:
        export_checkpoint(quantized(make(MLP)), tmp_path / "export")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o777 & ~umask
    files = list((tmp_path / "export").iterdir())
    assert files and all(stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask for path in files)


@pytest.mark.parametrize("format", FORMATS)
def test_a_compiled_model_exports_as_the_module_it_wraps(llama_fp32, tmp_path, format):
    """Its state names every tensor _orig_mod.* and its class is OptimizedModule: transformers
    loaded such a folder with every weight missing."""
    export_checkpoint(torch.compile(llama_fp32), tmp_path / "compiled", format)
    export_checkpoint(llama_fp32, tmp_path / "eager", format)
    assert read_folder(tmp_path / "compiled").keys() == read_folder(tmp_path / "eager").keys()
    assert json.loads((tmp_path / "compiled" / "config.json").read_text()) == json.loads(
        (tmp_path / "eager" / "config.json").read_text())
    assert torch.equal(logits(import_checkpoint(tmp_path / "compiled")), logits(llama_fp32))


class Linear(torch.nn.Module):
    """A model's own class named Linear, not an nn.Linear: compressed-tensors' "Linear" target
    matches it by its class name."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return x @ self.weight.t()


def test_compressed_tensors_matches_the_converted_layers_alone_with_a_class_named_linear_left_float(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), Linear(), torch.nn.Linear(64, 64))
    float_model = copy.deepcopy(model)
    quantized(model, filter_fn=lambda module, name: is_quantizable(module, name) and name != "2")
    export_checkpoint(model, tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    targets = [t for group in config["config_groups"].values() for t in group["targets"]]
    matched = {name for name, _ in match_named_modules(float_model, targets, config["ignore"])}
    assert matched == {"0"}
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(import_checkpoint(tmp_path / "ct", float_model)(x), model(x))


def test_import_with_a_backend_that_cannot_run_here_or_into_a_prepared_model_is_refused(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    target = tiny_llama(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"import_checkpoint into a model: backend 'blackwell' .* on cpu"):
        import_checkpoint(tmp_path / "ct", target, backend="blackwell")
    prepared = prepared_and_calibrated(tiny_llama(seed=1))
    with pytest.raises(ValueError, match=r"import_checkpoint: the model holds prepared layers \(first: 'model.layers.0"):
        import_checkpoint(tmp_path / "ct", prepared)
    assert all(type(m) is not NVFP4StaticLinear for m in [*target.modules(), *prepared.modules()])
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_compressed_tensors_reciprocal_scale_without_our_header(llama_fp32, tmp_path):
    """Another writer's folder holds only G: the scale is then 1 / G, one rounding from ours
    (the header record is ours only, see export._exact_per_tensor_scales)."""
    export_checkpoint(llama_fp32, tmp_path / "ct")
    shard = next((tmp_path / "ct").glob("model-*.safetensors"))
    with safe_open(shard, framework="pt") as handle:
        assert "nvfp4_static.per_tensor_scales" in handle.metadata()
    save_file(load_file(shard), shard, metadata={"format": "pt"})
    imported = import_checkpoint(tmp_path / "ct")
    for name, layer in converted_layers(llama_fp32).items():
        got = imported.get_submodule(name).weight.per_tensor_scale
        assert torch.equal(got, 1.0 / (1.0 / layer.weight.per_tensor_scale))
    assert relative_error(logits(imported), logits(llama_fp32)) < 1e-5


def test_a_checkpoint_written_by_compressed_tensors_imports_and_matches(tmp_path):
    """Calibrated and compressed by compressed-tensors' own functions (static-minmax input
    scales, max-based block scales), saved as llm-compressor saves; we import it and compute
    what transformers computes from it, within the bound of the transformers test."""
    model = tiny_llama(torch.bfloat16)
    input_amax = {}
    hooks = [
        m.register_forward_pre_hook(lambda _, args, n=n: input_amax.__setitem__(n, args[0].abs().amax()))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    logits(model, seed=0)
    for hook in hooks:
        hook.remove()
    float_logits = logits(model)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight = module.weight.detach()
        module.weight_global_scale.data.copy_(generate_gparam(weight.min(), weight.max()))
        blocks = weight.unflatten(-1, (-1, 16)).float()
        scale, _ = calculate_qparams(
            blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=module.weight_global_scale
        )
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        module.input_global_scale.data.copy_(generate_gparam(-input_amax[name], input_amax[name]))
    compressor = ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(tmp_path / "theirs")
    compressor.update_config(tmp_path / "theirs")

    ours = import_checkpoint(tmp_path / "theirs")
    written = load_file(tmp_path / "theirs" / "model.safetensors")
    for name, layer in converted_layers(ours).items():
        weight = layer.weight
        assert torch.equal(weight.qdata, written[f"{name}.weight_packed"])
        assert torch.equal(weight.scale.float(), written[f"{name}.weight_scale"].float())
        assert torch.equal(weight.per_tensor_scale, 1.0 / written[f"{name}.weight_global_scale"][0])
        assert torch.equal(weight.act_per_tensor_scale, 1.0 / written[f"{name}.input_global_scale"][0])
    assert len(converted_layers(ours)) == 14
    served = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "theirs"))
    assert relative_error(logits(ours), served) < 0.75 * relative_error(served, float_logits)


# --- what the folder holds -----------------------------------------------------------------------------


def test_compressed_tensors_folder_layout(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    block = config["quantization_config"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert block["quant_method"] == "compressed-tensors" and block["format"] == "nvfp4-pack-quantized"
    assert block["ignore"] == ["lm_head"]
    tensors = read_folder(tmp_path / "ct")
    name = "model.layers.1.mlp.up_proj"
    assert tensors[f"{name}.weight_packed"].dtype == torch.uint8
    assert tensors[f"{name}.weight_packed"].shape == (128, 32)
    assert tensors[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors[f"{name}.weight_global_scale"].shape == (1,)
    amax = float(llama_fp32.get_submodule(name).act_global_amax)
    assert math.isclose(float(tensors[f"{name}.input_global_scale"]), 448 * 6 / amax, rel_tol=1e-6)
    assert f"{name}.weight" not in tensors and "lm_head.weight" in tensors


def test_modelopt_folder_layout(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "mo", "modelopt")
    hf_quant = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4" and hf_quant["group_size"] == 16
    assert hf_quant["exclude_modules"] == ["lm_head"]
    block = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert block["quant_method"] == "modelopt" and block["quant_algo"] == "NVFP4"
    tensors = read_folder(tmp_path / "mo")
    name = "model.layers.0.self_attn.o_proj"
    weight = llama_fp32.get_submodule(name).weight
    assert torch.equal(tensors[f"{name}.weight"], weight.qdata)
    assert torch.equal(tensors[f"{name}.weight_scale_2"], weight.per_tensor_scale)
    assert torch.equal(tensors[f"{name}.input_scale"], weight.act_per_tensor_scale)
    assert tensors[f"{name}.input_scale"].shape == ()


def test_tokenizer_and_generation_files_come_along(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "float")
    (tmp_path / "float" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float")
    prepared_and_calibrated(model, weight_scale="max")
    tie_fused_layers(model)
    convert_llama(model, weight_scale="max")
    export_checkpoint(model, tmp_path / "export")
    for file in ("tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "export" / file).read_text() == (tmp_path / "float" / file).read_text()


# --- refusals --------------------------------------------------------------------------------------------


def test_an_unconverted_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no NVFP4StaticLinear"):
        export_checkpoint(tiny_llama(), tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_prepared_but_unconverted_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"prepared but not converted.*q_proj"):
        export_checkpoint(prepared_and_calibrated(tiny_llama()), tmp_path / "export")


def test_an_unknown_format_is_refused(llama_fp32, tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'gguf'.*compressed-tensors, modelopt"):
        export_checkpoint(llama_fp32, tmp_path / "export", "gguf")


def test_a_scale_compressed_tensors_cannot_invert_is_refused(llama_fp32, tmp_path):
    model = copy.deepcopy(llama_fp32)
    model.get_submodule("model.layers.0.mlp.down_proj").weight.per_tensor_scale.zero_()
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.down_proj'.*no finite positive reciprocal"):
        export_checkpoint(model, tmp_path / "ct", fusion_groups=())
    assert not (tmp_path / "ct").exists()


def test_a_non_empty_folder_is_refused_and_overwrite_keeps_the_users_files(llama_fp32, tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        export_checkpoint(llama_fp32, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    export_checkpoint(llama_fp32, folder, overwrite=True)
    export_checkpoint(llama_fp32, folder, "modelopt", overwrite=True)  # replaces its own files
    assert (folder / "notes.txt").read_text() == "mine"
    assert torch.equal(logits(import_checkpoint(folder)), logits(llama_fp32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left


@pytest.mark.parametrize("overwrite", ["no", "False", 0, None], ids=["no", "False string", "zero", "none"])
def test_an_overwrite_flag_that_is_not_a_bool_is_refused_and_nothing_is_written(llama_fp32, tmp_path, overwrite):
    """``overwrite="no"`` is truthy: it would have replaced the folder's files."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(TypeError, match=f"export_checkpoint: overwrite={overwrite!r} must be True or False"):
        export_checkpoint(llama_fp32, folder, overwrite=overwrite)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_overwrite_refuses_weight_files_it_would_not_replace(llama_fp32, tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"old weights")
    with pytest.raises(FileExistsError, match=r"would not replace: \['model.safetensors'\]"):
        export_checkpoint(llama_fp32, folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]


def test_import_into_another_architecture_is_refused_and_changes_nothing(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    config = tiny_llama().config
    config.intermediate_size = 256
    other = type(llama_fp32)(config)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.gate_proj'.*weight_packed.*\[128, 32\].*Linear\(64 -> 256\)"):
        import_checkpoint(tmp_path / "ct", other)
    assert all(type(m) is not NVFP4StaticLinear for m in other.modules())
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())

    config = tiny_llama().config
    config.num_hidden_layers = 1
    with pytest.raises(ValueError, match=r"tensor\(s\) the model does not have.*model.layers.1"):
        import_checkpoint(tmp_path / "ct", type(llama_fp32)(config))


def edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, error",
    [
        (
            lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=True),
            r"layer 'model.layers.0.self_attn.q_proj'.*input_activations.dynamic is True",
        ),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8),
            r"layer 'model.layers.0.self_attn.q_proj'.*weights.num_bits is 8",
        ),
        (
            lambda q: q["config_groups"]["group_0"].update(input_activations=None),
            r"input_activations is null \(weight-only",
        ),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ],
    ids=["dynamic-activation-scale", "8-bit-weights", "weight-only", "kv-cache"],
)
def test_unsupported_compressed_tensors_schemes_are_refused(llama_fp32, tmp_path, edit, error):
    export_checkpoint(llama_fp32, tmp_path / "ct")
    edit_config(tmp_path / "ct", edit)
    with pytest.raises(ValueError, match=error):
        import_checkpoint(tmp_path / "ct")


@pytest.mark.parametrize("format, field", [("compressed-tensors", "input_global_scale"), ("modelopt", "input_scale")])
def test_a_missing_tensor_is_refused_naming_the_layer_and_field(llama_fp32, tmp_path, format, field):
    export_checkpoint(llama_fp32, tmp_path / "export", format)
    shard = next((tmp_path / "export").glob("model-*.safetensors"))
    tensors = load_file(shard)
    del tensors[f"model.layers.1.mlp.down_proj.{field}"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"layer 'model.layers.1.mlp.down_proj': the checkpoint has no '{field}'"):
        import_checkpoint(tmp_path / "export")


def rewrite_json(path, edit):
    path.write_text(edit(path.read_text()))


def damage_shard(folder, edit):
    shard = next(folder.glob("model-*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def set_scales_header(folder, value):
    """The shard's header entry in which export records the exact per-tensor scales."""
    shard = next(folder.glob("model-*.safetensors"))
    save_file(load_file(shard), shard, metadata={"format": "pt", "nvfp4_static.per_tensor_scales": value})


def set_block_scale_code(tensors, code):
    key = next(k for k in sorted(tensors) if k.endswith("down_proj.weight_scale"))
    tensors[key].view(torch.uint8)[3, 2] = code


DAMAGED_FOLDERS = {
    "config-not-json": (lambda f: rewrite_json(f / "config.json", lambda t: "{not json"), r"config.json is not valid JSON"),
    "config-a-list": (lambda f: rewrite_json(f / "config.json", lambda t: "[]"), r"config.json holds a JSON list"),
    "quantization-config-a-string": (
        lambda f: edit_whole_config(f, lambda c: c.update(quantization_config="nvfp4")),
        r"config.json: quantization_config is a str, not an object",
    ),
    "index-without-weight-map": (
        lambda f: rewrite_json(f / "model.safetensors.index.json", lambda t: '{"metadata": {}}'),
        r"model.safetensors.index.json has no weight_map object",
    ),
    "shard-not-safetensors": (
        lambda f: next(f.glob("model-*.safetensors")).write_bytes(b"\x00garbage"),
        r"model-.*safetensors is not a readable safetensors file",
    ),
    "scales-header-not-json": (
        lambda f: set_scales_header(f, "{oops"),
        r"model-.*safetensors: the header's 'nvfp4_static.per_tensor_scales' is not a JSON object",
    ),
    "scales-header-a-list": (
        lambda f: set_scales_header(f, "[1, 2]"),
        r"model-.*safetensors: the header's 'nvfp4_static.per_tensor_scales' is not a JSON object",
    ),
    "scales-header-of-numbers": (
        lambda f: set_scales_header(f, json.dumps({"model.layers.0.mlp.down_proj.weight_global_scale": 1.0})),
        r"model-.*safetensors: the header's 'nvfp4_static.per_tensor_scales' is not a JSON object",
    ),
    "nan-block-scale": (
        lambda f: damage_shard(f, lambda t: set_block_scale_code(t, 0x7F)),
        r"'model.layers.0.mlp.down_proj' has 1 FP8 block scale\(s\) that are NaN or negative \(the first at index \[3, 2\]: nan",
    ),
    "negative-block-scale": (
        lambda f: damage_shard(f, lambda t: set_block_scale_code(t, 0xB8)),
        r"'model.layers.0.mlp.down_proj' has 1 FP8 block scale\(s\) that are NaN or negative \(the first at index \[3, 2\]: -1.0",
    ),
}


def set_global_scales(folder, values: dict) -> None:
    """Store ``values`` (by field name) as layer 0's down projection's global scales."""
    def edit(tensors):
        for field, value in values.items():
            key = next(k for k in sorted(tensors) if k.endswith(f"down_proj.{field}"))
            tensors[key] = torch.full_like(tensors[key], value)

    damage_shard(folder, edit)


# Stored global scales that give scales no convert makes: an activation scale under about 2e-37
# or above ~1.27e35, a weight scale above it, two whose product overflows float32.
# (compressed-tensors stores the reciprocals of both.)
IMPOSSIBLE_GLOBAL_SCALES = {
    "modelopt-tiny-input": ("modelopt", {"input_scale": 1e-38}, "has activation scale"),
    "modelopt-huge-input": ("modelopt", {"input_scale": 1e36}, "has activation scale"),
    "modelopt-huge-weight": ("modelopt", {"weight_scale_2": 1e37}, "has weight scale"),
    "modelopt-overflowing-product": ("modelopt", {"input_scale": 1e20, "weight_scale_2": 1e20}, "has .* whose product"),
    "compressed-tensors-tiny-input": ("compressed-tensors", {"input_global_scale": 1e38}, "has activation scale"),
    "compressed-tensors-huge-weight": ("compressed-tensors", {"weight_global_scale": 1e-37}, "has weight scale"),
}


@pytest.mark.parametrize("case", IMPOSSIBLE_GLOBAL_SCALES, ids=list(IMPOSSIBLE_GLOBAL_SCALES))
def test_global_scales_no_convert_makes_are_refused_at_import_and_change_nothing(llama_fp32, tmp_path, case):
    """load_quantized refuses them too: imported, the outputs would be the bias alone or Inf."""
    format, values, error = IMPOSSIBLE_GLOBAL_SCALES[case]
    export_checkpoint(llama_fp32, tmp_path / "export", format)
    set_global_scales(tmp_path / "export", values)
    target = tiny_llama()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=f"'model.layers.0.mlp.down_proj' {error}"):
        import_checkpoint(tmp_path / "export", target)
    assert all(type(m) is not NVFP4StaticLinear for m in target.modules())
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_an_all_zero_weight_exported_for_modelopt_imports_back(tmp_path):
    """Its weight scale is 0 (an all-zero weight's), which the import takes as load_quantized does."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
    converted = convert_llama(prepared_and_calibrated(model, weight_scale="max"), weight_scale="max")
    assert float(converted.model.layers[0].mlp.down_proj.weight.per_tensor_scale) == 0.0
    export_checkpoint(converted, tmp_path / "export", "modelopt", fusion_groups=())
    imported = import_checkpoint(tmp_path / "export", tiny_llama(seed=1))
    assert torch.equal(logits(imported), logits(converted))


def test_import_into_a_model_on_the_meta_device_is_refused(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "export", "modelopt")
    with torch.device("meta"):
        target = tiny_llama()
    with pytest.raises(ValueError, match=r"import_checkpoint: the model's tensors are on the meta device \(first: "):
        import_checkpoint(tmp_path / "export", target)
    assert all(type(m) is not NVFP4StaticLinear for m in target.modules())


def edit_whole_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("damage", DAMAGED_FOLDERS, ids=list(DAMAGED_FOLDERS))
def test_a_damaged_folder_is_refused_naming_the_file_or_layer_and_changes_nothing(llama_fp32, tmp_path, format, damage):
    export_checkpoint(llama_fp32, tmp_path / "export", format)
    edit, error = DAMAGED_FOLDERS[damage]
    edit(tmp_path / "export")
    target = tiny_llama()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=error):
        import_checkpoint(tmp_path / "export", target)
    assert all(type(m) is not NVFP4StaticLinear for m in target.modules())
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool], ids=["int64", "int8", "bool"])
def test_a_bias_that_is_not_floating_point_is_refused(tmp_path, format, dtype):
    export_checkpoint(quantized(make(MLP)), tmp_path / "export", format)
    damage_shard(tmp_path / "export", lambda t: t.update({"down.bias": t["down.bias"].to(dtype)}))
    target = make(MLP, seed=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=rf"layer 'down': bias is {dtype}; expected a floating-point tensor"):
        import_checkpoint(tmp_path / "export", target)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("key", ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool], ids=["int8", "int32", "bool"])
def test_a_float_tensor_stored_as_integers_is_refused(llama_fp32, tmp_path, format, key, dtype):
    """A float layer stored in another scheme (int8 codes) would load as its codes' values."""
    export_checkpoint(llama_fp32, tmp_path / "export", format)
    damage_shard(tmp_path / "export", lambda t: t.update({key: t[key].to(dtype)}))
    target = tiny_llama(seed=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=rf"'{key}' is {dtype} in the checkpoint and torch.float32 in the model"):
        import_checkpoint(tmp_path / "export", target)
    assert all(type(m) is not NVFP4StaticLinear for m in target.modules())
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.parametrize("format", FORMATS)
def test_an_untied_checkpoint_into_a_tied_model_is_refused_unless_the_tied_tensors_agree(tmp_path, format):
    """The model's one tensor would get the lm_head's values, replacing the embedding's."""
    model = tiny_llama(tie_word_embeddings=False)
    prepared_and_calibrated(model, weight_scale="max")
    tie_fused_layers(model)
    convert_llama(model, weight_scale="max")
    export_checkpoint(model, tmp_path / "untied", format)
    tied = tiny_llama(seed=1, tie_word_embeddings=True)
    before = copy.deepcopy(tied.state_dict())
    error = r"ties 'lm_head.weight' to 'model.embed_tokens.weight'.*different values"
    with pytest.raises(ValueError, match=error):
        import_checkpoint(tmp_path / "untied", tied)
    assert all(type(m) is not NVFP4StaticLinear for m in tied.modules())
    assert all(torch.equal(v, before[k]) for k, v in tied.state_dict().items())
    # The same folder described as tied: the model built from it ties them.
    edit_whole_config(tmp_path / "untied", lambda config: config.update(tie_word_embeddings=True))
    with pytest.raises(ValueError, match=error):
        import_checkpoint(tmp_path / "untied")
    # Equal values in both entries load, tied.
    damage_shard(tmp_path / "untied", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    imported = import_checkpoint(tmp_path / "untied", tiny_llama(seed=1, tie_word_embeddings=True))
    assert imported.lm_head.weight is imported.model.embed_tokens.weight
    assert torch.equal(imported.lm_head.weight, model.model.embed_tokens.weight)


def test_a_weight_only_modelopt_checkpoint_is_refused(llama_fp32, tmp_path):
    export_checkpoint(llama_fp32, tmp_path / "mo", "modelopt")
    edit_config(tmp_path / "mo", lambda q: q.update(quant_algo="W4A16_NVFP4"))
    with pytest.raises(ValueError, match=r"quant_algo is 'W4A16_NVFP4' \(weight-only"):
        import_checkpoint(tmp_path / "mo")


def test_a_modelopt_folder_described_by_hf_quant_config_only_imports(llama_fp32, tmp_path):
    """Older ModelOpt exports keep their settings in hf_quant_config.json alone."""
    export_checkpoint(llama_fp32, tmp_path / "mo", "modelopt")
    path = tmp_path / "mo" / "config.json"
    config = json.loads(path.read_text())
    del config["quantization_config"]
    path.write_text(json.dumps(config))
    assert torch.equal(logits(import_checkpoint(tmp_path / "mo")), logits(llama_fp32))
