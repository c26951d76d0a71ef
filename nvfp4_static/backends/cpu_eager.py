"""The CPU kernel called from a converted layer in eager mode, its weight checked once.

At decode a small CPU linear's kernel takes microseconds, and the general route to it (the
weight subclass's linear, the backend's checks of every operand and conversions of the global
scales, ctypes converting sixteen arguments) costs more than that on the host: a 64 x 64 layer's
call took 45 us through it and 12-13 us prepared, on 2 EPYC cores
(``examples/benchmarks/RESULTS.md``, "Static NVFP4 linear on a CPU"). Here a layer checks its
weight's tensors and bias once, as the general route checks them, and keeps their kernel
arguments; a later call checks that it holds the same tensors at the same addresses and what the
activation is, and calls the kernel with the same arguments as the general route, so the outputs
are the same bit for bit.

Taken: a plain, bfloat16 or float32 CPU activation of 1 to ``Kernel.most_rows`` rows, outside any
tracing or dispatch mode and recording no gradients, with the weight on the ``cpu`` backend and
the kernel built. Every other call returns None and the layer takes the general route, which
converts, refuses or falls back to torch ops as it does for any caller.
"""

from typing import NamedTuple, Optional

import torch

from nvfp4_static.backends import cpu, cpu_kernel
from nvfp4_static.inference_only import records_gradients, refusing_gradients

__all__ = ["EagerCpuKernelCalls", "eager_linear"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class _WeightArguments(NamedTuple):
    """What a call passes the kernel for one weight: its shape and its tensors' addresses."""

    k: int
    n: int
    addresses: cpu_kernel.WeightAddresses


class EagerCpuKernelCalls:
    """One layer's prepared CPU kernel calls, for the weight tensors and bias it last saw.

    A call with other tensors, or with the same ones at other addresses (``.data`` assigned),
    prepares again. What is kept is one tuple, replaced whole, so that calls from several
    threads never pair one weight's tensors with another's arguments. A copy of the layer
    (``deepcopy``, pickling) starts empty, since what is kept holds the original's addresses.
    """

    def __init__(self):
        # (the weight's tensors and bias, their addresses, the kernel arguments or None)
        self._prepared: tuple = ((), (), None)

    def __deepcopy__(self, memo) -> "EagerCpuKernelCalls":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def __call__(self, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``static_linear(x, weight, bias)`` through the kernel, or None where this call is not
        taken here."""
        if (
            type(x) is not torch.Tensor
            or not x.is_cpu
            or x.dtype not in _KERNEL_DTYPES
            or torch._C._len_torch_dispatch_stack()
        ):
            return None
        tensors = (weight.qdata, weight.scale, weight.per_tensor_scale, weight.act_per_tensor_scale, bias)
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        held, held_addresses, arguments = self._prepared
        if addresses != held_addresses or any(a is not b for a, b in zip(tensors, held)):
            arguments = self._prepare(weight, bias, tensors, addresses)
        if arguments is None or x.dim() == 0 or x.shape[-1] != arguments.k:
            return None
        lib = cpu_kernel.library()  # None once switched off
        rows = x.numel() // arguments.k
        if lib is None or not 0 < rows <= lib.most_rows:
            return None
        out = torch.empty(x.shape[:-1] + (arguments.n,), dtype=x.dtype, device="cpu")
        recording = records_gradients(x, bias)
        rows_in = (x.detach() if recording else x).contiguous()
        cpu_kernel.call_kernel(lib, rows_in, rows, arguments.k, arguments.n, arguments.addresses, bias, out)
        return refusing_gradients(out, x, bias) if recording else out

    def _prepare(
        self, weight, bias: Optional[torch.Tensor], tensors: tuple, addresses: tuple
    ) -> Optional[_WeightArguments]:
        """Hold ``tensors`` and ``addresses`` with the kernel's arguments for them, where the
        general route would call the kernel on them as they are (no copy or conversion), else
        None; return the arguments."""
        arguments = self._arguments_for(weight, bias, tensors)
        self._prepared = (tensors, addresses, arguments)
        return arguments

    @staticmethod
    def _arguments_for(weight, bias: Optional[torch.Tensor], tensors: tuple) -> Optional[_WeightArguments]:
        qdata, scale, weight_scale, act_scale = tensors[:4]
        if weight.linear_backend != "cpu" or weight.is_transposed() or qdata.dim() != 2:
            return None
        n, k = qdata.shape[0], 2 * qdata.shape[1]
        if not cpu_kernel.reads_as_they_are(qdata, scale, weight_scale, act_scale) or not (
            bias is None or (bias.is_cpu and bias.is_contiguous() and bias.dtype in _KERNEL_DTYPES)
        ):
            return None
        try:  # the general route's own checks, with an empty activation of the weight's width
            cpu_kernel.check_operands(torch.empty(0, k, device="cpu"), qdata, scale, weight_scale, act_scale, bias)
        except ValueError:
            return None  # the general route raises its error at this call
        addresses = cpu_kernel.WeightAddresses(
            act_scale.data_ptr(), qdata.data_ptr(), scale.data_ptr(), cpu.decoding_tables()[1].data_ptr(),
            weight_scale.data_ptr(),
        )
        return _WeightArguments(k, n, addresses)


def eager_linear(cpu_calls: Optional[EagerCpuKernelCalls], triton_launches, x: torch.Tensor, weight, bias):
    """``static_linear(x, weight, bias)`` as an eager layer runs it: through ``cpu_calls`` where
    they take the call, else ``triton_launches.linear`` (an ``EagerTritonLaunches``: replayed on
    the Triton route, else the general route)."""
    out = None if cpu_calls is None else cpu_calls(x, weight, bias)
    return triton_launches.linear(x, weight, bias) if out is None else out
