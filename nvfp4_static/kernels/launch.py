"""Host-side launch helpers: registering and tracing the inference kernels, and grid arithmetic.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``constexpr_function``s, about 2 us
of Python per call on the host; a launch computes several, and calibration launches at every
observed layer, so grids are computed with the plain-integer versions below (they also work on
``torch.SymInt``).
"""

import functools
import os

import torch
from torch._library.triton import set_wrap_triton_enabled  # private; what triton_op uses
from torch.library import triton_op, wrap_triton


def traced_op(name: str):
    """Register the decorated function as the ``torch.library.triton_op`` ``name``, and return
    a function that calls that op while ``torch.compile`` / ``torch.export`` trace and the body
    itself otherwise.

    In eager mode the custom op's dispatch is pure host overhead (skipping it took an eager
    decode linear from 0.12 to 0.075 ms on an H100 host, where the GPU needs 0.03;
    examples/benchmarks/RESULTS.md); the op exists for tracing, where it keeps the kernels
    visible to Inductor. The op stays reachable as ``torch.ops.nvfp4_static.<name>`` and as the
    returned function's ``op``.
    """

    def register(body):
        op = triton_op(f"nvfp4_static::{name}", mutates_args=())(body)

        @functools.wraps(body)
        def call(*args, **kwargs):
            if not runs_eagerly(*args):
                return op(*args, **kwargs)
            # As the op's own eager kernel does: with real tensors, wrap_triton hands back the
            # bare kernel (its traceable wrapper would dispatch each launch as an operator).
            with set_wrap_triton_enabled(False):
                return body(*args, **kwargs)

        call.op = op
        return call

    return register


def traceable(kernel):
    """``wrap_triton(kernel)``, or the kernel itself under Triton's interpreter.

    torch 2.11's ``wrap_triton`` rejects the interpreter's kernel objects (2.13 accepts them);
    interpreted kernels only run eagerly on CPU tensors, where tracing does not matter.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    return wrap_triton(kernel)


def runs_eagerly(*args) -> bool:
    """Whether a call with ``args`` runs on real tensors outside of any tracing, so that it may
    launch kernels directly: not under dynamo, no dispatch mode (fake tensors, make_fx,
    functionalization, which is also how dynamo runs a tensor subclass's ops), and every tensor
    argument a plain ``torch.Tensor``."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and all(type(arg) is torch.Tensor for arg in args if isinstance(arg, torch.Tensor))
    )


def ceil_div(a, b):
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 that is ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
