"""experts/eager.py: a replayed experts call equals the forward's own call bit for bit.

On CPU the recording and the replay run under Triton's interpreter (in a child process, see
triton_interpreter) on a small layer whose three parts launch the experts' kernels directly; on
a CUDA machine the converted layer's own forward replays, against the forward with the replay
turned off.
"""

import copy
import io
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import convert, requires_cuda
from test_experts import (
    ARCHITECTURES,
    EXPERTS,
    HIDDEN,
    ROUTINGS,
    TOP_K,
    calibrated_experts,
    quantized_model,
    routed_batch,
    token_ids,
)
from triton_interpreter import run_interpreted

from nvfp4_static.experts.eager import EagerExpertsLaunches, ReplayedExperts, _FirstReplay, _Recording
from nvfp4_static.numerics import per_tensor_amax_to_scale, quantize_nvfp4

REPLAYER = "test_experts_eager:record_then_replay"


class LaunchingExperts:
    """The converted experts' two kernel parts on CPU tensors, each kernel launched directly
    (the layer itself takes the torch reference on CPU): what ``EagerExpertsLaunches`` records."""

    def __init__(self, gate_up: tuple, down: tuple, copies_rows: bool = False):
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up[0].shape[0]
        # A torch op between the down projection and the weighted sum, which a recording does
        # not see: the replayed sum reads a scratch buffer no replayed launch writes.
        self.copies_rows = copies_rows

    def _route_and_gate_up(self, hidden_states, top_k_index):
        from nvfp4_static.experts.routing import routing_buffer, routing_in
        from nvfp4_static.kernels.expert_routing import launch_route
        from nvfp4_static.kernels.grouped_gemm import launch_grouped_nvfp4_gemm

        pairs, experts = top_k_index.numel(), self.num_experts
        buffer = routing_buffer(top_k_index, experts)
        launch_route(top_k_index, experts, *buffer.split([pairs, pairs, pairs, experts + 2]))
        routing = routing_in(buffer, top_k_index.shape[0], experts)
        gate_up = torch.empty(pairs, self.gate_up[0].shape[1], dtype=hidden_states.dtype)
        launch_grouped_nvfp4_gemm(
            hidden_states, routing.expert_offsets, *self.gate_up, gate_up, source_rows=routing.token_of_row
        )
        return routing, gate_up

    def _activated(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _down_and_combine(self, intermediate, routing, top_k_weights, dtype):
        from nvfp4_static.kernels.expert_routing import launch_combine
        from nvfp4_static.kernels.grouped_gemm import launch_grouped_nvfp4_gemm

        rows = torch.empty(intermediate.shape[0], self.down[0].shape[1], dtype=intermediate.dtype)
        launch_grouped_nvfp4_gemm(intermediate, routing.expert_offsets, *self.down, rows)
        out = torch.empty(routing.tokens, rows.shape[1], dtype=dtype)
        rows = rows.clone() if self.copies_rows else rows
        launch_combine(rows, routing.row_of_pair, routing.expert_offsets[-1:], top_k_weights, out)
        return out


def grouped_weights(E, N, K, seed):
    """``E`` random ``[N, K]`` NVFP4 weights as a grouped linear holds them."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(E, N, K, generator=generator) * (torch.rand(E, 1, 1, generator=generator) + 0.1)
    weight_scales = torch.stack([per_tensor_amax_to_scale(w.abs().amax()) for w in weights])
    packed = [quantize_nvfp4(w, s) for w, s in zip(weights, weight_scales)]
    act_scales = per_tensor_amax_to_scale(torch.full((E,), 6.0))
    return torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]), weight_scales, act_scales


def record_then_replay(first, second, gate_up, down, copies_rows=False):
    """In the interpreted child: record the layer's kernels on the inputs ``first``, check their
    first replay on ``second`` (``_FirstReplay``), then replay them on ``second``, calling the
    parts in the forward's order; returns (first output, replayed output and routing, the
    layer's own output and routing on ``second``, launches recorded, the checking call's
    output, what the layer keeps after it, the warnings' messages)."""
    layer = LaunchingExperts(gate_up, down, copies_rows)

    def forward(parts, hidden_states, top_k_index, top_k_weights):
        routing, gate_up_rows = parts._route_and_gate_up(hidden_states, top_k_index)
        out = parts._down_and_combine(layer._activated(gate_up_rows), routing, top_k_weights, hidden_states.dtype)
        return out, tuple(routing)

    replays = {}
    first_out, _ = forward(_Recording(replays, "key", layer, (*gate_up, *down), None), *first)
    replay = replays["key"]
    assert isinstance(replay, ReplayedExperts)
    recorded = len(replay._first._launches) + len(replay._second._launches)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        checking_out, _ = forward(_FirstReplay(replays, "key", layer, replay), *second)
    kept = "replay, checked" if replays["key"] is replay and replay.checked else type(replays["key"]).__name__
    messages = [f"{w.category.__name__}: {w.message}" for w in warned]
    return first_out, forward(replay, *second), forward(layer, *second), recorded, checking_out, kept, messages


def experts_inputs(tokens, seed, dtype, put_in=()):
    """Hidden states, top-k indices (``put_in`` written over the first pairs: the no-expert
    index, indices outside the experts) and weights of a small layer."""
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, 64, generator=generator) * 2).to(dtype)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(tokens)])
    index.view(-1)[: len(put_in)] = torch.tensor(put_in, dtype=torch.int64)
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1).to(dtype)
    return hidden, index, weights


INTERPRETER_CASES = {
    "float32": (torch.float32, ()),
    "bfloat16-no-expert-and-outside": (torch.bfloat16, (4, -3)),
}


@pytest.fixture(scope="module")
def interpreted_replays():
    gate_up, down = grouped_weights(4, 64, 64, seed=0), grouped_weights(4, 64, 32, seed=1)
    launches = {
        name: (REPLAYER, (experts_inputs(3, 0, dtype), experts_inputs(3, 1, dtype, put_in), gate_up, down))
        for name, (dtype, put_in) in INTERPRETER_CASES.items()
    }
    copied = (experts_inputs(3, 0, torch.float32), experts_inputs(3, 1, torch.float32), gate_up, down, True)
    launches["rows-copied-by-torch"] = (REPLAYER, copied)
    return run_interpreted(launches)


@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_interpreted_replay_equals_the_layers_own_kernels_on_new_inputs(interpreted_replays, case):
    """The first replay, over scratch memory of 0xFF bytes, agrees with the layer's own parts
    and is kept; the next replays equal them too."""
    returned = interpreted_replays[case].returned
    first, (replayed, replayed_routing), (expected, routing), launches, checking_out, kept, messages = returned
    assert launches == 6  # the route, two quantize + grouped GEMM pairs, the weighted sum
    assert not expected.isnan().any()
    assert torch.equal(replayed, expected)
    assert not torch.equal(replayed, first)  # the new inputs, not the recorded ones
    for replayed_tensor, tensor in zip(replayed_routing, routing):
        assert torch.equal(torch.as_tensor(replayed_tensor), torch.as_tensor(tensor))
    assert torch.equal(checking_out, expected)
    assert kept == "replay, checked" and messages == []


def test_interpreted_first_replay_of_parts_with_a_torch_op_inside_is_dropped_with_a_warning(interpreted_replays):
    """The down projection's rows copied by torch before the weighted sum: the first replay's sum
    reads the poisoned copy, so the call returns the layer's own output, warns naming the call,
    and the layer keeps itself for that shape."""
    _, _, (expected, _), _, checking_out, kept, messages = interpreted_replays["rows-copied-by-torch"].returned
    assert not expected.isnan().any()
    assert torch.equal(checking_out, expected)
    assert kept == "LaunchingExperts"
    assert len(messages) == 1 and messages[0].startswith("RuntimeWarning: nvfp4_static: experts 'LaunchingExperts'")
    assert "3 tokens of torch.float32, top 2" in messages[0]


# --- the converted layer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_experts():
    batches = [routed_batch(48, seed) for seed in range(2)]
    return convert(calibrated_experts(batches)).experts


def test_copies_of_the_layer_start_without_its_launches(converted_experts):
    """What is kept holds the original's tensor addresses: a deep copy or an unpickled layer
    prepares its own."""
    buffer = io.BytesIO()
    torch.save(converted_experts, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(converted_experts), torch.load(buffer, weights_only=False)):
        assert isinstance(other._eager_launches, EagerExpertsLaunches)
        assert other._eager_launches is not converted_experts._eager_launches
        batch = routed_batch(5, seed=3)
        with torch.no_grad():
            assert torch.equal(other(*batch), converted_experts(*batch))


def test_cpu_inputs_take_the_layers_own_parts(converted_experts):
    assert converted_experts._eager_launches.parts(converted_experts, *routed_batch(5, seed=3)) is converted_experts


def _replayed_keys(experts) -> list:
    return [key for key, replay in experts._eager_launches._replays.items() if isinstance(replay, ReplayedExperts)]


def _without_replay(experts, batch):
    with mock.patch.object(EagerExpertsLaunches, "parts", lambda self, experts, *inputs: experts):
        return experts(*batch)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_replayed_experts_equal_the_forward_on_new_routings(converted_experts, dtype):
    """Several routings of each token count after the first call recorded it (the second call
    checks the first replay, the next ones replay): spread, some experts idle, two experts
    taking all, a slot routed to no expert."""
    experts = copy.deepcopy(converted_experts).to("cuda")
    with torch.no_grad():
        for tokens in (1, 3, 16, 64):
            batches = [routed_batch(tokens, seed=tokens + i, **routing) for i, routing in enumerate(ROUTINGS.values())]
            batches[-1][1][0, 0] = EXPERTS
            for hidden, index, weights in batches:
                batch = (hidden.to("cuda", dtype), index.cuda(), weights.to("cuda", dtype))
                out = experts(*batch)
                assert torch.equal(out, _without_replay(experts, batch))
        assert {key[0][0] for key in _replayed_keys(experts)} == {(1, HIDDEN), (3, HIDDEN), (16, HIDDEN), (64, HIDDEN)}
    assert all(replay.checked for replay in experts._eager_launches._replays.values())


@requires_cuda
def test_gpu_inputs_laid_out_otherwise_get_replays_of_their_own():
    """A transposed top_k_index, strided top_k_weights, int32 indices and hidden states off the
    16-byte boundary each record their own replay (their strides and alignment are compiled
    into the kernels), which equals the forward on new values; float64 routing weights, which
    the weighted-sum kernel does not take, run the forward."""
    experts = copy.deepcopy(convert(calibrated_experts([routed_batch(48, seed) for seed in range(2)])).experts).cuda()

    def layouts(seed):
        hidden, index, weights = (t.cuda() for t in routed_batch(6, seed=seed))
        spare = torch.cat([hidden.new_zeros(1, HIDDEN), hidden]).view(-1)[2:2 + 6 * HIDDEN].view(6, HIDDEN)
        spare.copy_(hidden)
        wide_weights = torch.stack([weights, weights], dim=-1)[..., 0]
        return {
            "transposed index": (hidden, index.t().contiguous().t(), weights),
            "strided weights": (hidden, index, wide_weights),
            "int32 index": (hidden, index.to(torch.int32), weights),
            "unaligned hidden": (spare, index, weights),
            "float64 weights": (hidden, index, weights.double()),
        }

    with torch.no_grad():
        for seed in (1, 2, 3):
            for name, batch in layouts(seed).items():
                assert torch.equal(experts(*batch), _without_replay(experts, batch)), (name, seed)
    assert len(_replayed_keys(experts)) == 4


@requires_cuda
def test_gpu_a_replayed_call_with_indices_outside_the_experts_is_refused_at_the_next_call(converted_experts):
    experts = copy.deepcopy(converted_experts).to("cuda")
    hidden, index, weights = (t.cuda() for t in routed_batch(4, seed=5))
    with torch.no_grad():
        experts(hidden, index, weights)  # recorded
        assert len(_replayed_keys(experts)) == 1
        for bad in (-1, EXPERTS + 1):
            wrong = index.clone()
            wrong[2, 1] = bad
            experts(hidden, wrong, weights)  # replayed
            with pytest.raises(ValueError, match="1 expert indices outside"):
                experts(hidden, index, weights)
        assert torch.equal(experts(hidden, index, weights), _without_replay(experts, (hidden, index, weights)))


@requires_cuda
def test_gpu_calls_the_replay_cannot_redo_take_the_forward(converted_experts):
    """Hidden states with a column stride, a clip monitor counting the inputs, new weights, a
    graph capture, more pairs than calls are replayed with, and more than the route kernel
    takes: each gives the forward's output and records nothing it would replay wrongly."""
    from nvfp4_static.experts.eager import MOST_REPLAYED_PAIRS
    from nvfp4_static.kernels.expert_routing import MAX_ROUTED_PAIRS

    experts = copy.deepcopy(converted_experts).to("cuda")
    hidden, index, weights = (t.cuda() for t in routed_batch(6, seed=7))
    strided = hidden.t().contiguous().t()
    with torch.no_grad():
        expected = _without_replay(experts, (hidden, index, weights))
        assert torch.equal(experts(strided, index, weights), expected)
        assert _replayed_keys(experts) == []
        experts.gate_up_proj.start_clip_monitor()
        assert torch.equal(experts(hidden, index, weights), expected)
        assert int(experts.gate_up_proj.clip_counters["seen"].sum()) == index.numel() * HIDDEN
        experts.gate_up_proj.stop_clip_monitor()
        assert torch.equal(experts(hidden, index, weights), expected)
        assert len(_replayed_keys(experts)) == 1
        # New weights: the replays start over, on the new ones.
        experts.down_proj.per_tensor_scale = experts.down_proj.per_tensor_scale * 2
        doubled = experts(hidden, index, weights)
        assert torch.equal(doubled, _without_replay(experts, (hidden, index, weights)))
        assert not torch.equal(doubled, expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(hidden, index, weights)
        graph.replay()
        assert torch.equal(captured, doubled)
        for seed, pairs in enumerate((MOST_REPLAYED_PAIRS, MAX_ROUTED_PAIRS)):
            many = tuple(t.cuda() for t in routed_batch(pairs // TOP_K + 1, seed=8 + seed))
            for _ in range(2):
                assert torch.equal(experts(*many), _without_replay(experts, many)), pairs
        assert [key[0][0][0] for key in experts._eager_launches._replays] == [6]


@requires_cuda
def test_gpu_the_index_count_is_queued_between_the_kernel_parts(converted_experts, monkeypatch):
    """The copy of the in-range count goes behind the routing, not behind the whole call, so
    that the next call's read of it does not wait for this call's GEMMs: recorded and replayed."""
    from nvfp4_static.deferred_read import DeferredRead

    experts = copy.deepcopy(converted_experts).to("cuda")
    order = []
    real_parts, real_send = EagerExpertsLaunches.parts, DeferredRead.send

    class LoggedParts:
        def __init__(self, parts):
            self.parts = parts

        def _route_and_gate_up(self, *args):
            order.append(("routing", type(self.parts).__name__))
            return self.parts._route_and_gate_up(*args)

        def _down_and_combine(self, *args):
            order.append(("sum", type(self.parts).__name__))
            return self.parts._down_and_combine(*args)

    monkeypatch.setattr(EagerExpertsLaunches, "parts", lambda *args: LoggedParts(real_parts(*args)))
    monkeypatch.setattr(DeferredRead, "send", lambda self, *args: (order.append(("send",)), real_send(self, *args)))
    batch = tuple(t.cuda() for t in routed_batch(4, seed=9))
    with torch.no_grad():
        for _ in range(3):
            experts(*batch)
    assert order == [
        ("routing", "_Recording"), ("send",), ("sum", "_Recording"),
        ("routing", "_FirstReplay"), ("send",), ("sum", "_FirstReplay"),
        ("routing", "ReplayedExperts"), ("send",), ("sum", "ReplayedExperts"),
    ]


@requires_cuda
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_gpu_a_converted_models_eager_forward_replays_its_experts_and_gives_the_same_logits(architecture):
    """A whole model in bf16: the routers' own top-k (int64 indices, their dtype's weights)
    reach the replay, each layer's experts record at the first batch, check their first replay
    at the second and replay at the third."""
    model = quantized_model(architecture, weight_scale="max").to("cuda", torch.bfloat16)
    layers = [layer.mlp.experts for layer in model.model.layers]
    with torch.no_grad():
        for seed in (1, 2, 3):
            ids = token_ids(seed).cuda()
            logits = model(ids).logits
            assert torch.equal(logits, _without_replay_in(model, ids))
    assert all(len(_replayed_keys(experts)) == 1 for experts in layers)
    assert all(replay.checked for experts in layers for replay in experts._eager_launches._replays.values())


def _without_replay_in(model, ids):
    with mock.patch.object(EagerExpertsLaunches, "parts", lambda self, experts, *inputs: experts):
        return model(ids).logits
