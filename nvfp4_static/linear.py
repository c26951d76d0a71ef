"""The converted linear: an ``nn.Linear`` whose weight is an ``NVFP4StaticTensor``."""

from typing import Optional

import torch

from nvfp4_static.numerics import BLOCK_SIZE
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["NVFP4StaticLinear"]

CHECKPOINT_FORMAT = "nvfp4_static"
CHECKPOINT_VERSION = 1


class NVFP4StaticLinear(torch.nn.Linear):
    """A linear layer quantized to NVFP4 with a static activation global scale.

    ``forward`` is ``nn.Linear``'s: the weight subclass does the quantized GEMM. The module adds
    what a user inspects (``extra_repr``, ``calibration_stats``) and a checkpoint guard: the
    recipe is saved as extra state, and loading a checkpoint made with another recipe raises.

    Attributes:
        layer_name: fully qualified name of the module.
        recipe: ``{"act_calibration": ..., "weight_scale": ...}`` this layer was converted with.
        calibration_stats: the activation calibrator's diagnostics (not saved).
    """

    def __init__(
        self,
        weight: NVFP4StaticTensor,
        bias: Optional[torch.nn.Parameter],
        recipe: dict,
        layer_name: str = "",
        calibration_stats: Optional[dict] = None,
    ):
        out_features, in_features = weight.shape
        with torch.device("meta"):
            super().__init__(in_features, out_features, bias=False)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.recipe = dict(recipe)
        self.layer_name = layer_name
        self.calibration_stats = calibration_stats or {}

    @classmethod
    def placeholder(
        cls, linear: torch.nn.Linear, recipe: dict, layer_name: str, backend_override=None
    ) -> "NVFP4StaticLinear":
        """An empty converted layer of ``linear``'s shape, for ``load_state_dict`` to fill."""
        out_features, in_features = linear.weight.shape
        device = linear.weight.device
        weight = NVFP4StaticTensor(
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device),
            torch.zeros(
                out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device
            ),
            BLOCK_SIZE,
            linear.weight.dtype,
            torch.ones((), dtype=torch.float32, device=device),
            torch.ones((), dtype=torch.float32, device=device),
            backend_override=backend_override,
        )
        return cls(weight, linear.bias, recipe, layer_name)

    @property
    def act_global_amax(self) -> float:
        return float(self.weight.act_per_tensor_scale) * 448 * 6

    def get_extra_state(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **self.recipe}

    def set_extra_state(self, state: dict) -> None:
        saved = {k: v for k, v in state.items() if k not in ("format", "version")}
        if state.get("format") != CHECKPOINT_FORMAT or saved != self.recipe:
            raise ValueError(
                f"nvfp4_static: checkpoint for layer '{self.layer_name}' was made with recipe "
                f"{saved} (format {state.get('format')!r}), but the model was prepared with "
                f"{self.recipe}; prepare the model with the config the checkpoint was converted with"
            )

    def extra_repr(self) -> str:
        recipe = ", ".join(f"{k}={v}" for k, v in self.recipe.items())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {recipe}, act_global_amax={self.act_global_amax:.4g}, "
            f"backend={self.weight.linear_backend}"
        )
