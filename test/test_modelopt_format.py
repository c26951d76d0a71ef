"""The ModelOpt format checked against NVIDIA ModelOpt's own code (``nvidia-modelopt``).

ModelOpt calibrates and exports on CPU (only its fake-quantized forward needs CUDA), so these
tests quantize the same tiny Llama with ModelOpt's ``NVFP4_DEFAULT_CFG`` (max activation and
max weight block scales, fused layers sharing their scales at export) and with our ``max``
recipes tied the same way, and compare what each side writes and reads.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from conftest import requires_cuda
from tiny_llama import converted_llama, logits, tiny_llama, token_ids
from nvfp4_static import NVFP4StaticLinear, export_checkpoint, import_checkpoint

with warnings.catch_warnings():  # ModelOpt warns about the transformers version it was tested with
    warnings.simplefilter("ignore")
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

CALIBRATION_SEEDS = (0, 1)  # the batches tiny_llama.prepared_and_calibrated feeds our recipe


def read_tensors(folder):
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def modelopt_quantized_llama():
    model = tiny_llama(torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]  # ModelOpt's export reads it

    def forward_loop(m):
        with torch.no_grad():
            for seed in CALIBRATION_SEEDS:
                m(token_ids(seed))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop=forward_loop)
    return model


@pytest.fixture(scope="module")
def modelopt_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modelopt_export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf_checkpoint(modelopt_quantized_llama(), export_dir=folder)
    return folder


@pytest.fixture(scope="module")
def ours():
    """Our recipe equal to ModelOpt's default: max activation amax, max weight block scales,
    q/k/v and gate/up tied (ModelOpt ties them at export)."""
    return converted_llama(torch.float32, act_calibration="max", weight_scale="max")


@pytest.fixture(scope="module")
def our_folder(ours, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ours") / "export"
    export_checkpoint(ours, folder, "modelopt")
    return folder


def test_modelopt_writes_the_tensors_we_write_bit_for_bit(modelopt_folder, our_folder):
    theirs, mine = read_tensors(modelopt_folder), read_tensors(our_folder)
    assert set(theirs) == set(mine)
    quantized = [name for name in theirs if name.endswith(".weight_scale_2")]
    assert len(quantized) == 14  # 7 linears in each of 2 layers; lm_head stays float
    differing = [name for name in theirs if not same_bits(theirs[name], mine[name])]
    assert differing == []


def test_modelopt_and_we_describe_the_scheme_alike(modelopt_folder, our_folder):
    theirs = json.loads((modelopt_folder / "hf_quant_config.json").read_text())["quantization"]
    mine = json.loads((our_folder / "hf_quant_config.json").read_text())["quantization"]
    assert (mine["quant_algo"], mine["group_size"]) == (theirs["quant_algo"], theirs["group_size"])
    # ModelOpt also lists the embedding, which is no linear and which we never quantize.
    assert set(mine["exclude_modules"]) <= set(theirs["exclude_modules"])
    assert "lm_head" in mine["exclude_modules"]


def test_modelopt_dequantizes_our_exported_weights_to_ours_exactly(ours, our_folder):
    tensors = read_tensors(our_folder)
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, NVFP4StaticLinear)}
    for name, layer in layers.items():
        packed = tensors[f"{name}.weight"]
        theirs = NVFP4QTensor(layer.weight.shape, torch.float32, packed).dequantize(
            scale=tensors[f"{name}.weight_scale"],
            double_scale=tensors[f"{name}.weight_scale_2"],
            block_sizes={-1: 16},
        )
        assert torch.equal(theirs, layer.weight.dequantize()), name


def test_a_checkpoint_written_by_modelopt_imports_and_runs_as_ours(modelopt_folder, ours):
    imported = import_checkpoint(modelopt_folder, tiny_llama(torch.float32))
    assert sum(isinstance(m, NVFP4StaticLinear) for m in imported.modules()) == 14
    assert torch.equal(logits(imported), logits(ours))


@requires_cuda
def test_modelopt_fake_quant_forward_agrees_with_our_converted_model_on_cuda():
    """ModelOpt's fake quantizer (CUDA only) against our converted layers' real NVFP4 GEMM. Its
    forward gives each fused layer its own scales (it ties them only when exporting), so ours is
    converted untied here; with the same scales the logits differ by accumulation order alone."""
    theirs = modelopt_quantized_llama().cuda()
    ours = converted_llama(torch.float32, tie=False, act_calibration="max", weight_scale="max")
    ids = token_ids(5).cuda()
    with torch.no_grad():
        a, b = theirs(ids).logits, ours.cuda()(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-5
