"""How the inference kernels are launched so that ``torch.compile`` can trace them."""

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
