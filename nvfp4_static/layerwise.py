"""Layer-by-layer calibration, for decoder models that do not fit on the accelerator.

``calibrate_layer_by_layer(model, batches, config, device="cuda")`` keeps the model where it
is (e.g. on CPU) and holds one decoder layer at a time on ``device``:

1. the parts before the first decoder layer (embeddings, rotary embeddings) move to
   ``device``, and each batch runs through the model with every decoder layer's forward
   replaced by a stand-in that records its call's arguments (the first layer's hidden states,
   and everything the model passes each layer: position embeddings, its attention mask,
   positions...) and hands the hidden states on without computing; the last one stops the
   forward. Those parts move back;
2. for each decoder layer in turn: move it to ``device``, prepare its linears, run every
   cached batch through it (calibrating them), convert it, keep its outputs as the next
   layer's inputs, move it back. On CUDA the next layer is staged in pinned host memory while
   this one calibrates and copied to ``device`` while it converts, and finished layers move
   back in the background (``nvfp4_static.layer_mover``); a layer whose calibration fails moves
   back too.

The next layer sees the float layer's outputs, exactly as in a whole-model calibration, so
the scales are the same bit for bit; ``propagate_quantized=True`` feeds it the converted
layer's outputs instead (llm-compressor's error propagation), which runs every batch through
each layer twice.

With ``group`` (a ``torch.distributed`` group; every rank calls it with its own batches) each
layer's statistics are synchronised across ranks before it is converted, and its weight sweeps
are split across the ranks (``nvfp4_static.distributed``); the scales are those
``calibrate_in_shards`` gives on the whole model. With smoothing, the rank holding the first
batch smooths each next layer while this one converts, in place of part of its share of the
convert, so that the other ranks do not wait for it at the start of every layer.

With ``resume_dir`` each converted layer is saved as it finishes, and a rerun after a crash
loads the finished layers instead of calibrating them (``nvfp4_static.layerwise_resume``).
"""

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torchao.quantization import quantize_
from tqdm.auto import tqdm

from nvfp4_static.arguments import check_batches, check_flags
from nvfp4_static.config import NVFP4StaticActivationConfig, config_or_default
from nvfp4_static.data_parallel_convert import SideTask, convert_data_parallel
from nvfp4_static.distributed import (
    _error_text,
    _gather,
    _raise_any_rank_error,
    sync_calibration,
    sync_mse_anchors,
)
from nvfp4_static.eval_mode import in_eval_mode
from nvfp4_static.fingerprints import first_difference
from nvfp4_static.layer_mover import LayerMover, put_tensor, tensor_slots
from nvfp4_static.layerwise_resume import FinishedLayers, layer_fingerprint, run_fingerprint
from nvfp4_static.layerwise_smoothing import LayerSmoothing
from nvfp4_static.norm_smoothing import DEFAULT_ALPHA, check_alpha, find_norm_groups
from nvfp4_static.workflow import is_quantizable, record_weights_held_elsewhere, selects_a_layer

__all__ = ["calibrate_layer_by_layer", "find_decoder_layers"]


class _LayersReached(Exception):
    """Raised by the last decoder layer's stand-in to stop the forward once every layer's
    arguments are recorded (what follows the layers, such as ``lm_head``, never runs)."""


def find_decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The qualified name and the ``ModuleList`` of a decoder model's layers: ``model.layers``
    (Hugging Face decoder models: Llama, Mistral, Qwen, ...), else the one ``ModuleList``
    named ``layers`` anywhere in the model."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return "model.layers", inner.layers
    found = [(name, m) for name, m in model.named_modules()
             if name.rpartition(".")[2] == "layers" and isinstance(m, torch.nn.ModuleList)]
    if len(found) == 1:
        return found[0]
    where = f" (found {[name for name, _ in found]})" if found else ""
    raise ValueError(
        f"nvfp4_static: layer-by-layer calibration needs a decoder model whose layers are one "
        f"torch.nn.ModuleList named 'layers' (as Hugging Face decoder models have: "
        f"model.model.layers){where}; {type(model).__name__} has none. Calibrate the whole model "
        f"instead (quantize_ prepare, batches, convert)"
    )


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _is_cache(value) -> bool:
    return any(cls.__name__.endswith("Cache") for cls in type(value).__mro__)


def _without_cache(kwargs: dict) -> dict:
    """A KV cache would carry state from layer to layer and batch to batch: the replay runs
    every layer without one, as a no-cache forward does."""
    kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _default_forward(model, batch):
    if isinstance(batch, dict):
        return model(**batch, use_cache=False)
    return model(batch, use_cache=False)


def _hidden_states(output):
    """A decoder layer returns its hidden states, or a tuple that starts with them."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _outside(model: torch.nn.Module, layers: torch.nn.ModuleList):
    """The modules and direct tensors of ``model`` that do not hold ``layers``: what runs
    before (and after) the decoder layers. Returns the modules to move whole, and the modules on
    the path to ``layers`` whose own parameters and buffers must move."""
    whole, path = [], []

    def walk(module):
        if module is layers:
            return True
        holds = False
        for child in module.children():
            if walk(child):
                holds = True
        if holds:
            path.append(module)
            whole.extend(c for c in module.children() if not _holds(c, layers))
        return holds

    walk(model)
    return whole, path


def _holds(module, target) -> bool:
    return any(m is target for m in module.modules())


def _move_outside(model, layers, device) -> tuple[list, list]:
    """Move what lies outside ``layers`` to ``device`` for the recording of the first layer's
    inputs: the own tensors of the modules on the path to them at once, each other module when
    the forward first calls it (the returned hooks do it; remove them after), so that what runs
    after the layers (``lm_head``: a GiB or more at a 128k vocabulary) never reaches the device.

    Returns the hooks and the moves made, ``(slot, original tensor, copy)``, for ``_put_back``.
    """
    whole, path = _outside(model, layers)
    moves = []

    def move(slots) -> None:
        for slot in slots:
            original = slot[3].data if slot[1] == "parameter" else slot[3]
            copy = original.to(device)
            put_tensor(slot, copy)
            moves.append((slot, original, copy))

    def move_on_call(module, args) -> None:  # a pre-hook's return value would replace the arguments
        move(tensor_slots(module))

    hooks = [module.register_forward_pre_hook(move_on_call) for module in whole]
    for module in path:
        move(tensor_slots(module, recurse=False))
    return hooks, moves


def _put_back(moves: list, home: torch.device) -> None:
    """Undo ``_move_outside``: each moved tensor's original goes back (the recording reads
    those modules, it never writes them), so nothing is copied back; a buffer the forward
    replaced is moved ``home``. Empties ``moves``, so that the device copies are freed."""
    for slot, original, copy in reversed(moves):
        module, kind, name, _ = slot
        current = module._buffers[name] if kind == "buffer" else None
        if kind == "buffer" and current is not copy:
            put_tensor(slot, current.to(home))
        else:
            put_tensor(slot, original)
    moves.clear()


def _capture_layer_inputs(model, layers, batches, forward, device, cache_device) -> tuple[list, list]:
    """``(hidden, calls)``: for every batch ``b``, the first decoder layer's hidden states
    ``hidden[b]`` and each layer's call ``calls[b][i]`` (``(args, kwargs)``, its hidden states
    None), on ``cache_device``. The layers do not run: while the forward runs, each layer's
    forward is a stand-in that records its arguments and hands the hidden states on, so that a
    model giving its layers different arguments (sliding-window and full-attention masks) has
    each layer replayed with its own. Layers given the same objects share one record."""
    hidden, calls = [], []
    distinct: list = []  # this batch's calls: (as given, as recorded)

    def stand_in(index):
        def record(*args, **kwargs):
            if len(calls[-1]) != index:
                raise RuntimeError(
                    f"nvfp4_static: the model's forward called decoder layer {index} after "
                    f"{len(calls[-1])} of its layers: layer-by-layer calibration needs each layer "
                    f"called once per forward, in order"
                )
            given = _hidden_states_of_call(args, kwargs)
            call = _with_hidden_states(args, _without_cache(kwargs), None)
            recorded = next((kept for seen, kept in distinct if _same_objects(seen, call)), None)
            if recorded is None:
                recorded = _map_tensors(call, lambda t: t.detach().to(cache_device))
                distinct.append((call, recorded))
            if index == 0:
                hidden.append(given.detach().to(cache_device))
            calls[-1].append(recorded)
            if index == len(layers) - 1:
                raise _LayersReached
            return given

        return record

    own_forwards = [layer.__dict__.get("forward") for layer in layers]  # e.g. accelerate's
    for index, layer in enumerate(layers):
        layer.forward = stand_in(index)
    try:
        with torch.no_grad():
            for batch in batches:
                calls.append([])
                distinct.clear()
                try:
                    forward(model, _map_tensors(batch, lambda t: t.to(device)))
                except _LayersReached:
                    pass
                if len(calls[-1]) != len(layers):
                    raise RuntimeError(
                        f"nvfp4_static: the model's forward called {len(calls[-1])} of its "
                        f"{len(layers)} decoder layers (or called them outside forward): cannot "
                        f"record the layers' inputs"
                    )
    finally:
        for layer, own in zip(layers, own_forwards):
            if own is None:
                del layer.forward
            else:
                layer.forward = own
    return hidden, calls


def _same_objects(first, second) -> bool:
    """Whether two calls' arguments are the same tensors (the same objects, not equal values)
    and equal numbers, strings and flags, in the same structure."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return first is second
    if isinstance(first, (tuple, list)) and type(first) is type(second):
        return len(first) == len(second) and all(map(_same_objects, first, second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same_objects(first[k], second[k]) for k in first)
    if isinstance(first, (bool, int, float, str)) and type(first) is type(second):
        return first == second
    return first is second


def _layer_output(layer, call, hidden, device, cache_device):
    """``hidden`` through ``layer``, with the other arguments of a recorded call ``(args,
    kwargs)``, on ``device``; the output hidden states on ``cache_device``."""
    args, kwargs = _map_tensors(_with_hidden_states(*call, hidden), lambda t: t.to(device))
    return _hidden_states(layer(*args, **kwargs)).detach().to(cache_device)


def _with_hidden_states(args, kwargs, hidden):
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def calibrate_layer_by_layer(
    model: torch.nn.Module,
    batches: Sequence[Any],
    config: Optional[NVFP4StaticActivationConfig] = None,
    *,
    device: Union[str, torch.device, None] = None,
    cache_device: Union[str, torch.device, None] = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] = is_quantizable,
    forward: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
    propagate_quantized: bool = False,
    smooth_alpha: Optional[float] = DEFAULT_ALPHA,
    offload: bool = True,
    group=None,
    progress: bool = True,
    resume_dir: Union[str, os.PathLike, None] = None,
    prefetch: Optional[bool] = None,
    timings: Optional[dict] = None,
) -> torch.nn.Module:
    """Prepare, calibrate and convert ``model``'s decoder layers one at a time on ``device``.

    Args:
        model: a decoder model with a ``layers`` ``ModuleList`` (see ``find_decoder_layers``);
            its weights stay where they are (CPU) except the layer being calibrated.
        batches: the calibration batches (this rank's, with ``group``), each passed to
            ``forward``; kept only until the layers' inputs are recorded.
        config: an ``NVFP4StaticActivationConfig`` (its ``step`` is ignored); default recipe.
        device: where each layer is calibrated; default CUDA when available, else CPU.
        cache_device: where the layers' inputs are kept between layers (``"cpu"`` to save
            accelerator memory); default ``device``.
        filter_fn: ``quantize_``'s filter, called with the full names (``model.layers.3...``).
            Linears outside the decoder layers (``lm_head``) are left as they are.
        forward: ``forward(model, batch)``; default ``model(batch, use_cache=False)``
            (``model(**batch, use_cache=False)`` for a dict).
        propagate_quantized: feed each layer the converted previous layer's outputs.
        smooth_alpha: before each layer is prepared, fold ``smooth_norm_inputs``'s scales with
            this alpha into the norms feeding its q/k/v and gate/up, from the first batch
            (``nvfp4_static.layerwise_smoothing``: the scales that ``smooth_norm_inputs`` on
            the whole model over the first batch gives); a layer without such norms is left as
            it is, with a warning. None: no smoothing.
        offload: move each converted layer back where it was (default); False leaves the
            converted layers on ``device``.
        group: a ``torch.distributed`` process group (or ``True`` for the default group):
            data-parallel calibration, each rank passing its own batches.
        progress: show a bar over the layers (on rank 0 only, with a group).
        resume_dir: a folder where each layer is saved once converted; a rerun with the same
            folder checks that it holds layers of the same model, data and config (else
            raises, changing nothing) and loads them instead of calibrating them again
            (``nvfp4_static.layerwise_resume``). With ``group``, rank 0 writes it and every
            rank reads it: a folder all ranks share.
        prefetch: stage the next layer while this one calibrates, copy it to ``device`` while
            this one converts, and move finished layers home in the background
            (``nvfp4_static.layer_mover``); one more layer of device memory while converting.
            Default: on CUDA.
        timings: a dict to which the seconds of each phase are added ("record inputs", "move
            in", "prepare", "calibrate", "sync statistics", "convert", "propagate", "move
            back", ...). On CUDA each phase then waits for the device at its end. Each phase
            is also a range "nvfp4_static <phase>" in a torch.profiler trace
            (``examples/benchmarks/profile_layer_by_layer.py``).

    Returns:
        ``model``, its decoder layers' selected linears converted.
    """
    check_batches("calibrate_layer_by_layer", batches)
    flags = dict(propagate_quantized=propagate_quantized, offload=offload, progress=progress)
    check_flags("calibrate_layer_by_layer", **flags, **({} if prefetch is None else {"prefetch": prefetch}))
    config = config_or_default("calibrate_layer_by_layer", config)
    prepare = dataclasses.replace(config, step="prepare")
    convert = dataclasses.replace(config, step="convert")
    forward = forward or _default_forward
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cache_device = torch.device(cache_device or device)
    prefix, layers = find_decoder_layers(model)
    home = _home_device(model)
    data_parallel = group is not None
    group = None if group is True else group
    rank = anchor_source = 0
    counts = [len(batches)]
    if data_parallel:
        import torch.distributed as dist

        rank = dist.get_rank(group)
        settings = {"decoder layers": len(layers), "config": dataclasses.asdict(prepare),
                    "smooth_alpha": smooth_alpha, "propagate_quantized": propagate_quantized}
        gathered = _gather({"batches": len(batches), "settings": settings}, group)
        _check_same_settings([item["settings"] for item in gathered])
        counts = [item["batches"] for item in gathered]
        anchor_source = next((r for r, n in enumerate(counts) if n), 0)
    if smooth_alpha is not None:
        check_alpha(smooth_alpha, "calibrate_layer_by_layer", "smooth_alpha")
        find_norm_groups(model)  # refuses, before any layer changes, a norm or weight two layers share
    if not sum(counts):
        raise ValueError(
            f"nvfp4_static: calibrate_layer_by_layer needs at least one calibration batch"
            f"{' on some rank' if data_parallel else ''}"
        )

    def layer_filter_of(name):
        return lambda module, fqn: filter_fn(module, f"{name}.{fqn}" if fqn else name)

    if not any(selects_a_layer(layer, layer_filter_of(f"{prefix}.{index}")) for index, layer in enumerate(layers)):
        raise ValueError(
            f"nvfp4_static: calibrate_layer_by_layer: filter_fn selects no linear layer (or registered experts) "
            f"in {prefix}, so there is nothing to quantize; the model is left as it was"
        )

    _refuse_linears_two_layers_hold(prefix, layers, layer_filter_of)
    # As prepare on the whole model would: a linear whose weight another module holds (a tied
    # lm_head, a weight two layers share) is left float rather than untied.
    record_weights_held_elsewhere(model)

    finished = None
    if resume_dir is not None:
        finished = _finished_layers(resume_dir, model, prefix, layers, layer_filter_of, config,
                                    propagate_quantized, smooth_alpha, batches, forward,
                                    data_parallel, group, rank)

    clock = _PhaseClock(timings, device)
    # The model runs as the converted model will (dropout off), each module's mode given back after.
    with clock.phase("record inputs"), in_eval_mode(model):
        hooks, moves = _move_outside(model, layers, device)
        try:
            hidden, calls = _capture_layer_inputs(model, layers, batches, forward, device, cache_device)
        finally:
            for hook in hooks:
                hook.remove()
            _put_back(moves, home)
    smoothing, first_tokens = None, 0
    if smooth_alpha is not None and any(counts):
        def first_batch_through(layer, hidden):
            index = next(i for i, candidate in enumerate(layers) if candidate is layer)
            return _layer_output(layer, calls[0][index], hidden, device, cache_device)

        first = hidden[0] if hidden and rank == anchor_source else None
        smoothing = LayerSmoothing(smooth_alpha, first, first_batch_through, group, anchor_source,
                                   device, data_parallel)
        if data_parallel:  # what the smoothing of a layer costs scales with the first batch
            first_tokens = _gather(0 if first is None else first.shape[:-1].numel(), group)[anchor_source]

    bar = tqdm(total=len(layers), desc="nvfp4_static layer by layer", unit="layer",
               disable=not progress or rank != 0)
    overlap = device.type == "cuda" if prefetch is None else prefetch
    fingerprints = {}  # by layer index, of the float layers the resume folder will save
    smoothed_early = set()  # indices of layers smoothed while the one before them converted
    homes = [_home_device(layer) for layer in layers]  # taken now: a layer may move in early
    with bar, LayerMover(device, overlap, data_parallel, group) as mover, in_eval_mode(model):
        for index, layer in enumerate(layers):
            name = f"{prefix}.{index}"
            bar.set_postfix_str(name)
            layer_filter = layer_filter_of(name)
            following = layers[index + 1] if index + 1 < len(layers) else None

            def run(b, last_use, layer=layer, index=index):
                """Batch ``b`` through the layer; its input is dropped after its last use, so
                that the cache holds about one copy of the activations, not two."""
                given = hidden[b]
                if last_use:
                    hidden[b] = None
                return _layer_output(layer, calls[b][index], given, device, cache_device)

            def calibration_run(b):
                return run(b, last_use=not propagate_quantized)

            outputs = [None] * len(hidden)
            resumed = finished is not None and index < finished.done
            try:
                if index not in smoothed_early:  # else moved in for its smoothing
                    with clock.phase("move in"):
                        mover.move_in(layer)
                if following is not None:
                    mover.prefetch(following)
                with torch.no_grad():
                    if finished is not None and not resumed and index not in fingerprints:
                        fingerprints[index] = layer_fingerprint(layer, name, layer_filter)
                    if smoothing is not None and index not in smoothed_early:
                        with clock.phase("smooth"):
                            smoothing.smooth(layer, name)
                    if resumed:  # the outputs the interrupted run computed, from the same layer
                        if not propagate_quantized:
                            with clock.phase("calibrate"):
                                outputs = [calibration_run(b) for b in range(len(hidden))]
                        with clock.phase("load finished layer"):
                            finished.load(index, layer, name, config.backend)
                    else:
                        with clock.phase("prepare"):
                            quantize_(layer, prepare, filter_fn=layer_filter)
                        if data_parallel:
                            _calibrate_data_parallel(layer, calibration_run, outputs, group,
                                                     rank == anchor_source,
                                                     config.act_calibration == "mse", clock)
                            mover.upload_prefetched()
                            if smoothing is not None and following is not None:
                                following_name = f"{prefix}.{index + 1}"
                                _convert_and_smooth_following(
                                    layer, convert, layer_filter, group, smoothing, following,
                                    following_name, first_tokens, mover, anchor_source, clock,
                                )
                                if finished is not None:  # of the float layer, before the fold
                                    fingerprints[index + 1] = layer_fingerprint(
                                        following, following_name, layer_filter_of(following_name))
                                with clock.phase("smooth"):
                                    smoothing.settle()
                                smoothed_early.add(index + 1)
                            else:
                                with clock.phase("convert"):
                                    convert_data_parallel(layer, convert, layer_filter, group)
                        else:
                            with clock.phase("calibrate"):
                                for b in range(len(hidden)):
                                    outputs[b] = calibration_run(b)
                            mover.upload_prefetched()  # past this layer's activation peak
                            with clock.phase("convert"):
                                quantize_(layer, convert, filter_fn=layer_filter)
                    if propagate_quantized:
                        with clock.phase("propagate"):
                            outputs = [run(b, last_use=True) for b in range(len(hidden))]
            except BaseException:
                layer.to(homes[index])  # a failed layer goes home too, and the next one if moved in
                if following is not None:
                    following.to(homes[index + 1])
                raise
            hidden = outputs
            if offload:
                with clock.phase("move back"):
                    mover.move_back(layer, homes[index])
            if finished is not None and not resumed:
                with clock.phase("save finished layer"):
                    mover.wait_moved_back()
                    finished.save(index, layer, fingerprints.pop(index))
            bar.update()
        with clock.phase("move back"):
            mover.wait_moved_back()
    if smoothing is not None:
        smoothing.warn_about_unsmoothed()
    return model


class _PhaseClock:
    """Adds the seconds of each phase of the run to ``timings[phase]``, and marks the phase in
    a torch.profiler trace as a range "nvfp4_static <phase>"; does nothing when ``timings`` is
    None. On CUDA a phase ends when the compute stream has done the work it queued, so the
    GPU's time lands in its phase (at the cost of those waits)."""

    def __init__(self, timings: Optional[dict], device: torch.device):
        self.timings, self.device = timings, device

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.timings is None:
            yield
            return
        start = time.perf_counter()
        with torch.profiler.record_function(f"nvfp4_static {name}"):
            yield
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


def _refuse_linears_two_layers_hold(prefix: str, layers, layer_filter_of) -> None:
    """Refuse a selected linear two decoder layers hold: calibrated with the first layer's
    inputs alone, it would serve both (the whole model's calibration sees both layers' inputs)."""
    first_place = {}
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            place = f"{prefix}.{index}" + (f".{name}" if name else "")
            holder = first_place.setdefault(id(module), (index, place))
            if (holder[0] != index and isinstance(module, torch.nn.Linear)
                    and layer_filter_of(f"{prefix}.{index}")(module, name)):
                raise ValueError(
                    f"nvfp4_static: calibrate_layer_by_layer: '{place}' is the module "
                    f"'{holder[1]}' of another decoder layer; calibrated one layer at a time it "
                    f"would take the first layer's inputs alone. Use calibrate_model, or leave it "
                    f"out with filter_fn (nothing was changed)"
                )


def _check_same_settings(per_rank: list) -> None:
    """Refuse, on every rank alike, ranks whose models have other numbers of decoder layers or
    that were given other settings: they would wait on each other at another layer, or mix."""
    for rank, settings in enumerate(per_rank[1:], start=1):
        if settings != per_rank[0]:
            key, ours, theirs = first_difference(per_rank[0], settings)
            raise ValueError(
                f"nvfp4_static: calibrate_layer_by_layer: rank {rank} has {key} {theirs!r}, "
                f"rank 0 {ours!r}; every rank must calibrate the same model with the same settings"
            )


def _finished_layers(folder, model, prefix, layers, layer_filter_of, config, propagate_quantized,
                     smooth_alpha, batches, forward, data_parallel, group, rank) -> FinishedLayers:
    """The resume folder's finished layers, checked against this run; data-parallel, checked
    on every rank, and every rank raises if any rank's check failed or found another count."""
    def gather(digest):
        return _gather(digest, group) if data_parallel else [digest]

    run = run_fingerprint(model, len(layers), config, propagate_quantized, smooth_alpha, batches,
                          forward, gather)

    def fingerprint(index):
        name = f"{prefix}.{index}"
        return layer_fingerprint(layers[index], name, layer_filter_of(name))

    if not data_parallel:
        return FinishedLayers(folder, run, fingerprint)
    local = {"error": None, "done": None}
    try:
        finished = FinishedLayers(folder, run, fingerprint, writes=rank == 0)
        local["done"] = finished.done
    except Exception as caught:
        local["error"] = _error_text(caught)
    gathered = _gather(local, group)
    _raise_any_rank_error(gathered, "resume")
    counts = [item["done"] for item in gathered]
    if len(set(counts)) > 1:
        raise ValueError(
            f"nvfp4_static: the ranks find different numbers of finished layers in the resume "
            f"folder '{folder}' ({counts}, by rank): every rank must see the same folder"
        )
    return finished


def _calibrate_data_parallel(layer, run, outputs, group, runs_first_batch: bool, mse: bool,
                             clock: "_PhaseClock") -> None:
    """This rank's batches through ``layer``, its statistics synchronised with the other ranks'
    (for the MSE recipe, the anchoring first batch first); errors reach every rank."""
    order = list(range(len(outputs)))
    if mse:
        error = None
        if runs_first_batch and order:
            with clock.phase("calibrate"):
                try:
                    outputs[0] = run(0)
                except Exception as caught:
                    error = caught
            order = order[1:]
        with clock.phase("sync statistics"):
            sync_mse_anchors(layer, group, error=error)
    error = None
    with clock.phase("calibrate"):
        try:
            for b in order:
                outputs[b] = run(b)
        except Exception as caught:
            error = caught
    with clock.phase("sync statistics"):
        sync_calibration(layer, group, error=error)


# Smoothing an 8B-shaped decoder layer (a first batch of 8192 tokens through it, its scales
# computed) takes about what converting half its linears' weights takes (H100 and H200, NCCL);
# the forward's work grows with the first batch's tokens. In the convert shares' unit (weight
# elements), per weight element and first-batch token:
_SMOOTHING_COST = 0.5 / 8192


def _convert_and_smooth_following(layer, convert, layer_filter, group, smoothing, following,
                                  name, first_tokens, mover, anchor_source, clock) -> None:
    """Data-parallel: convert ``layer`` while the rank holding the first batch computes the
    smoothing of ``following`` in place of part of its share, so that no rank waits for the
    smoothing at the start of the next layer; every rank ends with ``following`` on the device
    and its smoothing computed, for ``smoothing.settle()``.

    The following layer's upload is under way (``upload_prefetched``): the smoothing rank moves
    it in after its share, so its convert kernels are queued ahead of the wait for the upload."""

    def smooth_following():
        mover.move_in(following)
        smoothing.compute(following, name)

    weights = sum(m.weight.numel() for m in following.modules() if isinstance(m, torch.nn.Linear))
    side_task = SideTask(anchor_source, int(weights * first_tokens * _SMOOTHING_COST), smooth_following)
    with clock.phase("convert"):
        convert_data_parallel(layer, convert, layer_filter, group, side_task=side_task)
    if not smoothing.computes_scales:  # the side task's rank moved it in; the others do now
        with clock.phase("move in"):
            mover.move_in(following)
        smoothing.compute(following, name)


def _hidden_states_of_call(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _home_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")
