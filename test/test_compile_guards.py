"""skip_nvfp4_weight_guards: a compiled model without dynamo's guards on its converted weights."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torchao.utils import unwrap_tensor_subclass
from conftest import requires_cuda, sqnr_db
from test_sibling_linears import other_llama
from tiny_llama import converted_llama, logits, tiny_llama, token_ids

from nvfp4_static import NVFP4StaticLinear, NVFP4StaticTensor, skip_nvfp4_weight_guards

INNER_TENSORS = 4  # qdata, scale, per_tensor_scale, act_per_tensor_scale


class RecordingFilter:
    """``skip_nvfp4_weight_guards`` as dynamo calls it, keeping each guard entry and its answer."""

    def __init__(self):
        self.kept, self.left_out = [], []

    def __call__(self, entries):
        decisions = skip_nvfp4_weight_guards(entries)
        assert len(decisions) == len(entries)
        for entry, keep in zip(entries, decisions):
            (self.kept if keep else self.left_out).append(entry)
        return decisions


def compiled(model, backend="aot_eager", guard_filter_fn=None):
    torch._dynamo.reset()
    options = None if guard_filter_fn is None else {"guard_filter_fn": guard_filter_fn}
    return torch.compile(model, backend=backend, fullgraph=True, options=options)


def test_the_filter_leaves_out_every_guard_on_a_converted_weight_and_no_other():
    model = converted_llama()
    recording = RecordingFilter()
    logits(compiled(model, backend="eager", guard_filter_fn=recording))
    weights = [entry for entry in recording.left_out if isinstance(entry.value, NVFP4StaticTensor)]
    weight_names = {entry.name for entry in weights}
    assert len(weight_names) == sum(isinstance(m, NVFP4StaticLinear) for m in model.modules()) == 14
    # Each weight's own tensor guard and its inner tensors'.
    tensor_guards = [entry for entry in recording.left_out if entry.guard_type == "TENSOR_MATCH"]
    assert len(tensor_guards) == len(weight_names) * (1 + INNER_TENSORS)

    def under_a_weight(name):
        return any(name == weight or name.startswith((weight + ".", weight + "[")) for weight in weight_names)

    assert all(under_a_weight(entry.name) for entry in recording.left_out)
    assert not any(under_a_weight(entry.name) for entry in recording.kept)
    kept_tensors = [entry.name for entry in recording.kept if entry.guard_type == "TENSOR_MATCH"]
    assert any("lm_head" in name and "weight" in name for name in kept_tensors)  # a float weight
    assert any("input_ids" in name or "args" in name for name in kept_tensors)  # the input


def test_a_model_without_converted_weights_keeps_every_guard():
    recording = RecordingFilter()
    logits(compiled(tiny_llama(), backend="eager", guard_filter_fn=recording))
    assert recording.kept and not recording.left_out


def test_compiled_without_weight_guards_gives_the_eager_outputs_at_each_input_shape():
    """The input's guards stay: a batch of another shape recompiles instead of running the graph
    traced for the first. (The guards are dynamo's: the eager backend runs its graphs, without
    AOTAutograd's tracing of each shape's graph.)"""
    model = converted_llama()
    run = compiled(model, backend="eager", guard_filter_fn=skip_nvfp4_weight_guards)
    with torch.no_grad():
        for seed, batch, length in ((1, 4, 16), (2, 3, 9)):
            ids = token_ids(seed, batch, length)
            out, reference = run(ids).logits, model(ids).logits
            assert out.shape == reference.shape == (batch, length, reference.shape[-1])
            assert torch.equal(out, reference)


def test_weights_loaded_in_place_after_compiling_reach_the_graph():
    """The dropped guards never held the weights' values: a checkpoint loaded into the compiled
    model changes its outputs to the loaded model's."""
    model, other = converted_llama(), other_llama()
    run = compiled(model, guard_filter_fn=skip_nvfp4_weight_guards)
    before = logits(run)
    model.load_state_dict(other.state_dict())
    after = logits(run)
    assert not torch.equal(after, before)
    assert torch.equal(after, logits(other))


def test_a_weight_of_another_layout_swapped_in_after_compiling_is_refused_not_misread():
    """Left unguarded, a converted weight replaced by one whose packed codes are laid out
    otherwise still meets Inductor's checks of its graph's inputs: the call raises instead of
    reading the codes with the old strides."""

    def layer():
        weight = torch.randn(64, 64, dtype=torch.bfloat16)
        quantized = NVFP4StaticTensor.from_float(weight, torch.tensor(4.0), backend_override="cpu")
        return NVFP4StaticLinear(quantized, None, recipe={}, layer_name="layer")

    torch.manual_seed(0)
    model = torch.nn.Sequential(layer(), layer())
    run = compiled(model, backend="inductor", guard_filter_fn=skip_nvfp4_weight_guards)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert sqnr_db(model(x), run(x)) > 40  # compiled; Inductor may round unlike eager
        w = layer().weight
        column_major = w.qdata.t().contiguous().t()
        model[1].weight = torch.nn.Parameter(
            NVFP4StaticTensor(column_major, w.scale, w.block_size, w.orig_dtype, w.per_tensor_scale,
                              w.act_per_tensor_scale, backend_override="cpu"),
            requires_grad=False,
        )
        with pytest.raises(AssertionError, match="stride"):
            run(x)


@requires_cuda
def test_cuda_graphs_without_weight_guards_give_the_eager_outputs():
    """As ``mode="reduce-overhead"`` compiles (CUDA graphs), the filter given through ``options``;
    each replay's logits the eager model's up to compiled rounding (which may flip an activation's
    E2M1 code, as ``test_workflow`` allows)."""
    model = converted_llama().cuda()
    ids = token_ids(3).cuda()
    with torch.no_grad():
        expected = model(ids).logits
        torch._dynamo.reset()
        options = {"triton.cudagraphs": True, "guard_filter_fn": skip_nvfp4_weight_guards}
        run = torch.compile(model, fullgraph=True, options=options)
        for _ in range(3):
            assert sqnr_db(expected, run(ids).logits) > 40


def test_decoder_layers_compiled_one_by_one_share_one_graph():
    """Regional compilation: each layer's converted weights differ only in values (their global
    scales included), which the graph takes as inputs, so every guard passes for the next
    layer and one graph serves them all. (Without the KV cache, whose layer index each layer's
    graph would hold.)"""
    model = converted_llama()
    ids = token_ids(5)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        for layer in model.model.layers:
            layer.compile(backend=counter, fullgraph=True)
        assert len(model.model.layers) > 1
        assert torch.equal(model(ids, use_cache=False).logits, expected)
    assert counter.frame_count == 1


# Rows of a batch the Triton route runs as dequantize + cuBLAS, which eagerly takes the product of
# the global scales as its alpha (bf16 and fp16 outputs, above GEMM_CONFIGS' last Triton bucket of
# 512 rows; the tiny Llama's weights have too few columns for the tall tile to take cuBLAS's place).
CUBLAS_BATCH, CUBLAS_LENGTH = 2, 300
# bf16 logits of the compiled tiny Llama against its eager ones (the compiled epilogue rounds
# elsewhere, which can flip an activation's E2M1 code): 28.8-29.6 dB on an H200; a layer
# scaled by another's global scales gave 13-19.
BF16_COMPILED_SQNR_DB = 24


@requires_cuda
def test_gpu_other_global_scales_loaded_after_compiling_reach_the_graph_above_512_tokens():
    """The weights' guards left out, a checkpoint with other global scales loaded in place gives
    the loaded model's outputs at a size where the product of the scales scales cuBLAS's result."""
    model, other = converted_llama(torch.bfloat16).cuda(), other_llama().to(torch.bfloat16).cuda()
    ids = token_ids(3, CUBLAS_BATCH, CUBLAS_LENGTH).cuda()
    with torch.no_grad():
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True, options={"guard_filter_fn": skip_nvfp4_weight_guards})
        assert sqnr_db(model(ids).logits, run(ids).logits) > BF16_COMPILED_SQNR_DB
        model.load_state_dict(other.state_dict())
        assert sqnr_db(model(ids).logits, run(ids).logits) > BF16_COMPILED_SQNR_DB


@requires_cuda
@pytest.mark.parametrize("guard_filter_fn", [None, skip_nvfp4_weight_guards], ids=["every guard", "filter"])
def test_gpu_decoder_layers_compiled_one_by_one_give_the_eager_outputs_above_512_tokens(guard_filter_fn):
    """One graph for every layer, each layer's global scales read from its own weights."""
    model = converted_llama(torch.bfloat16).cuda()
    ids = token_ids(4, CUBLAS_BATCH, CUBLAS_LENGTH).cuda()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        options = None if guard_filter_fn is None else {"guard_filter_fn": guard_filter_fn}
        for layer in model.model.layers:
            layer.compile(fullgraph=True, options=options)
        assert sqnr_db(expected, model(ids, use_cache=False).logits) > BF16_COMPILED_SQNR_DB


@requires_cuda
def test_gpu_a_model_unwrapped_by_torchao_compiles_to_the_eager_outputs_above_512_tokens():
    """torchao's ``unwrap_tensor_subclass`` rebuilds each weight inside the graph from its inner
    tensors and flatten metadata; the rebuilt weight scales by its global-scale tensors."""
    model = converted_llama(torch.bfloat16).cuda()
    ids = token_ids(5, CUBLAS_BATCH, CUBLAS_LENGTH).cuda()
    with torch.no_grad():
        expected = model(ids).logits
        unwrap_tensor_subclass(model)
        torch._dynamo.reset()
        assert sqnr_db(expected, torch.compile(model, fullgraph=True)(ids).logits) > BF16_COMPILED_SQNR_DB
