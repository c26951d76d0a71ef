"""Kernel launches recorded at one call and replayed at later ones with new tensors.

An eager layer's kernels at decode sizes take a few microseconds of GPU time each, while the
Python that reaches them (choosing tiles, checking operands, allocating buffers, binding each
launch's arguments) takes several times that on the host. A layer that records the launches of
its first call for a shape (``kernels.launch.recording_launches``) can redo them at later calls
with only the tensors that change: the same kernels with the same arguments otherwise, hence
the same outputs bit for bit. ``backends.triton_eager`` does this for a linear,
``experts.eager`` for a mixture-of-experts layer.

What a recording sees is the kernel launches only: a torch op inside the recorded code (a buffer
filled or zeroed by torch before a kernel reads it) is not redone, and a replay would read
whatever an earlier layer left in its scratch memory. So the first replay of each recording runs
on scratch filled with 0xFF bytes (NaN in every float format) beside the layer's own call, and
the recording is kept only if the two outputs agree bit for bit (``reproduces``); otherwise the
layer warns (``warn_not_reproduced``) and calls that shape without the replay from then on.
"""

from dataclasses import replace
from typing import Optional

import torch

from nvfp4_static.kernels.launch import KernelCall, PreparedLaunch, ceil_div
from nvfp4_static.messages import warn

__all__ = ["ReplayedLaunches", "reproduces", "scratch_arena", "warn_not_reproduced"]


class ReplayedLaunches:
    """The kernel launches one call made, replayable with that call's own tensors replaced.

    Each tensor argument of the recorded launches is one of the call's given tensors (its
    inputs and its outputs, new at every call) or a view inside one, a fixed tensor (a weight,
    or a kernel's workspace, which it leaves as it found it) kept as it is, or else a scratch
    buffer the launches' callers allocated (an activation operand, a split K's partial
    products). A replay takes its scratch buffers from the stream's ``scratch_arena`` and
    launches the same kernels in the same order with the given tensors in the recorded ones'
    places. A TMA descriptor argument (``gemm_warp_specialized``'s kernel reads its operands
    through them) may describe a fixed tensor or a scratch buffer, whose place in the arena is
    the same at every replay: it is built once, over that.
    """

    def __init__(
        self,
        calls: list[KernelCall],
        per_call: dict[int, tuple[int, int]],
        given: int,
        scratch: list,
        workspace: list,
        device,
        stream,
    ):
        offsets, end = [], 0
        for shape, dtype in scratch:
            offsets.append(end)
            end += ceil_div(shape.numel() * dtype.itemsize, _SCRATCH_ALIGNMENT) * _SCRATCH_ALIGNMENT
        arena = scratch_arena(device, stream, end)
        self._scratch_bytes = arena[:end]
        self._scratch = tuple(
            arena[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for offset, (shape, dtype) in zip(offsets, scratch)
        )
        self._launches = [PreparedLaunch(_describing(call, per_call, self._scratch, given), per_call) for call in calls]
        # The launches hold the fixed tensors' addresses only: the workspace is kept alive here.
        self._workspace = workspace

    @classmethod
    def of(
        cls, given: tuple, written: tuple, calls: list[KernelCall], fixed: tuple, device, stream: Optional[int]
    ) -> Optional["ReplayedLaunches"]:
        """The replay on the raw CUDA ``stream`` of ``device`` of the launches ``calls`` a call
        made with the tensors ``given``, of which those at the indices ``written`` are outputs,
        or None if it cannot redo them: no launch, an output no launch took, a scratch buffer
        that is not contiguous or is used under two shapes, or a TMA descriptor of a given
        tensor (which would have to be built again at every call). ``fixed``: the tensors kept
        from call to call (None entries ignored)."""
        workspace = [t for call in calls for t in call.workspace]
        kept = {t.data_ptr() for t in (*fixed, *workspace) if t is not None}
        # Where each tensor argument is in what a launch is handed: (index, byte offset), the
        # given tensors first, then the scratch buffers.
        per_call: dict[int, tuple[int, int]] = {}
        scratch = []
        taken = set()
        for call in calls:
            for argument in call.args:
                value = _described(argument)
                if not isinstance(value, torch.Tensor) or value.data_ptr() in kept:
                    continue
                address = value.data_ptr()
                place = per_call.get(address) or _place_in(address, given)
                if place is None:
                    if not value.is_contiguous():
                        return None
                    place = (len(given) + len(scratch), 0)
                    scratch.append((value.shape, value.dtype))
                elif place[0] >= len(given):
                    if scratch[place[0] - len(given)] != (value.shape, value.dtype):
                        return None
                elif value is not argument:
                    return None
                else:
                    taken.add(place[0])
                per_call[address] = place
        if not calls or not set(written) <= taken:
            return None
        return cls(calls, per_call, len(given), scratch, workspace, device, stream)

    def __call__(self, tensors: tuple, stream: Optional[int]) -> None:
        """Launch the recorded kernels with ``tensors`` in the given tensors' places (each of
        the recorded one's dtype, size and 16-byte alignment), on the raw CUDA ``stream``."""
        tensors = (*tensors, *self._scratch)
        for launch in self._launches:
            launch(stream, tensors)

    def poison_scratch(self) -> None:
        """Fill this replay's scratch memory with 0xFF bytes, so that a launch reading a buffer
        no recorded launch wrote gives NaNs (or other values than the recorded call's)."""
        self._scratch_bytes.fill_(0xFF)


def reproduces(replayed: tuple, own: tuple) -> bool:
    """Whether each tensor of ``replayed`` equals the one of ``own`` at its place bit for bit
    (NaNs included). Reads the result on the host: once per recording."""
    return all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)) for a, b in zip(replayed, own)
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.dtype.is_floating_point else tensor


def warn_not_reproduced(what: str) -> None:
    """Warn that the first replay of ``what``'s recorded launches gave another output than the
    call's own (a bug of this package: the launches read memory the recording did not see
    written), and that such calls go without the replay from now on."""
    warn(
        f"nvfp4_static: {what}: replaying the kernel launches recorded at its first call gave "
        f"another output than the call itself, so these calls run without the replay from now "
        f"on (the same outputs, more host time per call). Please report this with the shapes "
        f"named here",
        RuntimeWarning,
    )


def _place_in(address: int, given: tuple) -> Optional[tuple[int, int]]:
    """``(index, byte offset)`` of the given tensor whose memory holds ``address``, else None."""
    for index, tensor in enumerate(given):
        start = tensor.data_ptr()
        if start == address:
            return index, 0
        if tensor.is_contiguous() and start < address < start + tensor.numel() * tensor.element_size():
            return index, address - start
    return None


def _described(argument):
    """The tensor a TMA descriptor argument describes (its ``base``), else the argument."""
    base = getattr(argument, "base", None)
    return base if isinstance(base, torch.Tensor) else argument


def _describing(call: KernelCall, per_call: dict[int, tuple[int, int]], scratch: tuple, given: int) -> KernelCall:
    """``call`` with each TMA descriptor of a scratch buffer describing that buffer's place in
    the arena instead (``scratch[i - given]`` for the buffer ``per_call`` places at ``i``)."""
    args = []
    for argument in call.args:
        described = _described(argument)
        if described is not argument and described.data_ptr() in per_call:
            argument = replace(argument, base=scratch[per_call[described.data_ptr()][0] - given])
        args.append(argument)
    return call._replace(args=tuple(args))


# Scratch buffers start on this boundary (the caching allocator's, more than any kernel needs).
_SCRATCH_ALIGNMENT = 512
_SCRATCH_ARENAS: dict[tuple, torch.Tensor] = {}


def scratch_arena(device: torch.device, stream: Optional[int], nbytes: int) -> torch.Tensor:
    """At least ``nbytes`` bytes of scratch memory shared by the replays on one device and
    stream: a stream runs one layer's kernels after another's, so each can use the same bytes
    for its short-lived buffers, and a replay allocates none. A larger need gets a new, larger
    buffer; the replays holding the old one keep it."""
    key = (device, stream)
    arena = _SCRATCH_ARENAS.get(key)
    if arena is None or arena.numel() < nbytes:
        size = max(nbytes, 2 * arena.numel() if arena is not None else 0)
        arena = _SCRATCH_ARENAS[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return arena
