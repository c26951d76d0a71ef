"""The converted experts: every expert's two GEMMs in static NVFP4, run as grouped GEMMs."""

from typing import Optional

import torch

from nvfp4_static.experts.layouts import ExpertsLayout
from nvfp4_static.experts.routing import combine, route
from nvfp4_static.kernels.ops import grouped_static_nvfp4_linear, require_triton
from nvfp4_static.linear import NVFP4StaticLinear, _InferenceOnly, check_checkpoint_scale_values
from nvfp4_static.numerics import BLOCK_SIZE
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["NVFP4StaticGroupedLinear", "NVFP4StaticExperts"]

_BUFFERS = ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale")


class NVFP4StaticGroupedLinear(torch.nn.Module):
    """``E`` experts' ``[N, K]`` static NVFP4 linears, stacked, without bias.

    Buffers, per expert what an ``NVFP4StaticTensor`` holds: ``qdata`` uint8 ``[E, N, K/2]``,
    ``scale`` float8_e4m3fn ``[E, N, K/16]``, ``per_tensor_scale`` and ``act_per_tensor_scale``
    float32 ``[E]``. ``forward(x, expert_offsets, source_rows=None)`` runs
    ``kernels.ops.grouped_static_nvfp4_linear``: for each expert's rows (``x[source_rows]`` where
    given), exactly the converted ``NVFP4StaticLinear`` of that expert.
    """

    def __init__(self, qdata, scale, per_tensor_scale, act_per_tensor_scale):
        super().__init__()
        for name, value in zip(_BUFFERS, (qdata, scale, per_tensor_scale, act_per_tensor_scale)):
            self.register_buffer(name, value)

    @classmethod
    def from_linears(cls, linears: list[NVFP4StaticLinear]) -> "NVFP4StaticGroupedLinear":
        """Stack the weights of converted linears, one per expert, in expert order."""
        weights = [linear.weight for linear in linears]
        return cls(*(torch.stack([getattr(w, name) for w in weights]) for name in _BUFFERS))

    @classmethod
    def empty(cls, num_experts: int, out_features: int, in_features: int, device) -> "NVFP4StaticGroupedLinear":
        """Zero codes and unit scales of the right shapes, for ``load_state_dict`` to fill."""
        return cls(
            torch.zeros(num_experts, out_features, in_features // 2, dtype=torch.uint8, device=device),
            torch.zeros(
                num_experts, out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device
            ),
            torch.ones(num_experts, dtype=torch.float32, device=device),
            torch.ones(num_experts, dtype=torch.float32, device=device),
        )

    @property
    def num_experts(self) -> int:
        return self.qdata.shape[0]

    @property
    def out_features(self) -> int:
        return self.qdata.shape[1]

    @property
    def in_features(self) -> int:
        return self.qdata.shape[2] * 2

    @property
    def act_global_amax(self) -> torch.Tensor:
        """Each expert's static activation global amax, ``[E]``."""
        return self.act_per_tensor_scale * 448 * 6

    def forward(
        self, x: torch.Tensor, expert_offsets: torch.Tensor, source_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return grouped_static_nvfp4_linear(
            x, expert_offsets, self.qdata, self.scale, self.per_tensor_scale, self.act_per_tensor_scale, source_rows
        )

    def check_scales(self, state_dict: dict, prefix: str, layer_name: str) -> None:
        """Refuse a checkpoint's global scales that convert never produces, naming the expert."""
        act_scales = state_dict.get(prefix + "act_per_tensor_scale")
        weight_scales = state_dict.get(prefix + "per_tensor_scale")
        if not isinstance(act_scales, torch.Tensor) or not isinstance(weight_scales, torch.Tensor):
            return  # missing: load_state_dict names it
        for expert, (act_scale, weight_scale) in enumerate(zip(act_scales.cpu(), weight_scales.cpu())):
            check_checkpoint_scale_values(act_scale, weight_scale, f"{layer_name}.{expert}")

    def expert_weight(self, expert: int, rows: slice, orig_dtype: torch.dtype) -> NVFP4StaticTensor:
        """Rows ``rows`` of expert ``expert``'s weight, as the weight of an ``NVFP4StaticLinear``:
        views of the codes and block scales, copies of the two global scales (the gate and the
        up rows of an expert share them, and a file may not hold one tensor twice)."""
        return NVFP4StaticTensor(
            self.qdata[expert, rows],
            self.scale[expert, rows],
            BLOCK_SIZE,
            orig_dtype,
            self.per_tensor_scale[expert].clone(),
            self.act_per_tensor_scale[expert].clone(),
        )

    def _apply(self, fn, recurse=True):
        # NVFP4 data keeps its dtypes under model.to(dtype) / .half(), as NVFP4StaticTensor does:
        # Module.to casts every floating buffer, FP8 scales and float32 global scales included.
        # Only a change of device is taken from fn.
        for name, buffer in self._buffers.items():
            moved = fn(buffer)
            self._buffers[name] = moved if moved.dtype == buffer.dtype else buffer.to(moved.device)
        return self

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}"


class NVFP4StaticExperts(torch.nn.Module):
    """A mixture-of-experts layer's experts in static NVFP4, with the float experts' forward.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` routes the tokens
    as transformers' eager experts forward does (``experts.routing``), runs the gate/up and the
    down projections of all experts as two grouped GEMMs (``NVFP4StaticGroupedLinear``: Triton
    on CUDA, torch ops elsewhere) and sums each token's weighted outputs in expert order. Each
    expert's rows get exactly what that expert's ``NVFP4StaticLinear`` would compute. Every shape
    in the forward is fixed by ``T`` and ``k``, so a compiled forward serves any routing.

    Attributes:
        gate_up_proj: ``[2I, H]`` per expert (gate rows, then up rows: one GEMM, one weight
            global scale and one activation global scale per expert).
        down_proj: ``[H, I]`` per expert.
        act_fn: the float module's activation.
        layout: the ``ExpertsLayout`` of the float module (its checkpoint names).
        orig_dtype: the float weights' dtype.
        recipe, layer_name, loaded: as ``NVFP4StaticLinear``'s.
        calibration_stats: ``tokens_per_expert`` and ``pooled_experts`` (the experts that took
            the layer's pooled statistics), not saved.
    """

    def __init__(
        self,
        gate_up_proj: NVFP4StaticGroupedLinear,
        down_proj: NVFP4StaticGroupedLinear,
        act_fn,
        layout: ExpertsLayout,
        orig_dtype: torch.dtype,
        recipe: dict,
        layer_name: str = "",
        calibration_stats: Optional[dict] = None,
    ):
        super().__init__()
        if gate_up_proj.qdata.is_cuda:
            require_triton("the grouped GEMM of NVFP4 experts")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.layout = layout
        self.orig_dtype = orig_dtype
        self.recipe = dict(recipe)
        self.layer_name = layer_name
        self.calibration_stats = calibration_stats or {}
        self.loaded = True

    @classmethod
    def placeholder(
        cls, experts: torch.nn.Module, layout: ExpertsLayout, recipe: dict, layer_name: str
    ) -> "NVFP4StaticExperts":
        """Empty converted experts of the float ``experts``' shapes, for ``load_state_dict``."""
        gate_up, down = layout.weights(experts)
        num_experts, double_intermediate, hidden = gate_up.shape
        placeholder = cls(
            NVFP4StaticGroupedLinear.empty(num_experts, double_intermediate, hidden, gate_up.device),
            NVFP4StaticGroupedLinear.empty(num_experts, hidden, double_intermediate // 2, down.device),
            getattr(experts, layout.act_fn),
            layout,
            gate_up.dtype,
            recipe,
            layer_name,
        )
        placeholder.loaded = False
        return placeholder

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.num_experts

    def expert_linears(self) -> dict[str, NVFP4StaticLinear]:
        """Every expert's gate, up and down projections as ``NVFP4StaticLinear``s sharing this
        module's data, by their names in the architecture's checkpoints relative to this
        module (``"{e}.gate_proj"``): what serving formats store per expert. Gate and up
        carry their expert's one pair of global scales."""
        gate, up, down = self.layout.checkpoint_names
        intermediate = self.down_proj.in_features
        parts = (
            (gate, self.gate_up_proj, slice(0, intermediate)),
            (up, self.gate_up_proj, slice(intermediate, 2 * intermediate)),
            (down, self.down_proj, slice(None)),
        )
        return {
            f"{expert}.{name}": NVFP4StaticLinear(
                grouped.expert_weight(expert, rows, self.orig_dtype),
                None,
                self.recipe,
                f"{self.layer_name}.{expert}.{name}",
            )
            for expert in range(self.num_experts)
            for name, grouped, rows in parts
        }

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.loaded:
            raise RuntimeError(
                f"nvfp4_static: experts '{self.layer_name}' are an empty placeholder; load a "
                f"checkpoint into them (nvfp4_static.load_quantized or model.load_state_dict) "
                f"before running the model"
            )
        if hidden_states.shape[-1] != self.gate_up_proj.in_features:
            raise ValueError(
                f"nvfp4_static: experts '{self.layer_name}' take hidden states of size "
                f"{self.gate_up_proj.in_features}, got shape {tuple(hidden_states.shape)}"
            )
        routing = route(top_k_index, self.num_experts)
        gate_up = self.gate_up_proj(hidden_states, routing.expert_offsets, routing.token_of_row())
        gate, up = gate_up.chunk(2, dim=-1)
        expert_rows = self.down_proj(self.act_fn(gate) * up, routing.expert_offsets)
        out = combine(expert_rows, routing, top_k_weights, hidden_states.dtype)
        return _InferenceOnly.apply(out) if out.requires_grad else out

    # The checkpoint record and its check on load are a converted linear's.
    get_extra_state = NVFP4StaticLinear.get_extra_state
    set_extra_state = NVFP4StaticLinear.set_extra_state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        name = self.layer_name or prefix[:-1]
        self.gate_up_proj.check_scales(state_dict, prefix + "gate_up_proj.", f"{name}.gate_up_proj")
        self.down_proj.check_scales(state_dict, prefix + "down_proj.", f"{name}.down_proj")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        recipe = ", ".join(f"{k}={v}" for k, v in self.recipe.items())
        return f"{recipe}" + ("" if self.loaded else ", empty placeholder")
