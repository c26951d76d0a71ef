"""Moving decoder layers to the accelerator and back while another layer computes.

Layer-by-layer calibration holds one decoder layer at a time on the device. Moved plainly
(``layer.to(device)``, later ``layer.to(home)``), the device idles during every copy, and an 8B
model's layers copied from pageable host memory take seconds. With ``overlap``, ``LayerMover``
hides those copies behind the compute:

- ``prefetch(layer)`` starts staging the next layer's tensors in a worker thread: on CUDA each
  is copied into pinned host memory (the slow, host-side part of a copy in);
- ``upload_prefetched()`` starts the staged tensors' transfer to the device on a side stream.
  The caller picks the moment: the layer's device memory is taken from then on, so calling it
  once the current layer's activations have peaked keeps one layer's worth of memory off the
  peak, and the transfer still runs beside the rest of the current layer's work;
- ``move_in(layer)`` hands the layer its copies (uploading them now if that has not started);
  the compute stream waits for them on the device, the host only for the staging;
- ``move_back(layer, home)`` moves a finished layer home in a second worker once the compute
  stream's work on it is done (``wait_moved_back`` waits for it). Its own thread and stream let
  the copy home run beside the next layer's staging. On CUDA it copies into pinned staging
  memory and from there into pageable host memory, so that the transfer is an asynchronous DMA
  and the host-side copy makes no CUDA call (a copy straight into pageable memory is a
  synchronous driver call for the whole transfer, which slows the compute thread's launches).

Data-parallel (``data_parallel=True``, every rank of ``group`` moving the same layers), each rank
stages and uploads only its share of every tensor's bytes, and an all-gather over the devices'
link (NVLink between GPUs of one host) completes each tensor on every rank: each rank's host
copies and host-to-device transfer shrink with the number of ranks. The all-gathers are issued
by the calling thread, where the ranks' other collectives are, so their order is the same on
every rank.

Only the calling thread changes a layer before and while it computes (``move_in``); the
move-back worker changes it only after (``move_back``). Copies are exact, so overlapping changes
no result. Between ``upload_prefetched`` and the end of a layer's work the device holds one more
layer, and the converted layer on its way home. Without ``overlap``, or for a layer that is not
wholly on the CPU, every move is a plain ``module.to``.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

from nvfp4_static.distributed import all_gather_into, ranks_that_failed

__all__ = ["LayerMover", "put_tensor", "tensor_slots"]


class LayerMover:
    """Moves layers to ``device`` and home; use it as a context manager (see the module
    docstring). On leaving it, the moves in flight finish and the workers stop; a failed move
    raises there unless an error is already on its way out."""

    def __init__(self, device: torch.device, overlap: bool, data_parallel: bool = False, group=None):
        if device.type == "cuda" and device.index is None:  # the worker's current device is 0
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.overlap = overlap
        # Data-parallel ranks hold the same layers: each stages and uploads its share of every
        # tensor's bytes, and an all-gather on the device puts the whole tensor on each.
        # (NCCL moves device tensors, gloo host ones: other pairings copy whole layers.)
        self._share = None
        if overlap and data_parallel and dist.get_world_size(group) > 1:
            if (dist.get_backend(group) == "nccl") == (device.type == "cuda"):
                self._share = (dist.get_rank(group), dist.get_world_size(group), group)
        self._workers = {
            direction: ThreadPoolExecutor(1, f"nvfp4_static-layer-mover-{direction}")
            for direction in ("in", "home")
        } if overlap else {}
        cuda = overlap and device.type == "cuda"
        self._streams = {direction: torch.cuda.Stream(device) for direction in ("in", "home")} if cuda else {}
        # The prefetched layer: (layer, its tensor slots, the future of its staged tensors), and
        # once its upload has started, (its device copies, their ready event or None).
        self._next: Optional[tuple] = None
        self._uploaded: Optional[tuple] = None
        self._moving_back: list[Future] = []

    def __enter__(self) -> "LayerMover":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if self._next is not None:
                future, self._next = self._next[2], None
                future.exception()  # wait; an unused prefetch's failure does not matter
            if error is None:
                self.wait_moved_back()
            else:
                for future in self._moving_back:
                    future.exception()
        finally:
            for worker in self._workers.values():
                worker.shutdown(wait=True)

    def prefetch(self, layer: torch.nn.Module) -> None:
        """Start staging ``layer`` for the device (a no-op without overlap)."""
        if not self._overlaps(layer) or (self._next is not None and self._next[0] is layer):
            return
        if self._next is not None:
            self._next[2].exception()  # one prefetch at a time: let the other one finish
        slots = tensor_slots(layer)
        sources = list({id(tensor): tensor.detach() for _, _, _, tensor in slots}.values())
        self._next = (layer, slots, self._workers["in"].submit(self._stage, sources), sources)
        self._uploaded = None

    def upload_prefetched(self) -> None:
        """Start copying the prefetched layer's staged tensors to the device (a no-op when none
        is prefetched or its upload has started); waits for the staging."""
        if self._next is None or self._uploaded is not None:
            return
        staged, sources = self._staged_on_every_rank(), self._next[3]
        if not self._streams:
            self._uploaded = ([self._gathered(t, s) for t, s in zip(staged, sources)], None)
            return
        stream = self._streams["in"]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            copies = [self._gathered(t.to(self.device, non_blocking=True), s) for t, s in zip(staged, sources)]
            self._uploaded = (copies, stream.record_event())

    def _staged_on_every_rank(self) -> list:
        """The prefetched layer's staged tensors. Data-parallel, a rank whose staging failed
        makes every rank raise, rather than leave the others waiting in the all-gathers."""
        future = self._next[2]
        if self._share is None:
            return future.result()
        error = future.exception()
        group = self._share[2]
        failed_ranks = ranks_that_failed(error is not None, group, self.device)
        if failed_ranks:
            raise RuntimeError(
                f"nvfp4_static: staging the next layer for the device failed on rank(s) "
                f"{failed_ranks}" + (f": {type(error).__name__}: {error}" if error else "")
            ) from error
        return future.result()

    def move_in(self, layer: torch.nn.Module) -> None:
        """Put ``layer`` on the device: its prefetched copies, else copied now."""
        if not self._overlaps(layer):
            layer.to(self.device)
            return
        self.prefetch(layer)
        self.upload_prefetched()
        (_, slots, _, sources), (copies, ready) = self._next, self._uploaded
        self._next = self._uploaded = None
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            for copy in copies:
                copy.record_stream(compute)  # allocated on the side stream, used on this one
        copy_of = dict(zip(list(dict.fromkeys(id(tensor) for _, _, _, tensor in slots)), copies))
        for slot in slots:
            put_tensor(slot, copy_of[id(slot[3])])
        # The layer's host tensors go with their last reference. Unmapping an 8B layer's 0.4 GiB
        # takes about 30 ms, which this thread would spend with the device idle: the staging
        # worker drops them instead.
        self._workers["in"].submit(sources.clear)

    def move_back(self, layer: torch.nn.Module, home: torch.device) -> None:
        """Move ``layer`` to ``home``: in the move-back worker with overlap, after the compute
        stream's work queued so far; the caller must not use ``layer`` until ``wait_moved_back``."""
        if not self.overlap:
            layer.to(home)
            return
        ready = torch.cuda.current_stream(self.device).record_event() if self._streams else None
        self._moving_back.append(self._workers["home"].submit(self._move_home, layer, home, ready))

    def wait_moved_back(self) -> None:
        """Wait until every layer given to ``move_back`` is home; raises the first failure."""
        moving, self._moving_back = self._moving_back, []
        for future in moving:
            future.result()

    def _overlaps(self, layer: torch.nn.Module) -> bool:
        devices = {t.device.type for t in [*layer.parameters(), *layer.buffers()]}
        return self.overlap and devices == {"cpu"}

    def _stage(self, sources: list) -> list:
        """Host copies of ``sources`` (data-parallel: of this rank's share of each one's bytes),
        pinned on CUDA; elsewhere the copies themselves (the same thread and bookkeeping, so
        that CPU tests run them)."""
        pinned = bool(self._streams)
        staged = []
        for source in sources:
            if self._shares(source):
                rank, world, _ = self._share
                data = source.contiguous().reshape(-1).view(torch.uint8)
                part = -(-data.numel() // world)
                mine = data[rank * part:(rank + 1) * part]
                staged.append(torch.empty(part, dtype=torch.uint8, pin_memory=pinned))
                staged[-1][:mine.numel()].copy_(mine)
            elif pinned:
                staged.append(source.pin_memory())
            else:
                staged.append(source.to(self.device, copy=True))
        return staged

    def _shares(self, source: torch.Tensor) -> bool:
        return self._share is not None and type(source) is torch.Tensor and source.numel() > 0

    def _gathered(self, uploaded: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``source`` on the device from ``uploaded``: the staged copy itself, or with a shared
        copy in, the ranks' shares all-gathered (in the calling thread, so that every rank
        issues its collectives in the same order)."""
        if not self._shares(source):
            return uploaded
        _, world, group = self._share
        gathered = torch.empty(uploaded.numel() * world, dtype=torch.uint8, device=self.device)
        all_gather_into(gathered, uploaded, group)
        nbytes = source.numel() * source.element_size()
        return gathered[:nbytes].view(source.dtype).view(source.shape)

    def _move_home(self, layer: torch.nn.Module, home: torch.device, ready) -> None:
        if ready is None or home.type != "cpu":
            layer.to(home)
            return
        stream = self._streams["home"]
        sources = []  # alive until copied: their blocks would otherwise be reused meanwhile

        def staged(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_cuda:
                return tensor
            sources.append(tensor)
            return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor, non_blocking=True)

        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            _map_layer_tensors(layer, staged)
            stream.synchronize()
        sources.clear()
        _map_layer_tensors(layer, lambda t: t.clone() if t.is_pinned() else t)


def _map_layer_tensors(layer: torch.nn.Module, fn) -> None:
    """Replace every tensor ``layer`` holds by ``fn`` of it, as ``module.to`` does (inside a
    tensor subclass, ``fn`` of each inner tensor); a tensor held in two places is mapped once,
    so ties survive."""
    mapped = {}  # id -> (the tensor, kept alive so that its id stays its own; fn of it)

    def apply(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in mapped:
            if is_traceable_wrapper_subclass(tensor):
                result = transform_subclass(tensor, lambda _, inner: apply(inner))
            else:
                result = fn(tensor.detach())
            mapped[id(tensor)] = (tensor, result)
        return mapped[id(tensor)][1]

    layer._apply(apply)


def tensor_slots(module: torch.nn.Module, recurse: bool = True) -> list[tuple]:
    """``(module, "parameter" | "buffer", name, tensor)`` for every tensor ``module`` holds
    (its submodules' too with ``recurse``): where ``put_tensor`` puts another tensor."""
    return [
        (owner, kind, name, tensor)
        for owner in (module.modules() if recurse else [module])
        for kind, tensors in (("parameter", owner._parameters), ("buffer", owner._buffers))
        for name, tensor in tensors.items()
        if tensor is not None
    ]


def put_tensor(slot: tuple, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the slot's tensor: a parameter keeps its ``Parameter`` object (as
    ``module.to`` does), a buffer is replaced."""
    owner, kind, name, held = slot
    if kind == "parameter":
        held.data = tensor
    else:
        owner._buffers[name] = tensor
