"""The converted experts' kernels replayed in eager mode, with their host work done once.

An eager experts call on CUDA runs six kernels: the route, per projection the routed rows'
quantize and the grouped GEMM, and the weighted sum. Their GPU time at decode sizes is a few
microseconds each, while reaching them (the operands' checks, the tile choice, the buffers,
binding each launch's arguments) costs the host several times that in every layer. Here the
first call for a routing shape (``T``, ``k``, the inputs' dtypes, strides and alignment, device
and stream) runs the forward while recording the launches of its two runs of kernels (the route
and the gate/up projection; the down projection and the weighted sum); later calls replay them
(``kernels.replay.ReplayedLaunches``) with the call's inputs, new outputs and routing buffers and
the stream's scratch memory, and the float module's activation runs between them as in the
forward. The same kernels with the same arguments: the same outputs bit for bit.

Replayed: plain CUDA inputs outside any tracing, dispatch mode or graph capture (a capture
gets buffers of its own from the forward), on the Triton route, at most ``MAX_ROUTED_PAIRS``
token-expert pairs (the route kernel's), hidden states with unit column stride, while no clip
monitor counts the inputs, with the weights' tensors in the layout convert makes. Every other
call returns None and the layer runs its forward.
"""

from typing import Optional

import torch

from nvfp4_static.backends.triton_eager import REPLAYED_SHAPES
from nvfp4_static.experts.routing import Routing, routed_by_kernel, routing_buffer, routing_in
from nvfp4_static.kernels.launch import recording_launches
from nvfp4_static.kernels.replay import ReplayedLaunches

__all__ = ["EagerExpertsLaunches"]

_WEIGHT_TENSORS = ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale")


class EagerExpertsLaunches:
    """One experts layer's replayable calls, one per routing shape (module docstring), for the
    ``REPLAYED_SHAPES`` most recently recorded.

    Prepared for the weight tensors the layer holds; a call with others (the layer moved, a
    checkpoint assigned new buffers) starts over. A copy of the layer (``deepcopy``, pickling)
    starts empty, since what is kept holds the addresses of the original's tensors.
    """

    def __init__(self):
        self._tensors: tuple = ()
        self._replays: dict = {}

    def __deepcopy__(self, memo) -> "EagerExpertsLaunches":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def __call__(
        self, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, Routing]]:
        """``experts``' output and routing for these inputs, or None where this call is not
        replayed. ``experts`` is the ``NVFP4StaticExperts`` this object belongs to."""
        inputs = (hidden_states, top_k_index, top_k_weights)
        if (
            any(type(t) is not torch.Tensor for t in inputs)
            or not hidden_states.is_cuda
            or torch._C._len_torch_dispatch_stack()
            or torch._C._cuda_isCurrentStreamCapturing()
            or experts.backend != "triton"
            or experts.gate_up_proj.clip_counters is not None
            or experts.down_proj.clip_counters is not None
            or hidden_states.stride(-1) != 1
            or not routed_by_kernel(top_k_index)
        ):
            return None
        projections = (experts.gate_up_proj, experts.down_proj)
        tensors = tuple(getattr(projection, name) for projection in projections for name in _WEIGHT_TENSORS)
        if len(tensors) != len(self._tensors) or any(a is not b for a, b in zip(tensors, self._tensors)):
            self._tensors, self._replays = tensors, {}
        device = hidden_states.get_device()
        if device != torch._C._cuda_getDevice() or not _in_convert_layout(tensors):
            return None
        stream = torch._C._cuda_getCurrentRawStream(device)
        key = (
            *((t.shape, t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in inputs),
            device,
            stream,
        )
        replay = self._replays.get(key)
        if replay is None:
            return self._record(key, experts, hidden_states, top_k_index, top_k_weights, stream)
        return replay(experts, hidden_states, top_k_index, top_k_weights, stream)

    def _record(self, key: tuple, experts, hidden_states, top_k_index, top_k_weights, stream):
        """Run the forward's parts for these inputs and keep their launches' replay under
        ``key``, making room by forgetting the oldest recorded key."""
        with recording_launches() as first_calls:
            routing, gate_up = experts._route_and_gate_up(hidden_states, top_k_index)
        intermediate = experts._activated(gate_up)
        with recording_launches() as second_calls:
            out = experts._down_and_combine(intermediate, routing, top_k_weights, hidden_states.dtype)
        if len(self._replays) >= REPLAYED_SHAPES:
            del self._replays[next(iter(self._replays))]
        first = ReplayedLaunches.of(
            (hidden_states, top_k_index, *_routing_tensors(routing), gate_up),
            (2, 3, 4, 5, 6),
            first_calls,
            self._tensors,
            out.device,
            stream,
        )
        second = ReplayedLaunches.of(
            (intermediate, top_k_weights, routing.row_of_pair, routing.expert_offsets, out),
            (4,),
            second_calls,
            self._tensors,
            out.device,
            stream,
        )
        replayed = first is not None and second is not None and gate_up.is_contiguous() and out.is_contiguous()
        self._replays[key] = ReplayedExperts(first, second, gate_up, out) if replayed else _not_replayed
        return out, routing


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


def _not_replayed(experts, hidden_states, top_k_index, top_k_weights, stream) -> None:
    """Stands for a routing shape whose launches cannot be replayed: the layer runs its forward."""
    return None


class ReplayedExperts:
    """The two recorded runs of an experts call's kernels, with the activation between them."""

    def __init__(self, first: ReplayedLaunches, second: ReplayedLaunches, gate_up: torch.Tensor, out: torch.Tensor):
        self._first, self._second = first, second
        self._gate_up = (tuple(gate_up.shape), gate_up.dtype)
        self._out = (tuple(out.shape), out.dtype)

    def __call__(self, experts, hidden_states, top_k_index, top_k_weights, stream) -> tuple[torch.Tensor, Routing]:
        routing = routing_in(routing_buffer(top_k_index, experts.num_experts), top_k_index.shape[0], experts.num_experts)
        gate_up = hidden_states.new_empty(self._gate_up[0], dtype=self._gate_up[1])
        self._first((hidden_states, top_k_index, *_routing_tensors(routing), gate_up), stream)
        intermediate = experts._activated(gate_up)
        out = hidden_states.new_empty(self._out[0], dtype=self._out[1])
        self._second((intermediate, top_k_weights, routing.row_of_pair, routing.expert_offsets, out), stream)
        return out, routing
