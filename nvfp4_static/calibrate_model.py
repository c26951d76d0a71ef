"""The default recipe in one call, for a model that fits on its device.

``quantize_`` with ``step="prepare"`` and ``"convert"`` works one module at a time and runs no
batches, so the recipe's first step, smoothing the norms' outputs from the first batch
(``smooth_norm_inputs``), is the caller's. ``calibrate_model`` does all of it: smooth, prepare,
run the batches, convert. ``calibrate_layer_by_layer`` gives the same scales, bit for bit, for
models that do not fit.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torchao.quantization import quantize_
from tqdm.auto import tqdm

from nvfp4_static.arguments import check_batches, check_flags
from nvfp4_static.config import NVFP4StaticActivationConfig, config_or_default
from nvfp4_static.eval_mode import in_eval_mode
from nvfp4_static.layerwise import _home_device, _map_tensors
from nvfp4_static.norm_smoothing import (
    DEFAULT_ALPHA,
    check_alpha,
    find_norm_groups,
    fold_smoothing_scales,
    smoothing_scales,
)
from nvfp4_static.workflow import converts_without_bar, is_quantizable, selects_a_layer

__all__ = ["calibrate_model"]


def _default_forward(model: torch.nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


@torch.no_grad()
def calibrate_model(
    model: torch.nn.Module,
    batches: Sequence[Any],
    config: Optional[NVFP4StaticActivationConfig] = None,
    *,
    forward: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] = is_quantizable,
    smooth_alpha: Optional[float] = DEFAULT_ALPHA,
    progress: bool = True,
) -> torch.nn.Module:
    """Smooth, prepare, calibrate on ``batches`` and convert ``model`` in place, on its device.
    The batches run with the model in eval mode (dropout off), its modes given back after.

    Args:
        model: the float model.
        batches: the calibration batches, each passed to ``forward`` (tensors, or dicts of
            them, are moved to the model's device).
        config: an ``NVFP4StaticActivationConfig`` (its ``step`` is ignored); default recipe.
        forward: ``forward(model, batch)``; default ``model(batch)`` (``model(**batch)`` for a
            dict).
        filter_fn: ``quantize_``'s filter (e.g. leave ``lm_head`` out).
        smooth_alpha: fold ``smooth_norm_inputs``'s scales with this alpha into the norms
            feeding q/k/v and gate/up, from the first batch, before prepare; a model without
            such norms is not smoothed. None: no smoothing.
        progress: show bars over the batches and, from 8 layers, over the converted layers.

    Returns:
        ``model``, its selected linears converted.

    Raises:
        TypeError: ``batches`` is not a sequence (a tensor, say), or ``config`` is not an
            ``NVFP4StaticActivationConfig``; the model is left as it was.
        ValueError: no batches, a ``filter_fn`` that selects no layer, ``smooth_alpha`` outside
            [0, 1], or smoothing refused (see ``smooth_norm_inputs``); in these cases the model
            is left as it was.
    """
    check_batches("calibrate_model", batches)
    if not batches:
        raise ValueError("nvfp4_static: calibrate_model needs at least one calibration batch")
    check_flags("calibrate_model", progress=progress)
    config = config_or_default("calibrate_model", config)
    if not selects_a_layer(model, filter_fn):
        raise ValueError(
            "nvfp4_static: calibrate_model: filter_fn selects no linear layer (or registered experts) of the "
            "model, so there is nothing to quantize; the model is left as it was"
        )
    if smooth_alpha is not None:
        check_alpha(smooth_alpha, "calibrate_model", "smooth_alpha")
    forward = forward or _default_forward
    device = _home_device(model)
    with in_eval_mode(model):
        if smooth_alpha is not None:
            groups = find_norm_groups(model)
            if groups:
                first = _map_tensors(batches[0], lambda t: t.to(device))
                scales = smoothing_scales(model, groups, lambda m: forward(m, first), smooth_alpha)
                fold_smoothing_scales(groups, scales)
        quantize_(model, dataclasses.replace(config, step="prepare"), filter_fn=filter_fn)
        for batch in tqdm(batches, desc="nvfp4_static calibrate", unit="batch", disable=not progress):
            forward(model, _map_tensors(batch, lambda t: t.to(device)))
    with contextlib.nullcontext() if progress else converts_without_bar():
        quantize_(model, dataclasses.replace(config, step="convert"), filter_fn=filter_fn)
    return model
