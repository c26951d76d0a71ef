"""The observed linear that ``step="prepare"`` puts in place of each eligible ``nn.Linear``."""

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["NVFP4StaticObservedLinear"]


class NVFP4StaticObservedLinear(torch.nn.Linear):
    """An ``nn.Linear`` that feeds its inputs to calibrators, then computes the float linear.

    It shares the original module's parameters (no copy), so calibration memory is only the
    calibrators' bounded state. Statistics are gathered under ``no_grad`` and never change the
    output.

    Attributes:
        layer_name: fully qualified name of the module, used in every error and warning.
        act_calibrator: collects the activation global amax (``collect`` / ``compute_amax``).
        hessian_accumulator: optional input Hessian: per input block for
            ``weight_scale="hessian_mse"``, the whole ``K x K`` one for ``"gptq"``.
        activation_recipe: the config's ``activation_recipe()`` the calibrator was built from
            (None when built by hand), which convert checks its own config against.
        tied_weight_global_amax: the fusion group's weight global amax that
            ``tie_fused_layers`` set (None: convert uses the weight's own ``max |w|``).
        swept_block_scales: the weight's FP8 block scales as another rank swept them, set by
            ``convert_data_parallel`` for its convert (None: convert runs the sweep).
        gptq_codes: for ``weight_scale="gptq"``, the packed E2M1 codes and FP8 block scales
            GPTQ gave the weight on the rank that ran it, set by ``convert_data_parallel``
            (None: convert runs GPTQ).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        act_calibrator,
        hessian_accumulator=None,
        layer_name: str = "",
        device=None,
        dtype=None,
        activation_recipe: Optional[dict] = None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.act_calibrator = act_calibrator
        self.hessian_accumulator = hessian_accumulator
        self.layer_name = layer_name
        self.activation_recipe = activation_recipe
        self.tied_weight_global_amax: Optional[torch.Tensor] = None
        self.swept_block_scales: Optional[torch.Tensor] = None
        self.gptq_codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def from_float(
        cls,
        linear: torch.nn.Linear,
        act_calibrator,
        hessian_accumulator=None,
        layer_name: str = "",
        activation_recipe: Optional[dict] = None,
    ) -> "NVFP4StaticObservedLinear":
        with torch.device("meta"):
            observed = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                act_calibrator,
                hessian_accumulator,
                layer_name,
                activation_recipe=activation_recipe,
            )
        observed.weight = linear.weight
        observed.bias = linear.bias
        return observed

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass it by keyword
        x = input
        self.check_input(x)
        if x.numel() == 0:  # no tokens: nothing to observe
            return F.linear(x, self.weight, self.bias)
        with torch.no_grad():
            observed = x.detach()
            self._settle_observers()
            # The Hessian first: it refuses everything the activation calibrator refuses (NaN,
            # Inf) and more (finite values whose squares overflow), so a refused batch reaches
            # neither and the two stay consistent. Their errors name the layer already.
            if self.hessian_accumulator is not None:
                self.hessian_accumulator.collect(observed)
            self.act_calibrator.collect(observed)
        return F.linear(x, self.weight, self.bias)

    def check_input(self, x: torch.Tensor) -> None:
        """Refuse, before the observers see it, a batch the float linear would refuse: its
        statistics would stay in them after the error."""
        features_fit = x.dim() >= 1 and x.shape[-1] == self.in_features
        dtype_fits = x.dtype == self.weight.dtype or torch.is_autocast_enabled(x.device.type)
        if not (features_fit and dtype_fits):
            raise ValueError(
                f"nvfp4_static: layer '{self.layer_name}' takes inputs of {self.in_features} features in "
                f"{self.weight.dtype}; got shape {list(x.shape)} in {x.dtype} (the batch was not observed)"
            )

    def _settle_observers(self) -> None:
        """Report a batch refused after the fact (on CUDA, see ``MergeableObserver``) once every
        observer of this layer has dropped it, so that their statistics stay in step (the
        Hessian can refuse a batch the activation calibrator took: squares that overflow)."""
        observers = [o for o in (self.hessian_accumulator, self.act_calibrator) if o is not None]
        refused = [observer.has_refused_pending_batch() for observer in observers]
        any_refused = any(refused)
        for observer, its_refusal in zip(observers, refused):
            if any_refused and not its_refusal:
                observer.discard_pending_batch()
        for observer, its_refusal in zip(observers, refused):
            observer.settle(its_refusal)  # raises for a refusing one; else clears its pending test

    def extra_repr(self) -> str:
        hessian = ", hessian=True" if self.hessian_accumulator is not None else ""
        return (
            f"{super().extra_repr()}, act_calibrator={type(self.act_calibrator).__name__}"
            f"{hessian}"
        )

