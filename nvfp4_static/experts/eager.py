"""The converted experts' kernels replayed in eager mode, with their host work done once.

An eager experts call on CUDA runs six kernels: the route, per projection the routed rows'
quantize and the grouped GEMM, and the weighted sum. Their GPU time at decode sizes is a few
microseconds each, while reaching them (the operands' checks, the tile choice, the buffers,
binding each launch's arguments) costs the host several times that in every layer. Here the
first call for a routing shape (``T``, ``k``, the inputs' dtypes, strides and alignment, device
and stream) records the launches of the forward's two runs of kernels (the route and the gate/up
projection; the down projection and the weighted sum); later calls replay them
(``kernels.replay.ReplayedLaunches``) with the call's inputs, new outputs and routing buffers and
the stream's scratch memory. The forward calls the parts ``parts`` gives it, recording,
replayed or its own, and runs the rest (the float module's activation, queueing the expert
indices' check) between them as always. The same kernels with the same arguments: the same
outputs bit for bit. The first replay of each recording is checked against the layer's own
parts (``kernels.replay.reproduces``).

Replayed: plain CUDA inputs outside any tracing, dispatch mode or graph capture (a capture
gets buffers of its own from the forward), on the Triton route, at most ``MOST_REPLAYED_PAIRS``
token-expert pairs, hidden states with unit column stride, while no clip monitor counts the
inputs, with the weights' tensors in the layout convert makes. Every other call runs the
layer's own parts.
"""

from typing import Optional

import torch

from nvfp4_static.backends.triton_eager import REPLAYED_SHAPES
from nvfp4_static.experts.routing import Routing, routed_by_kernel, routing_buffer, routing_in
from nvfp4_static.kernels.launch import recording_launches
from nvfp4_static.kernels.replay import ReplayedLaunches, reproduces, warn_not_reproduced

__all__ = ["EagerExpertsLaunches"]

# Token-expert pairs up to which calls are replayed. Above, a call's GPU work bounds it, not its
# host's (one H200, Qwen3-30B-shaped layer: at 1024 tokens, top-8, the replayed call took 514 us,
# the forward 512; at 512 tokens 346 against 419; examples/benchmarks/RESULTS.md), while each
# prefill length would keep a recording and the stream's scratch memory would grow to the
# routed rows' quantized copy (75 MB at 65536 pairs of that layer).
MOST_REPLAYED_PAIRS = 4096


class EagerExpertsLaunches:
    """One experts layer's replayable calls, one per routing shape (module docstring), for the
    ``REPLAYED_SHAPES`` most recently recorded.

    Prepared for the weight tensors the layer holds; a call with others (the layer moved, a
    checkpoint assigned new buffers) starts over. A copy of the layer (``deepcopy``, pickling)
    starts empty, since what is kept holds the addresses of the original's tensors.
    """

    def __init__(self):
        self._tensors: tuple = ()
        self._in_convert_layout = False
        self._replays: dict = {}

    def __deepcopy__(self, memo) -> "EagerExpertsLaunches":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def parts(self, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The forward's kernel parts for this call of ``experts`` (the ``NVFP4StaticExperts``
        this object belongs to): ``_route_and_gate_up(hidden_states, top_k_index)`` and
        ``_down_and_combine(intermediate, routing, top_k_weights, dtype)``, replayed, recording,
        or ``experts`` itself where this call is not replayed. The forward asks only for an
        eager call on CUDA outside a graph capture."""
        inputs = (hidden_states, top_k_index, top_k_weights)
        if (
            any(type(t) is not torch.Tensor for t in inputs)
            or not hidden_states.is_cuda
            or torch._C._len_torch_dispatch_stack()
            or experts.backend != "triton"
            or experts.gate_up_proj.clip_counters is not None
            or experts.down_proj.clip_counters is not None
            or hidden_states.stride(-1) != 1
            or top_k_index.numel() > MOST_REPLAYED_PAIRS
            or not routed_by_kernel(top_k_index)
        ):
            return experts
        tensors = experts._weight_tensors()
        if len(tensors) != len(self._tensors) or any(a is not b for a, b in zip(tensors, self._tensors)):
            self._tensors, self._in_convert_layout, self._replays = tensors, _in_convert_layout(tensors), {}
        device = hidden_states.get_device()
        if device != torch._C._cuda_getDevice() or not self._in_convert_layout:
            return experts
        stream = torch._C._cuda_getCurrentRawStream(device)
        key = (
            *((t.shape, t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in inputs),
            device,
            stream,
        )
        replay = self._replays.get(key)
        if replay is None:
            if len(self._replays) >= REPLAYED_SHAPES:
                del self._replays[next(iter(self._replays))]
            return _Recording(self._replays, key, experts, self._tensors, stream)
        if isinstance(replay, ReplayedExperts) and not replay.checked:
            return _FirstReplay(self._replays, key, experts, replay)
        return replay


class _Recording:
    """The layer's own parts, their launches recorded; after the second, the call's replay
    (or ``experts`` itself, where they cannot be replayed) is kept under ``key``."""

    def __init__(self, replays: dict, key: tuple, experts, weight_tensors: tuple, stream: Optional[int]):
        self._replays, self._key, self._experts, self._stream = replays, key, experts, stream
        self._weight_tensors = weight_tensors

    def _route_and_gate_up(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        with recording_launches() as self._first_calls:
            routing, gate_up = self._experts._route_and_gate_up(hidden_states, top_k_index)
        self._first = (hidden_states, top_k_index, *_routing_tensors(routing), gate_up)
        return routing, gate_up

    def _down_and_combine(self, intermediate, routing: Routing, top_k_weights, dtype) -> torch.Tensor:
        with recording_launches() as second_calls:
            out = self._experts._down_and_combine(intermediate, routing, top_k_weights, dtype)
        experts, fixed = self._experts, self._weight_tensors
        first = ReplayedLaunches.of(self._first, (2, 3, 4, 5, 6), self._first_calls, fixed, out.device, self._stream)
        second_given = (intermediate, top_k_weights, routing.row_of_pair, routing.expert_offsets, out)
        second = ReplayedLaunches.of(second_given, (4,), second_calls, fixed, out.device, self._stream)
        gate_up = self._first[-1]
        replayed = first is not None and second is not None and gate_up.is_contiguous() and out.is_contiguous()
        self._replays[self._key] = (
            ReplayedExperts(first, second, gate_up, out, experts.num_experts, self._stream) if replayed else experts
        )
        return out


class _FirstReplay:
    """The layer's own parts, and beside them the replay's on scratch memory of 0xFF bytes: the
    replay is kept under ``key`` if the two outputs and the routings' starts agree bit for bit,
    else ``experts`` itself is. The forward gets the layer's own routing and output."""

    def __init__(self, replays: dict, key: tuple, experts, replay: "ReplayedExperts"):
        self._replays, self._key, self._experts, self._replay = replays, key, experts, replay

    def _route_and_gate_up(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        self._replay.poison_scratch()
        self._replayed = self._replay._route_and_gate_up(hidden_states, top_k_index)
        return self._experts._route_and_gate_up(hidden_states, top_k_index)

    def _down_and_combine(self, intermediate, routing: Routing, top_k_weights, dtype) -> torch.Tensor:
        out = self._experts._down_and_combine(intermediate, routing, top_k_weights, dtype)
        replayed_routing, replayed_gate_up = self._replayed
        self._replay.poison_scratch()
        replayed = self._replay._down_and_combine(
            self._experts._activated(replayed_gate_up), replayed_routing, top_k_weights, dtype
        )
        starts = (replayed_routing.expert_offsets, replayed_routing.pairs_in_range)
        if reproduces((replayed, *starts), (out, routing.expert_offsets, routing.pairs_in_range)):
            self._replay.checked = True
        else:
            self._replays[self._key] = self._experts
            tokens, k = routing.tokens, top_k_weights.shape[-1]
            name = getattr(self._experts, "layer_name", None) or type(self._experts).__name__
            warn_not_reproduced(f"experts '{name}' called on {tokens} tokens of {dtype}, top {k}")
        return out


def _routing_tensors(routing: Routing) -> tuple:
    """The routing's tensors the kernels take (``pairs_in_range`` is written with the expert
    offsets, as the route kernel's one ``starts``)."""
    return routing.pair_of_row, routing.row_of_pair, routing.token_of_row, routing.expert_offsets


def _in_convert_layout(tensors: tuple) -> bool:
    """Whether the weights' tensors are as convert makes them, which the kernels take as they
    are (a converted copy would be a buffer the replay does not refill)."""
    return all(t.is_cuda and t.is_contiguous() for t in tensors) and all(
        t.dtype == torch.float32 for t in tensors[2:4] + tensors[6:8]
    )


class ReplayedExperts:
    """The two recorded runs of an experts call's kernels, as the forward's two kernel parts.
    ``checked``: whether its first replay agreed with the layer's own parts."""

    def __init__(
        self,
        first: ReplayedLaunches,
        second: ReplayedLaunches,
        gate_up: torch.Tensor,
        out: torch.Tensor,
        num_experts: int,
        stream: Optional[int],
    ):
        self._first, self._second = first, second
        self._gate_up = (tuple(gate_up.shape), gate_up.dtype)
        self._out = (tuple(out.shape), out.dtype)
        self._num_experts, self._stream = num_experts, stream
        self.checked = False

    def poison_scratch(self) -> None:
        """Both parts' scratch memory filled with 0xFF bytes (``ReplayedLaunches.poison_scratch``)."""
        self._first.poison_scratch()
        self._second.poison_scratch()

    def _route_and_gate_up(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        routing = routing_in(routing_buffer(top_k_index, self._num_experts), top_k_index.shape[0], self._num_experts)
        gate_up = hidden_states.new_empty(self._gate_up[0], dtype=self._gate_up[1])
        self._first((hidden_states, top_k_index, *_routing_tensors(routing), gate_up), self._stream)
        return routing, gate_up

    def _down_and_combine(self, intermediate, routing: Routing, top_k_weights, dtype) -> torch.Tensor:
        out = intermediate.new_empty(self._out[0], dtype=self._out[1])
        self._second((intermediate, top_k_weights, routing.row_of_pair, routing.expert_offsets, out), self._stream)
        return out
