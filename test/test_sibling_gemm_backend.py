"""sibling_gemm_backend: a compiled fused model runs each group as one linear, where that is safe."""

import copy
import gc
import importlib
import weakref
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from torch._inductor.compile_fx import compile_fx
from tiny_llama import converted_llama, logits, token_ids
from torchao.utils import unwrap_tensor_subclass

import nvfp4_static.tensor
from nvfp4_static import sibling_gemm_backend
from nvfp4_static.kernels import gemm
from test_sibling_linears import CHANGES, QKV, biased_llama, fused_copy, members, negated, other_llama, unfused_copy

HIDDEN = 64
LINEARS_UNFUSED = 2 * 7 + 1  # two layers of q, k, v, o, gate, up, down; lm_head
LINEARS_MERGED = 2 * 4 + 1  # two layers of q/k/v, o, gate/up, down; lm_head
MEMBER_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@pytest.fixture(scope="module")
def reference():
    return converted_llama()


class GraphRecorder:
    """A dynamo backend that keeps each graph it is given (after the merge) and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def linears(self) -> int:
        return sum(node.target is F.linear for gm in self.graphs for node in gm.graph.nodes)


# What becomes of a compiled merge (the model changed, moved or loaded into) is the same whether
# AOTAutograd hands its graphs to Inductor or runs them: AOTAutograd lifts the group's weight and
# compiles the unmerged copy either way. Those tests compile through aot_eager, without Inductor's
# code generation, which takes most of a CPU compile (most of all the unmerged copy's, compiled
# outside dynamo, where Inductor's graph cache does not apply).
AOT_EAGER = "aot_eager"


class AotEagerRecorder:
    """``aot_eager``, keeping a weak reference to each graph it compiles."""

    def __init__(self):
        self.compiled = []

    def __call__(self, gm, example_inputs):
        graph = torch._dynamo.lookup_backend(AOT_EAGER)(gm, example_inputs)
        self.compiled.append(weakref.ref(graph))
        return graph


def compiled(model, backend="inductor", **options):
    torch._dynamo.reset()
    return torch.compile(model, backend=sibling_gemm_backend(backend=backend, **options), fullgraph=True)


class Merged(NamedTuple):
    unwrap: bool
    model: torch.nn.Module
    recorder: GraphRecorder
    logits: torch.Tensor


@pytest.fixture(scope="module", params=[False, True], ids=["subclass weights", "unwrapped weights"])
def merged(reference, request) -> Merged:
    """A fused copy of ``reference`` (its weights unwrapped or not) compiled through the backend
    and called once: the tests that only read its graph, logits and groups share the compile."""
    fused = fused_copy(reference)
    if request.param:
        unwrap_tensor_subclass(fused)
    recorder = GraphRecorder()
    return Merged(request.param, fused, recorder, logits(compiled(fused, recorder)))


def test_each_group_is_one_linear_in_the_graph_and_the_logits_are_the_eager_ones(reference, merged):
    assert merged.recorder.linears() == LINEARS_MERGED
    torch.testing.assert_close(merged.logits, logits(reference), rtol=1e-6, atol=1e-6)
    # Eager calls of an unwrapped member run alone and keep the group for compiled graphs.
    assert all(m.sibling_gemm is not None for m in members(merged.model))


def test_decoder_layers_compiled_one_by_one_give_the_eager_outputs_and_a_warning_that_they_run_unmerged(reference):
    """Regional compilation: the layers differ in values only, so dynamo traces one graph for
    all of them (without a KV cache, whose layer index each layer's graph would hold). The merged
    graph holds the first layer's groups; another layer's call runs the graph without the
    merge, says so, and still gives that layer's outputs."""
    fused = fused_copy(reference)
    recorder = GraphRecorder()
    backend = sibling_gemm_backend(backend=recorder)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in fused.model.layers:
        layer.compile(backend=backend, fullgraph=True)
    ids = token_ids(5)
    with torch.no_grad(), pytest.warns(UserWarning, match="another layer's members"):
        out = fused(ids, use_cache=False).logits
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        again = fused(ids, use_cache=False).logits
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again, expected, rtol=1e-6, atol=1e-6)


def test_the_merged_graph_takes_no_input_of_the_members_it_merged(reference, merged):
    unwrap = merged.unwrap
    alone = unfused_copy(reference)
    if unwrap:
        unwrap_tensor_subclass(alone)
    unmerged = GraphRecorder()
    logits(compiled(alone, unmerged))
    (merged_graph,), (unmerged_graph,) = merged.recorder.graphs, unmerged.graphs
    inputs = [len(gm.graph.find_nodes(op="placeholder")) for gm in (merged_graph, unmerged_graph)]
    # Two layers of q/k/v and gate/up: 10 member weights, each one subclass input or, unwrapped,
    # its 4 inner tensors.
    assert inputs[1] - inputs[0] == 10 * (4 if unwrap else 1)
    sources = [repr(node._dynamo_source) for node in merged_graph.graph.find_nodes(op="placeholder")]
    assert not [source for source in sources if any(f"'{name}'" in source for name in MEMBER_NAMES)]
    assert [source for source in sources if "'o_proj'" in source]


@pytest.mark.parametrize("unwrap", [False, True], ids=["subclass weights", "unwrapped weights"])
def test_inductor_runs_the_groups_gemms(reference, unwrap, monkeypatch):
    fused = fused_copy(reference)
    if unwrap:
        unwrap_tensor_subclass(fused)
    widths = []
    original = nvfp4_static.tensor.static_linear

    def counting(x, weight, bias):
        widths.append(weight.shape[0])
        return original(x, weight, bias)

    def inductor_counting_its_linears(gm, example_inputs):
        widths.clear()  # dynamo's own tracing ran the members before the merge
        return compile_fx(gm, example_inputs)

    monkeypatch.setattr(nvfp4_static.tensor, "static_linear", counting)
    out = logits(compiled(fused, inductor_counting_its_linears))
    # q/k/v: 64 + 32 + 32 rows; gate/up: 2 x 128; k and v (32 rows) never alone.
    assert 256 in widths and 32 not in widths
    torch.testing.assert_close(out, logits(unfused_copy(reference)), rtol=1e-5, atol=1e-5)


def test_biased_groups_merge_with_the_groups_bias():
    reference = biased_llama()
    fused = fused_copy(reference)
    assert fused.get_submodule(QKV[0]).sibling_gemm.bias is not None
    recorder = GraphRecorder()
    torch.testing.assert_close(logits(compiled(fused, recorder)), logits(reference), rtol=1e-6, atol=1e-6)
    assert recorder.linears() == LINEARS_MERGED


class Reordered(torch.nn.Module):
    """Layer 0's q/k/v members called v, q, k, between other work on their input."""

    def __init__(self, model):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = members(model)

    def forward(self, x):
        v = self.v_proj(x)
        scaled = x * 2.0
        q = self.q_proj(x)
        return q, self.k_proj(x), v, scaled


def compiled_gives_the_eager_outputs(module, rows: int) -> GraphRecorder:
    """Call ``module`` eagerly, then compiled through the backend, each on its own copy of one
    random input (a module may write its input); check each output against the eager one, and
    return the recorder of the compiled graph."""
    x = torch.randn(rows, HIDDEN)
    recorder = GraphRecorder()
    with torch.no_grad():
        expected = module(x.clone())
        out = compiled(module, recorder)(x.clone())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return recorder


def test_members_in_another_order_merge_and_give_their_own_outputs(reference):
    assert compiled_gives_the_eager_outputs(Reordered(fused_copy(reference)), 4).linears() == 1


def test_without_fused_groups_nothing_is_merged(reference):
    recorder = GraphRecorder()
    model = copy.deepcopy(reference)
    torch.testing.assert_close(logits(compiled(model, recorder)), logits(reference), rtol=1e-6, atol=1e-6)
    assert recorder.linears() == LINEARS_UNFUSED


class Projections(torch.nn.Module):
    """Layer 0's q/k/v members, called on one input that ``write`` may change between them."""

    def __init__(self, model, write):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = members(model)
        self.write = write

    def forward(self, x):
        x = x * 1.0  # a tensor of the graph's own, which the writes may change
        q = self.q_proj(x)
        self.write(x)
        return q, self.k_proj(x), self.v_proj(x)


WRITES = {
    "in-place method": lambda x: x.mul_(2.0),
    "through a view": lambda x: x.view(-1).add_(1.0),
    "item assignment": lambda x: x.__setitem__(0, 0.5),
    "augmented assignment": lambda x: x.__imul__(3.0),
    "inplace=True": lambda x: F.relu(x, inplace=True),
    "out=": lambda x: torch.mul(x, 0.5, out=x),
    "in-place function": lambda x: torch.sigmoid_(x),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_group_whose_input_may_be_written_between_its_members_is_not_merged(reference, write):
    assert compiled_gives_the_eager_outputs(Projections(fused_copy(reference), write), 5).linears() == 3


def test_a_group_with_a_member_on_another_input_is_not_merged(reference):
    class OtherInput(Projections):
        def forward(self, x):
            return self.q_proj(x), self.k_proj(x + 1.0), self.v_proj(x)

    assert compiled_gives_the_eager_outputs(OtherInput(fused_copy(reference), None), 3).linears() == 3


AFTER_COMPILING = {**CHANGES, "the model copied": copy.deepcopy}


@pytest.mark.parametrize("change", AFTER_COMPILING.values(), ids=AFTER_COMPILING.keys())
def test_a_change_after_compiling_gives_the_changed_models_outputs(reference, change):
    """(Dynamo recompiles for a replaced parameter; the new graph leaves the group unmerged.)"""
    fused = fused_copy(reference)
    model = compiled(fused, AOT_EAGER)
    logits(model)
    changed = change(fused)
    if isinstance(changed, torch.nn.Module) and changed is not fused:
        model, fused = compiled(changed, AOT_EAGER), changed
    torch.testing.assert_close(logits(model), logits(unfused_copy(fused)), rtol=1e-5, atol=1e-5)


MOVES = {
    "to('cpu')": lambda model: model.to("cpu"),
    "cpu()": lambda model: model.cpu(),
    "to(torch.bfloat16)": lambda model: model.to(torch.bfloat16),
    "half()": lambda model: model.half(),
}


@pytest.mark.parametrize("move", MOVES.values(), ids=MOVES.keys())
def test_moving_after_compiling_releases_the_merged_graph_and_gives_the_moved_models_outputs(reference, move):
    """(torch refuses to convert a subclass parameter in place while the compiled graph's tracing
    state references it weakly; the layer then takes a new parameter.) The compiled model then
    gives the moved model's outputs (aot_eager rounds as eager does)."""
    fused = fused_copy(reference)
    recorder = AotEagerRecorder()
    model = compiled(fused, recorder)
    logits(model)
    group_weights = [weakref.ref(m.sibling_gemm.weight) for m in fused.modules() if getattr(m, "sibling_gemm", None)]
    assert len(group_weights) == 2 * 5  # two layers of q/k/v and gate/up members
    assert len(recorder.compiled) == 1 and recorder.compiled[0]() is not None
    move(fused)
    gc.collect()
    assert [ref() for ref in group_weights] == [None] * len(group_weights)
    assert recorder.compiled[0]() is None  # the merged graph, which holds the group's memory
    torch.testing.assert_close(logits(model), logits(unfused_copy(fused)), rtol=1e-5, atol=1e-5)


def test_inductor_compiles_the_graph_without_the_merge_for_moved_members(reference):
    """At the first call after the move, the merge no longer holds: Inductor compiles the
    unmerged copy of dynamo's graph (outside dynamo) and it gives the moved members' outputs."""
    module = Projections(fused_copy(reference), lambda x: None)
    linears = []

    def inductor_counting_linears(gm, example_inputs):
        linears.append(len(gm.graph.find_nodes(op="call_function", target=F.linear)))
        return compile_fx(gm, example_inputs)

    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        model = compiled(module, inductor_counting_linears)
        model(x)
        module.to("cpu")
        out = model(x)
        expected = [F.linear(x, m.weight) for m in (module.q_proj, module.k_proj, module.v_proj)]
    assert linears == [1, 3]
    assert module.q_proj.sibling_gemm is None
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def replaced_k_weight(module, inputs: list) -> list:
    k_weight = module.k_proj.weight
    module.k_proj.weight = other_llama().get_submodule(QKV[1]).weight
    return [module.k_proj.weight if value is k_weight else value for value in inputs]


def dissolved_group(module, inputs: list) -> list:
    module.q_proj.sibling_gemm.dissolve()
    return inputs


@pytest.mark.parametrize("change", [replaced_k_weight, dissolved_group])
def test_a_call_that_no_longer_meets_the_merge_runs_the_graph_without_it(reference, change):
    """The compiled merge checks its members at every call (here called with the new inputs
    directly, as a guard that dynamo does not install would let through)."""
    module = Projections(fused_copy(reference), lambda x: None)
    recorder = GraphRecorder()
    merging = sibling_gemm_backend(backend=recorder)
    captured = {}

    def capturing(gm, example_inputs):
        captured["compiled"], captured["inputs"] = merging(gm, example_inputs), list(example_inputs)
        return captured["compiled"]

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=capturing, fullgraph=True)(torch.randn(3, HIDDEN))
        inputs = change(module, captured["inputs"])
        out = captured["compiled"](*inputs)
        x = next(value for value in inputs if value.shape == (3, HIDDEN))
        expected = [F.linear(x, m.weight) for m in (module.q_proj, module.k_proj, module.v_proj)]
    assert [gm.graph.find_nodes(op="call_function", target=F.linear) != [] for gm in recorder.graphs] == [True, True]
    assert recorder.linears() == 1 + 3
    assert module.q_proj.sibling_gemm is None
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_copied_model_compiles_merged(reference):
    """(A copy's groups are its own, live and intact.)"""
    copied = copy.deepcopy(fused_copy(reference))
    recorder = GraphRecorder()
    torch.testing.assert_close(logits(compiled(copied, recorder)), logits(reference), rtol=1e-6, atol=1e-6)
    assert recorder.linears() == LINEARS_MERGED


def test_a_checkpoint_with_other_global_scales_reaches_the_compiled_model_unmerged(reference):
    """(The load dissolves the groups, which drops the merged graph.)"""
    fused = fused_copy(reference)
    recorder = AotEagerRecorder()
    model = compiled(fused, recorder)
    logits(model)
    other = other_llama()
    fused.load_state_dict(other.state_dict())
    gc.collect()
    assert recorder.compiled[0]() is None
    assert all(m.sibling_gemm is None for m in members(fused))
    torch.testing.assert_close(logits(model), logits(other), rtol=1e-5, atol=1e-5)


def test_the_compiled_merged_graph_reads_a_checkpoint_loaded_into_the_members(reference):
    """No recompile: the graph compiled with the merge reads the group's memory, which the
    members' weights are row slices of."""
    fused = fused_copy(reference)
    recorder = AotEagerRecorder()
    model = compiled(fused, recorder)
    before = logits(model)
    fused.load_state_dict(negated(fused.state_dict()))
    after = logits(model)
    assert len(recorder.compiled) == 1
    assert all(m.sibling_gemm is not None for m in members(fused))
    torch.testing.assert_close(after, logits(unfused_copy(fused)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before, rtol=1e-2, atol=1e-2)


BAD_ARGUMENTS = {
    "unknown mode": (dict(mode="fastest"), r"unknown Inductor mode 'fastest'.*reduce-overhead"),
    "unknown option": (dict(options={"no_such_option": True}), r"unknown Inductor options \['no_such_option'\]"),
    "mode for another backend": (dict(mode="reduce-overhead", backend="eager"), r"backend 'eager' takes neither"),
    "options for another backend": (dict(options={"max_autotune": True}, backend="aot_eager"), r"'aot_eager'"),
}
# Each failed only at the first compiled call, or with a raw error ('list' object is not a mapping).
BADLY_TYPED_ARGUMENTS = {
    "no backend": (dict(backend=None), r"backend must be a dynamo backend's name or a callable; got None"),
    "a number as backend": (dict(backend=3), r"got 3"),
    "options as a list": (dict(options=["max_autotune"]), r"options must map Inductor option names to values"),
    "options as a string": (dict(options="max_autotune"), r"options must map .*; got 'max_autotune'"),
}


@pytest.mark.parametrize("arguments, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        sibling_gemm_backend(**arguments)


@pytest.mark.parametrize("arguments, message", BADLY_TYPED_ARGUMENTS.values(), ids=BADLY_TYPED_ARGUMENTS.keys())
def test_badly_typed_arguments_are_refused_when_the_backend_is_made(arguments, message):
    with pytest.raises(TypeError, match=message):
        sibling_gemm_backend(**arguments)


def test_a_mode_and_options_given_to_torch_compile_reach_inductor(reference, monkeypatch):
    """As transformers' CompileConfig passes them: torch.compile hands a custom backend its
    mode and options, which join the backend's own."""
    patches = []
    monkeypatch.setattr(
        "torch._inductor.compile_fx.compile_fx",
        lambda gm, example_inputs, config_patches: patches.append(config_patches) or gm.forward,
    )
    fused = fused_copy(reference)
    torch._dynamo.reset()
    backend = sibling_gemm_backend(options={"max_autotune": False})
    model = torch.compile(fused, backend=backend, mode="max-autotune-no-cudagraphs", fullgraph=True)
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-6, atol=1e-6)
    assert patches == [{"max_autotune": False, "coordinate_descent_tuning": True}]


TWO_MODES = {
    "two different modes": (dict(mode="reduce-overhead"), dict(mode="max-autotune"), r"give the mode once"),
    "an unknown mode": (dict(), dict(mode="fastest"), r"unknown Inductor mode 'fastest'"),
    "a mode for another backend": (dict(backend="eager"), dict(mode="reduce-overhead"), r"takes neither"),
}


@pytest.mark.parametrize("given, compiling, message", TWO_MODES.values(), ids=TWO_MODES.keys())
def test_a_mode_given_to_torch_compile_that_cannot_apply_is_refused(reference, given, compiling, message):
    """(Refused when dynamo hands the backend its first graph: a group's members make one.)"""
    torch._dynamo.reset()
    module = Projections(fused_copy(reference), lambda x: None)
    model = torch.compile(module, backend=sibling_gemm_backend(**given), fullgraph=True, **compiling)
    with torch.no_grad(), pytest.raises(Exception, match=message):
        model(torch.randn(3, HIDDEN))


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("unwrap", [False, True], ids=["subclass weights", "unwrapped weights"])
def test_gpu_compiled_group_equals_the_eager_groups_gemm(tokens, unwrap, monkeypatch):
    """On the GPU the merged graph runs the group's GEMM as the eager group does on the table's
    entries, bit for bit (a traced GEMM sums its K splits in the eager kernel's order; eager
    calls of 2-16 rows otherwise quantize in the GEMM with other tiles, ``gemm.quantizes_eagerly``)."""
    monkeypatch.setattr(gemm, "EAGER_QUANTIZING_MAX_ROWS", 1)
    reference = converted_llama(torch.bfloat16).cuda()
    fused = fused_copy(reference)
    module = Projections(fused, lambda x: None)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = module(x)
        if unwrap:
            unwrap_tensor_subclass(module)
        recorder = GraphRecorder()
        out = compiled(module, recorder)(x)
        merged = compiled(module)(x)
    assert recorder.linears() == 1
    for got, inductor, want in zip(out, merged, expected):
        assert torch.equal(got, want) and torch.equal(inductor, want)


@requires_cuda
def test_gpu_generate_compiles_its_decoding_step_through_the_backend(monkeypatch):
    """transformers' generate with a static cache compiles its decoding step through the backend
    (CUDA graphs: the CompileConfig's default mode reaches Inductor): the groups merge and the
    tokens and logits follow the eager fused model's."""
    from transformers import CompileConfig

    # The package exports the function under the module's name: the module from sys.modules.
    backend_module = importlib.import_module("nvfp4_static.sibling_gemm_backend")
    merged = []
    merge = backend_module.merge_sibling_linears

    def recording(gm, example_inputs):
        groups = merge(gm, example_inputs)
        merged.append(len(groups))
        return groups

    monkeypatch.setattr(backend_module, "merge_sibling_linears", recording)
    fused = fused_copy(converted_llama(torch.bfloat16).cuda())
    prompt = torch.randint(0, 128, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = fused.generate(prompt, **options)
        out = fused.generate(
            prompt, cache_implementation="static", compile_config=CompileConfig(backend=sibling_gemm_backend()),
            **options,
        )
    assert sum(merged) == 4  # two layers' q/k/v and gate/up
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.logits, expected.logits):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def cuda_bytes_of(model) -> int:
    """Bytes of the CUDA storages holding ``model``'s parameters (a subclass's inner tensors)."""
    storages = {}
    for parameter in model.parameters():
        names = parameter.__tensor_flatten__()[0] if hasattr(parameter, "__tensor_flatten__") else []
        for tensor in [getattr(parameter, name) for name in names] or [parameter]:
            if tensor.is_cuda:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@requires_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_a_compiled_fused_model_moved_to_the_cpu_leaves_none_of_its_weights_on_the_gpu(mode):
    fused = fused_copy(converted_llama(torch.bfloat16).cuda())
    model = compiled(fused, mode=mode)
    with torch.no_grad():
        for _ in range(3):  # CUDA graphs record from the second call on
            model(token_ids(5).cuda())
    weight_bytes = cuda_bytes_of(fused)
    gc.collect()
    before = torch.cuda.memory_allocated()
    fused.to("cpu")
    gc.collect()
    assert before - torch.cuda.memory_allocated() >= weight_bytes > 0
    moved = logits(model)
    torch.testing.assert_close(moved, logits(torch.compile(unfused_copy(fused), fullgraph=True)), rtol=1e-2, atol=1e-2)
