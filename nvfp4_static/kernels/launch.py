"""Host-side helpers the launchers share: a kernel launch that tracing can see, and grid arithmetic.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``constexpr_function``s, about 2 us
of Python per call on the host; a launch computes several, and calibration launches at every
observed layer, so grids are computed with the plain-integer versions below (they also work on
``torch.SymInt``).
"""

import os

from torch.library import wrap_triton


def traceable(kernel):
    """``wrap_triton(kernel)``, or the kernel itself under Triton's interpreter.

    torch 2.11's ``wrap_triton`` rejects the interpreter's kernel objects (2.13 accepts them);
    interpreted kernels only run eagerly on CPU tensors, where tracing does not matter.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    return wrap_triton(kernel)


def ceil_div(a, b):
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 that is ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
