"""A second calibration pass that gathers each layer's input Hessian under quantized activations.

``weight_scale="hessian_mse"`` (and ``"gptq"``) weight a weight's rounding error by the Hessian
of the layer's inputs, ``sum x x^T``. The calibration pass gathers it from float activations:
every layer sees what the float model computes. At inference each layer's input also carries the
quantization of every activation upstream of it. ModelOpt's local-Hessian recipe
(``local_hessian_calibrate``) therefore gathers its Hessians in a second forward with activation
quantization on and weights float.

``calibrate_hessians_under_quantized_activations(model, forward_loop)`` is that second pass with
this package's static scales. Once calibration has fixed every layer's activation global amax,
it runs ``forward_loop(model)`` with each observed linear computing
``F.linear(fake_quantize(x), weight, bias)``: its input NVFP4-fake-quantized under the layer's
own static scale, exactly as convert will fix it, its weight float. Each layer then gets a new
Hessian of what it saw there: its input before its own quantization (``own_input_quantized=
False``, ModelOpt's choice) or after it (``True``, the operand its weight multiplies at
inference). Activation statistics are left as they were, so convert reads the same amaxes.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvfp4_static.arguments import check_flags
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers import BlockHessianAccumulator
from nvfp4_static.observers.mse import nvfp4_fake_quantize_with_amax
from nvfp4_static.workflow import layer_activation_global_amax

__all__ = ["calibrate_hessians_under_quantized_activations"]


class _QuantizedInputLinear(torch.nn.Module):
    """What an observed linear computes during the pass: a float linear of its fake-quantized
    input, feeding a fresh Hessian accumulator."""

    def __init__(self, observed: NVFP4StaticObservedLinear, act_global_amax: torch.Tensor,
                 own_input_quantized: bool):
        super().__init__()
        self.observed = observed
        self.act_global_amax = act_global_amax.to(observed.weight.device)
        self.own_input_quantized = own_input_quantized
        previous = observed.hessian_accumulator
        kind = BlockHessianAccumulator if previous is None else type(previous)
        self.hessian = kind(observed.in_features, name=observed.layer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = nvfp4_fake_quantize_with_amax(x, self.act_global_amax)
        if x.numel():
            self.hessian.collect(quantized if self.own_input_quantized else x)
        return F.linear(quantized, self.observed.weight, self.observed.bias)


@torch.no_grad()
def calibrate_hessians_under_quantized_activations(
    model: torch.nn.Module,
    forward_loop: Callable[[torch.nn.Module], None],
    *,
    own_input_quantized: bool = False,
) -> None:
    """Replace every observed linear's input Hessian by one gathered under quantized activations.

    Call it after calibration (which fixes the activation global amaxes; ``tie_fused_layers``
    may come before or after) and before ``step="convert"`` with ``weight_scale="hessian_mse"``.
    A layer prepared with another weight recipe gets a per-block Hessian, so a model prepared
    with ``weight_scale="mse"`` (which gathers none in the first pass) converts with
    ``"hessian_mse"`` afterwards; a layer that holds a Hessian gets a new one of the same kind.

    Args:
        model: a prepared and calibrated model.
        forward_loop: runs the calibration batches through the model it is given, e.g.
            ``lambda m: [m(batch) for batch in batches]``; every observed linear must see input.
        own_input_quantized: gather each Hessian from the layer's input after its own
            quantization instead of before it.

    Raises:
        ValueError: no observed linear in ``model``; a layer saw no input, or non-finite input,
            during the pass.
        RuntimeError: a layer has no calibrated activation amax.
        Whatever ``forward_loop`` raises. In every case the model is left as it was.

    Experts of mixture-of-experts layers run float during the pass and keep their Hessians.
    """
    check_flags("calibrate_hessians_under_quantized_activations", own_input_quantized=own_input_quantized)
    paths: dict[NVFP4StaticObservedLinear, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, NVFP4StaticObservedLinear):
            paths.setdefault(module, []).append(name)
    if not paths:
        raise ValueError(
            "nvfp4_static: calibrate_hessians_under_quantized_activations found no observed "
            "linear; run quantize_(model, NVFP4StaticActivationConfig(step='prepare')) and "
            "calibration first"
        )
    stand_ins = {
        layer: _QuantizedInputLinear(layer, _calibrated_amax(layer), own_input_quantized)
        for layer in paths
    }
    try:
        for layer, names in paths.items():
            for name in names:
                model.set_submodule(name, stand_ins[layer])
        forward_loop(model)
    finally:
        for layer, names in paths.items():
            for name in names:
                model.set_submodule(name, layer)
    unseen = [layer.layer_name for layer, s in stand_ins.items() if not _saw_input(s.hessian)]
    if unseen:
        raise ValueError(
            f"nvfp4_static: layers {', '.join(unseen)} saw no input during the quantized-"
            f"activation Hessian pass; forward_loop must run the calibration batches through "
            f"the model it is given. The Hessians were left as they were"
        )
    for layer, stand_in in stand_ins.items():
        layer.hessian_accumulator = stand_in.hessian


def _calibrated_amax(layer: NVFP4StaticObservedLinear) -> torch.Tensor:
    """The layer's activation global amax as convert will fix it (refused as convert refuses it)."""
    try:
        return layer_activation_global_amax(layer)
    except (RuntimeError, ValueError) as error:
        raise type(error)(
            f"nvfp4_static: the quantized-activation Hessian pass quantizes each layer's input "
            f"under its calibrated static scale, and one is missing or unusable: {error}"
        ) from error


def _saw_input(hessian: BlockHessianAccumulator) -> bool:
    """Whether ``hessian`` collected a batch; raises for a non-finite batch whose check was
    still on the GPU (``MergeableObserver.settle``)."""
    try:
        return hessian.num_tokens > 0
    except RuntimeError:  # never collected
        return False
