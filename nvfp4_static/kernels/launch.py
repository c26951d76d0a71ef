"""Host-side helpers the launchers share: a kernel launch that tracing can see, a launch kept
for replaying with little host work, and grid arithmetic.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``constexpr_function``s, about 2 us
of Python per call on the host; a launch computes several, and calibration launches at every
observed layer, so grids are computed with the plain-integer versions below (they also work on
``torch.SymInt``).
"""

import contextlib
import os
import threading
from functools import lru_cache
from typing import Any, NamedTuple, Optional

import torch
from torch.library import wrap_triton

try:  # Triton's own specialisation of an argument, which keys its compiled kernels
    from triton._C.libtriton import native_specialize_impl as _native_specialize
    from triton.backends.compiler import BaseBackend as _BaseBackend
except ImportError:
    _native_specialize = _BaseBackend = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonTensorDescriptor
except ImportError:
    _GluonTensorDescriptor = ()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def traceable(kernel):
    """``wrap_triton(kernel)`` where the launch is being traced, else the kernel itself.

    On real tensors (an eager call, an opaque op's body, a compiled graph's run) torch's
    wrapper would route each launch through its tracing machinery, which wraps a launch with
    options in a new one-config autotuner and adds it to torch's global Triton kernel side
    table, one entry per launch. torch 2.11's ``wrap_triton`` also rejects the interpreter's
    kernel objects, which only run on CPU tensors outside tracing.
    """
    if interpreting() or not traced():
        return kernel
    return wrap_triton(kernel)


def traced() -> bool:
    """Whether a launch here is being traced: dynamo reading the bytecode, or a dispatch mode
    recording it (``traced_by_a_dispatch_mode``)."""
    return torch.compiler.is_compiling() or traced_by_a_dispatch_mode()


_recorder = threading.local()


def runs_eagerly(*args) -> bool:
    """Whether a call with ``args`` runs on real tensors outside of any tracing, so that it may
    launch kernels directly: not under dynamo, no dispatch mode (fake tensors, make_fx,
    functionalization, which is also how dynamo runs a tensor subclass's ops), and every tensor
    argument a plain ``torch.Tensor``."""
    return not traced() and all(type(arg) is torch.Tensor for arg in args if isinstance(arg, torch.Tensor))


class KernelCall(NamedTuple):
    """One launch of a Triton kernel: ``kernel[grid](*args, **meta)``, ``meta`` holding the
    constexpr parameters and the launch options (``num_warps``, ``num_stages``). ``workspace``
    names the tensor arguments the kernel keeps across launches and leaves as it found them
    (a replay passes them again rather than new buffers)."""

    kernel: Any
    grid: tuple
    args: tuple
    meta: dict
    workspace: tuple = ()

    def launch(self) -> None:
        """Launch it (visible to tracing), and add it to the list ``recording_launches`` fills."""
        kernel, meta = self.kernel, self.meta
        options = {name: meta[name] for name in LAUNCH_OPTIONS if name in meta}
        if options and not interpreting() and traced_by_a_dispatch_mode():
            kernel = with_launch_options(kernel, **options)
            meta = {name: value for name, value in meta.items() if name not in options}
        traceable(kernel)[self.grid](*self.args, **meta)
        record_launch(self)


LAUNCH_OPTIONS = ("num_warps", "num_stages")


def traced_by_a_dispatch_mode() -> bool:
    """Whether a dispatch mode records a launch here (make_fx, fake tensors, functionalization:
    how Inductor traces a ``triton_op``'s body); False while dynamo reads the bytecode, which
    reads ``is_compiling()`` as True and leaves the rest of the test unread."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() > 0


@lru_cache(maxsize=None)
def with_launch_options(kernel, **options):
    """``kernel`` as a one-config ``triton.autotune`` holding the launch ``options``, one object
    per kernel and options.

    A traced launch that passes ``num_warps`` or ``num_stages`` as arguments gets a new
    one-config autotuner from torch at every trace, each added to torch's global Triton kernel
    side table, which Inductor walks (parsing each kernel's source) at every graph it compiles,
    so that a compile would slow with the model's linears and with every compile before it.
    This object is added once.
    """
    import triton

    return triton.autotune(configs=[triton.Config({}, **options)], key=[])(kernel)


def record_launch(call: KernelCall) -> None:
    """Add ``call``, just launched, to the list ``recording_launches`` fills, if one is being
    filled (a launcher that launches by other means than ``KernelCall.launch`` calls this)."""
    recorded = getattr(_recorder, "calls", None)
    if recorded is not None:
        recorded.append(call)


@contextlib.contextmanager
def recording_launches():
    """Collect, in order, every ``KernelCall`` this thread launches inside the block."""
    calls = []
    outer = getattr(_recorder, "calls", None)
    _recorder.calls = calls
    try:
        yield calls
    finally:
        _recorder.calls = outer


class PreparedLaunch:
    """A ``KernelCall`` kept for launching again with other tensors in some of its arguments,
    at a fraction of the host work of ``kernel[grid](...)``.

    Triton's launch binds the arguments, computes their specialisation key and looks the
    compiled kernel up on every call; here that is done once, and each call hands the compiled
    kernel's launcher the arguments in the kernel's order, every tensor as its address.
    ``per_call`` maps the address of each tensor argument that changes per call to where it is
    in the tensors a call is given: ``(index, byte offset)`` (an argument may be a view inside
    one of them). A replacement must share the dtype and the 16-byte alignment of the tensor it
    replaces (the compiled kernel is specialised on both); every other tensor argument must
    outlive this object. Under Triton's interpreter a call goes through ``kernel[grid]`` with the
    tensors themselves (an argument at an offset: the view of the given tensor there).
    """

    def __init__(self, call: KernelCall, per_call: dict[int, tuple[int, int]], keep_arguments: bool = True):
        names = call.kernel.arg_names
        parameters = dict(zip(names, call.args))
        parameters.update((name, value) for name, value in call.meta.items() if name in names)
        values = [parameters[name] for name in names]
        self._slots = [
            (argument, *per_call[value.data_ptr()])
            for argument, value in enumerate(values)
            if isinstance(value, torch.Tensor) and value.data_ptr() in per_call
        ]
        self._options = {name: value for name, value in call.meta.items() if name not in names}
        self._kernel = call.kernel
        self._grid = _three_dimensional(call.grid)
        self._interpreted = interpreting()
        if self._interpreted:
            self._values = values
            # The layout each per-call argument is viewed with.
            self._layouts = {
                argument: (values[argument].dtype, values[argument].shape, values[argument].stride())
                for argument, _, _ in self._slots
            }
            return
        from triton import knobs

        self._runtime_knobs = knobs.runtime
        compiled = call.kernel.warmup(*values, grid=call.grid, **self._options)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        self._compiled = compiled
        self._run = compiled.run  # loads the module (the launcher and the function handle)
        self._function = compiled.function
        self._packed_metadata = compiled.packed_metadata
        # Addresses rather than tensors: Triton's launcher then neither calls data_ptr() nor
        # asks the driver about each pointer. Without ``keep_arguments`` (a caller that passes
        # every argument to ``launch_with``) none is kept: an argument object may hold tensors.
        self._values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values] if keep_arguments else None

    def __call__(self, stream: Optional[int], tensors: tuple) -> None:
        """Launch on the raw CUDA ``stream`` (None under the interpreter) with ``tensors``."""
        values = self._values.copy()
        if self._interpreted:
            for argument, tensor, offset in self._slots:
                values[argument] = _view_at(tensors[tensor], offset, *self._layouts[argument])
            self._kernel[self._grid](*values, **self._options)
            return
        for argument, tensor, offset in self._slots:
            values[argument] = tensors[tensor].data_ptr() + offset
        self.launch_with(self._grid, stream, values)

    def launch_with(self, grid: tuple, stream: int, values: list) -> None:
        """Launch the compiled kernel on ``grid`` (three dimensions) and the raw CUDA ``stream``
        with ``values``: every parameter of the kernel in order (constexprs included), each
        specialised as the first call's (a caller with its own arguments keys its launches on
        their specialisation)."""
        enter_hook = _calls_something(self._runtime_knobs.launch_enter_hook)
        exit_hook = _calls_something(self._runtime_knobs.launch_exit_hook)
        metadata = None
        if enter_hook is not None or exit_hook is not None:  # a profiler's hooks, as Triton calls them
            metadata = self._compiled.launch_metadata(grid, stream, *values)
        self._run(*grid, stream, self._function, self._packed_metadata, metadata, enter_hook, exit_hook, *values)


def _three_dimensional(grid) -> tuple:
    """``grid`` with the unnamed dimensions as 1, as a compiled kernel's launcher takes it."""
    return tuple(grid) + (1,) * (3 - len(grid))


def _view_at(tensor: torch.Tensor, offset: int, dtype: torch.dtype, shape, stride) -> torch.Tensor:
    """The view of ``tensor``'s memory ``offset`` bytes in, of ``dtype``, ``shape`` and
    ``stride``: a per-call argument as a kernel under the interpreter takes it."""
    if offset == 0 and (tensor.dtype, tensor.shape, tensor.stride()) == (dtype, shape, stride):
        return tensor
    start = tensor.storage_offset() * tensor.element_size() + offset
    return torch.empty(0, dtype=dtype, device=tensor.device).set_(
        tensor.untyped_storage(), start // dtype.itemsize, shape, stride
    )


# Compiled launches by kernel, device, launch constants and the specialisation of their other
# arguments (Triton's, which decides the compiled kernel): a launch through the kernel's own
# ``[grid](...)`` binds its arguments and looks the kernel up again each time, about 0.1 ms of
# host work per Gluon launch on an H200's host, as much as a GEMM's GPU time at a few hundred
# rows, and tens of microseconds per Triton launch.
_PREPARED: dict[tuple, PreparedLaunch] = {}


def launch_prepared(call: KernelCall, device: torch.device) -> None:
    """Launch ``call`` on ``device``'s current stream through a ``PreparedLaunch`` kept per
    specialisation (Triton's of its arguments other than Gluon's TMA descriptors, which every
    call of a kernel's tiles builds alike; the values of its constexpr arguments), and record it
    for an eager layer's replay (``backends.triton_eager``). Traced, or under Triton's
    interpreter, ``call.launch()``."""
    if _native_specialize is None or interpreting() or traced():
        call.launch()
        return
    constants = _constexpr_positions(call.kernel)
    specialisation = (
        ("value", value) if position in constants else _native_specialize(_BaseBackend, value, False, True, True)
        for position, value in enumerate(call.args)
        if not isinstance(value, _GluonTensorDescriptor)
    )
    key = (call.kernel, device.index, *sorted(call.meta.items()), *specialisation)
    prepared = _PREPARED.get(key)
    if prepared is None:
        prepared = _PREPARED[key] = PreparedLaunch(call, {}, keep_arguments=False)
    values = [*call.args, *(call.meta[name] for name in call.kernel.arg_names[len(call.args):])]
    prepared.launch_with(_three_dimensional(call.grid), torch._C._cuda_getCurrentRawStream(device.index), values)
    record_launch(call)


@lru_cache(maxsize=None)
def _constexpr_positions(kernel) -> frozenset:
    """The positions of ``kernel``'s constexpr parameters: a value passed there is compiled into
    the kernel, so it keys the launch itself, not by its specialisation."""
    return frozenset(index for index, parameter in enumerate(kernel.params) if parameter.is_constexpr)


def _calls_something(hook):
    """``hook``, or None where it would do nothing: Triton 3.6's hooks are chains, empty unless a
    profiler added to them, and a launch that passes an empty chain pays for calling it."""
    return hook if hook is not None and getattr(hook, "calls", True) else None


@lru_cache(maxsize=None)
def overlaps_kernels(device: torch.device) -> bool:
    """Whether a kernel on ``device`` may start while the one before it still runs (CUDA's
    programmatic dependent launch, sm_90 onwards): Triton's ``launch_pdl``, with the earlier
    kernel's ``griddepcontrol.launch_dependents`` and the later one's ``griddepcontrol.wait``
    before it reads the earlier one's output. Never under Triton's interpreter."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def ceil_div(a, b):
    return (a + b - 1) // b


def splits_hold_k_tiles(k_tiles: int, split_k: int) -> bool:
    """Whether ``split_k`` K splits of ``k_tiles`` tiles, ``ceil(k_tiles / split_k)`` each as the
    GEMM kernels cut them, give every split at least one tile."""
    return split_k >= 1 and (split_k - 1) * ceil_div(k_tiles, split_k) < k_tiles


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 that is ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
