"""Loading a converted model's ``state_dict`` into a freshly built float model.

A converted layer saves its recipe as extra state (``NVFP4StaticLinear.get_extra_state``), so a
checkpoint says by itself which layers are converted and how: ``load_quantized`` reads that
instead of asking the user to repeat the ``filter_fn`` and the config they converted with.
"""

import os
import weakref
from collections.abc import Mapping
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from nvfp4_static.backends import check_runs_on, resolve_backend
from nvfp4_static.experts import NVFP4StaticExperts, NVFP4StaticObservedExperts, experts_layout
from nvfp4_static.linear import CHECKPOINT_FORMAT, NVFP4StaticLinear, saved_recipe
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["check_converted_layers_on_load", "later_names", "load_quantized", "replace_submodule"]

_EXTRA_STATE = "_extra_state"
_MODELS_CHECKED_ON_LOAD: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def load_quantized(
    model: torch.nn.Module,
    checkpoint: Union[dict, str, os.PathLike],
    *,
    backend: Optional[str] = None,
) -> torch.nn.Module:
    """Load ``checkpoint`` (a converted model's ``state_dict``, or a file ``torch.save`` wrote)
    into ``model``, built as the float model it was converted from.

    Each ``nn.Linear`` the checkpoint records as converted becomes an ``NVFP4StaticLinear`` with
    the recorded recipe (a registered experts module, ``NVFP4StaticExperts``), then the whole
    ``state_dict`` is loaded strictly. Everything is checked before anything is copied; if
    anything is refused (a missing layer, a shape mismatch, another recipe than a converted
    layer's, damaged scales), ``model`` is left as it was.

    Args:
        model: the float model (e.g. ``AutoModelForCausalLM.from_config(config)``).
        checkpoint: the state dict, or a path to load it from with ``weights_only=True`` onto
            the device of ``model``'s first parameter.
        backend: force the inference route of the loaded layers (see the config's ``backend``).

    Returns:
        ``model``, loaded in place.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = torch.load(checkpoint, weights_only=True, map_location=_device_of(model))
    if not isinstance(checkpoint, Mapping):
        raise TypeError(
            f"nvfp4_static: load_quantized takes a state dict or the path of a file holding one; "
            f"got a {type(checkpoint).__name__}"
        )
    check_load_target(model, "load_quantized")
    swapped = []
    made = {}  # by float module: one the model holds under several names gets one converted layer
    try:
        for name, recipe in _converted_layers(checkpoint).items():
            module = _submodule(model, name)
            if isinstance(module, (NVFP4StaticLinear, NVFP4StaticExperts)):
                continue
            if module in made:
                converted = made[module]
            elif experts_layout(module) is not None:
                converted = NVFP4StaticExperts.placeholder(module, experts_layout(module), recipe, name, backend)
            elif isinstance(module, torch.nn.Linear):
                converted = NVFP4StaticLinear.placeholder(module, recipe, name, backend)
            else:
                raise ValueError(
                    f"nvfp4_static: the checkpoint holds a converted linear '{name}', but the "
                    f"model has a {type(module).__name__} there"
                )
            made[module] = converted
            replace_submodule(model, name, converted)
            swapped.append((name, module))
        check_backend_runs_on_model(model, backend, "load_quantized")
        _check_loadable(model, checkpoint)
        check_converted_layers(model, checkpoint)
        model.load_state_dict(checkpoint)
    except BaseException:
        for name, original in reversed(swapped):
            replace_submodule(model, name, original)
        raise
    return model


def check_converted_layers(model: torch.nn.Module, state_dict: Mapping, prefix: str = "") -> None:
    """Each converted layer's checks of its entries in ``state_dict`` (``prefix`` + its name):
    the recipe it was made with, scales no convert writes."""
    for name, module in model.named_modules():
        if isinstance(module, (NVFP4StaticLinear, NVFP4StaticExperts)):
            module.check_loadable(state_dict, f"{prefix}{name}." if name else prefix)


def check_converted_layers_on_load(model: torch.nn.Module) -> None:
    """Make ``model.load_state_dict`` run every converted layer's checks before it copies
    anything. torch loads module by module, so a layer refusing its entries as its turn comes
    would leave the layers before it loaded; ``is_quantizable`` registers this on the model
    ``quantize_`` walks (once per model)."""
    if model not in _MODELS_CHECKED_ON_LOAD:
        model.register_load_state_dict_pre_hook(_check_converted_layers_hook)
        _MODELS_CHECKED_ON_LOAD.add(model)


def _check_converted_layers_hook(model, state_dict, prefix, *_) -> None:
    check_converted_layers(model, state_dict, prefix)


def check_load_target(model: torch.nn.Module, function: str) -> None:
    """Refuse, before anything changes, a model holding prepared layers (those the checkpoint
    leaves float would stay prepared), or tensors on the meta device (a copy into them does
    nothing, so the model would come back unloaded)."""
    on_meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"nvfp4_static: {function}: the model's tensors are on the meta device (first: '{on_meta}'), "
            f"where loading copies nothing; build the model on a device, or call "
            f"model.to_empty(device=...) first"
        )
    observed = (NVFP4StaticObservedLinear, NVFP4StaticObservedExperts)
    prepared = [name for name, module in model.named_modules() if isinstance(module, observed)]
    if prepared:
        raise ValueError(
            f"nvfp4_static: {function}: the model holds prepared layers (first: '{prepared[0]}'); load "
            f"into the float model the checkpoint was made from"
        )


def check_backend_runs_on_model(model: torch.nn.Module, backend: Optional[str], function: str) -> None:
    """Refuse a forced ``blackwell`` route for layers loaded on a device without FP4
    ``_scaled_mm`` (after the experts' own refusal of it, which says more)."""
    device = _device_of(model)
    check_runs_on(resolve_backend(device, backend), device, f"{function} into a model")


def _converted_layers(state_dict: Mapping) -> dict:
    """``{layer name: recipe}`` for every layer whose extra state says it is ours."""
    layers = {}
    for key, value in state_dict.items():
        if key.rpartition(".")[2] != _EXTRA_STATE:
            continue
        if isinstance(value, dict) and value.get("format") == CHECKPOINT_FORMAT:
            name = key[: -len(_EXTRA_STATE)].rstrip(".")
            layers[name] = saved_recipe(value, name)
    return layers


def _check_loadable(model: torch.nn.Module, checkpoint: dict) -> None:
    """Raise, before any tensor is copied, for what ``load_state_dict`` would refuse halfway:
    it copies every tensor it can before reporting the rest, which would leave the model
    partly loaded."""
    expected = model.state_dict()
    problems = [f"missing key {key!r}" for key in expected if key not in checkpoint]
    problems += [f"unexpected key {key!r}" for key in checkpoint if key not in expected]
    for key, value in checkpoint.items():
        ours = expected.get(key)
        if key in expected and torch.is_tensor(value) != torch.is_tensor(ours):
            problems.append(
                f"{key!r} is a {type(value).__name__} in the checkpoint and a {type(ours).__name__} in the model"
            )
        if not (torch.is_tensor(value) and torch.is_tensor(ours)):
            continue
        # Another library's quantized tensor (torchao's own) fails its copy_ after the entries
        # before it are copied.
        foreign = is_traceable_wrapper_subclass(value) and not isinstance(value, NVFP4StaticTensor)
        if foreign or isinstance(value, NVFP4StaticTensor) != isinstance(ours, NVFP4StaticTensor):
            problems.append(
                f"{key!r} is a {type(value).__name__} in the checkpoint and a "
                f"{type(ours).__name__} in the model"
            )
        elif value.is_meta:
            problems.append(f"{key!r} is on the meta device in the checkpoint: it holds no values")
        elif value.shape != ours.shape:
            problems.append(
                f"size mismatch for {key!r}: {tuple(value.shape)} in the checkpoint, "
                f"{tuple(ours.shape)} in the model"
            )
    if problems:
        raise RuntimeError(
            "nvfp4_static: the checkpoint does not fit the model (nothing was loaded): "
            + "; ".join(problems)
        )


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as error:
        raise ValueError(
            f"nvfp4_static: the checkpoint holds a converted linear '{name}', which the model "
            f"does not have; build the same architecture the checkpoint was saved from"
        ) from error


def replace_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` at ``name`` (a dotted path below ``model``, not the root itself)."""
    parent_name, _, child = name.rpartition(".")
    if not child:
        raise ValueError("nvfp4_static: cannot replace the root module itself")
    setattr(model.get_submodule(parent_name), child, module)


def later_names(model: torch.nn.Module) -> dict:
    """``{first name: [later names]}`` of each module ``model`` holds under several names (the
    first is the one ``named_modules`` gives, the only one ``quantize_`` visits in a parent)."""
    first, later = {}, {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in first:
            later.setdefault(first[id(module)], []).append(name)
        else:
            first[id(module)] = name
    return later


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device
