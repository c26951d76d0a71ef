"""The Triton route replayed from a converted layer in eager mode, with its host work done once.

At decode sizes a linear's kernels take a few microseconds of GPU time, while reaching them
through the general route (``backends.triton_route``: the tile choice, the ops' checks, Triton's
argument binding and kernel lookup per launch) costs several times that on the host, so an eager
model waits on Python. Here the first call for an activation shape, dtype, device and stream runs
the general route while recording its kernel launches (``kernels.launch.recording_launches``);
later calls replay them (``kernels.replay.ReplayedLaunches``) with that call's activation, a new
output and the stream's scratch memory in place of the first call's: the same kernels with the
same arguments, hence the same outputs bit for bit. The first replay of each recording is
checked against the route (``kernels.replay.reproduces``).

Under a CUDA graph capture nothing is recorded or replayed: the route runs, giving the graph
its own scratch memory and tile counters (a replay's are the stream's, which two graphs
replayed side by side would share) and the graphs' tiles (``kernels.gemm.captured_into_a_graph``).

Replayed: plain, contiguous, 16-byte aligned CUDA activations of at most the largest M that
``kernels.gemm.GEMM_CONFIGS`` serves with Triton tiles (run in Triton or, on Hopper, as the
warp-specialized Gluon GEMM; above it cuBLAS runs the product, or on Hopper up to 2048 rows the
tall Gluon tile, and the host work is small beside the GPU's), outside any tracing or dispatch
mode, with the weight's tensors in the layout convert makes. Every other call returns None and
the layer takes the general route.
"""

from typing import Optional

import torch

from nvfp4_static.kernels.launch import KernelCall, recording_launches
from nvfp4_static.kernels.replay import ReplayedLaunches, reproduces, warn_not_reproduced

__all__ = ["EagerTritonLaunches"]

# Activation shapes a layer keeps replays for: a server prefilling prompts of many lengths would
# otherwise keep one per length in every layer. A shape forgotten and seen again is recorded again
# (its call runs the general route once).
REPLAYED_SHAPES = 64


class EagerTritonLaunches:
    """One layer's replayable linears, one per (activation shape, dtype, device, stream), for
    the ``REPLAYED_SHAPES`` most recently recorded.

    Prepared for the weight tensors and bias the layer holds; a call with others (the layer
    moved to another device, a new weight assigned) starts over. A copy of the layer
    (``deepcopy``, pickling) starts empty, since what is kept holds the addresses of the
    original's tensors.
    """

    def __init__(self):
        self._tensors: tuple = ()
        self._largest_rows = 0
        self._linears: dict = {}

    def __deepcopy__(self, memo) -> "EagerTritonLaunches":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def linear(self, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``static_linear(x, weight, bias)``: replayed where it can be, else by the route
        itself (what ``F.linear`` reaches through the subclass's dispatch, without its host cost)."""
        out = self(x, weight, bias)
        if out is None:
            from nvfp4_static.tensor import static_linear

            out = static_linear(x, weight, bias)
        return out

    def __call__(self, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``static_linear(x, weight, bias)``, or None where this call is not replayed."""
        if (
            type(x) is not torch.Tensor
            or not x.is_cuda
            or torch._C._len_torch_dispatch_stack()
            or torch._C._cuda_isCurrentStreamCapturing()
        ):
            return None
        tensors = self._tensors
        if (
            not tensors
            or weight.qdata is not tensors[0]
            or weight.scale is not tensors[1]
            or weight.per_tensor_scale is not tensors[2]
            or weight.act_per_tensor_scale is not tensors[3]
            or bias is not tensors[4]
        ):
            self._hold(weight, bias)
        device = x.get_device()
        if not self._largest_rows or device != torch._C._cuda_getDevice():
            return None
        stream = torch._C._cuda_getCurrentRawStream(device)
        key = (x.shape, x.dtype, device, stream)
        linear = self._linears.get(key, _UNRECORDED)
        if not (x.is_contiguous() and x.data_ptr() % 16 == 0) or linear is None:
            return None
        if linear is _UNRECORDED:
            if not 0 < x.numel() <= self._largest_rows * x.shape[-1]:
                return None
            return self._record(key, x, weight, bias, stream)
        if linear.checked:
            return linear(x, stream)
        return self._first_replay(key, linear, x, weight, bias, stream)

    def _record(self, key: tuple, x: torch.Tensor, weight, bias: Optional[torch.Tensor], stream) -> torch.Tensor:
        """Run the route for ``x`` and keep its launches' replay under ``key``, making room by
        forgetting the oldest recorded key."""
        from nvfp4_static.tensor import static_linear

        with recording_launches() as calls:
            out = static_linear(x, weight, bias)
        if len(self._linears) >= REPLAYED_SHAPES:
            del self._linears[next(iter(self._linears))]
        self._linears[key] = ReplayedLinear.of(x, out, calls, self._tensors, stream)
        return out

    def _first_replay(
        self, key: tuple, linear: "ReplayedLinear", x: torch.Tensor, weight, bias: Optional[torch.Tensor], stream
    ) -> torch.Tensor:
        """The route's output for ``x``, and the replay's on scratch memory of 0xFF bytes beside
        it: the replay is kept if the two agree bit for bit, else the shape is not replayed."""
        from nvfp4_static.tensor import static_linear

        linear.poison_scratch()
        replayed = linear(x, stream)
        out = static_linear(x, weight, bias)
        if reproduces((replayed,), (out,)):
            linear.checked = True
        else:
            self._linears[key] = None
            warn_not_reproduced(
                f"a linear of weight {list(weight.shape)} called on a {x.dtype} activation of shape {list(x.shape)}"
            )
        return out

    def _hold(self, weight, bias: Optional[torch.Tensor]) -> None:
        """Forget what was prepared and take ``weight`` and ``bias``; replay only if the weight
        runs on the Triton route with its tensors in convert's layout (which the route uses as
        they are: a converted copy would be a buffer the replay does not refill)."""
        self._tensors = (weight.qdata, weight.scale, weight.per_tensor_scale, weight.act_per_tensor_scale, bias)
        self._linears = {}
        self._largest_rows = 0
        device = weight.qdata.device
        scales = (weight.per_tensor_scale, weight.act_per_tensor_scale)
        if (
            weight.linear_backend != "triton"
            or device.type != "cuda"
            or not (weight.qdata.dtype == torch.uint8 and weight.qdata.dim() == 2 and weight.qdata.is_contiguous())
            or not (weight.scale.dtype == torch.float8_e4m3fn and weight.scale.is_contiguous())
            or any(s is None or s.dtype != torch.float32 or s.numel() != 1 or s.device != device for s in scales)
            or (bias is not None and (bias.dim() != 1 or not bias.is_contiguous() or bias.device != device))
        ):
            return
        from nvfp4_static.kernels.gemm import triton_entries

        self._largest_rows = max(max_m for max_m, _ in triton_entries())


# A key with no entry: that shape's first call records it. An entry of None: not replayed.
_UNRECORDED = object()


class ReplayedLinear:
    """The kernel launches one call of the Triton route made, replayable with a new activation
    (``kernels.replay.ReplayedLaunches``, the activation and the output given at each call; a
    replay allocates the output). ``checked``: whether its first replay agreed with the route."""

    def __init__(self, launches: ReplayedLaunches, out: torch.Tensor):
        self._launches = launches
        self._out_shape, self._out_dtype = tuple(out.shape), out.dtype
        self.checked = False

    @classmethod
    def of(
        cls, x: torch.Tensor, out: torch.Tensor, calls: list[KernelCall], weight_tensors: tuple, stream: Optional[int]
    ) -> Optional["ReplayedLinear"]:
        """The replay on the raw CUDA ``stream`` of the launches ``calls`` that computed ``out``
        from ``x``, or None where ``ReplayedLaunches.of`` refuses them or ``out`` is not
        contiguous."""
        launches = ReplayedLaunches.of((x, out), (1,), calls, weight_tensors, out.device, stream)
        return cls(launches, out) if launches is not None and out.is_contiguous() else None

    def __call__(self, x: torch.Tensor, stream: Optional[int]) -> torch.Tensor:
        out = x.new_empty(self._out_shape, dtype=self._out_dtype)
        self._launches((x, out), stream)
        return out

    def poison_scratch(self) -> None:
        self._launches.poison_scratch()
