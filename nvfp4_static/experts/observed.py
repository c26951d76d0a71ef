"""The observed experts that ``step="prepare"`` puts in place of a registered experts module."""

from typing import Optional

import torch

from nvfp4_static.experts.layouts import ExpertsLayout
from nvfp4_static.experts.routing import check_expert_indices, check_routing, combine, route
from nvfp4_static.observed import NVFP4StaticObservedLinear

__all__ = ["NVFP4StaticObservedExperts"]


class NVFP4StaticObservedExperts(torch.nn.Module):
    """An MoE layer's experts, each expert's two GEMMs an ``NVFP4StaticObservedLinear``.

    The forward routes tokens as transformers' eager experts forward does (``experts.routing``)
    and runs each expert's float linears on its own tokens only, so each expert's calibrators
    (and Hessians) see exactly the inputs that expert gets; the output equals the float module's.
    The expert linears hold views of the float module's 3-D weights (no copy). Beside them, two
    pooled calibrators see the whole layer: its input (what every gate/up projection reads) and
    every expert's down-projection input. Convert gives their statistics to experts that saw
    too few tokens of their own.

    Attributes:
        gate_up_proj, down_proj: ``ModuleList`` of ``E`` observed linears, ``[2I, H]`` and
            ``[H, I]``; gate and up of an expert are one linear, so they share its scales.
        act_fn: the float module's activation.
        layout: the float module's ``ExpertsLayout``.
        pooled_gate_up_calibrator, pooled_down_calibrator: the layer's pooled statistics.
        tokens_per_expert: calibration tokens each expert saw.
        layer_name, activation_recipe: as ``NVFP4StaticObservedLinear``'s.
    """

    def __init__(
        self,
        gate_up_proj: list[NVFP4StaticObservedLinear],
        down_proj: list[NVFP4StaticObservedLinear],
        act_fn,
        layout: ExpertsLayout,
        pooled_gate_up_calibrator,
        pooled_down_calibrator,
        layer_name: str = "",
        activation_recipe: Optional[dict] = None,
    ):
        super().__init__()
        self.gate_up_proj = torch.nn.ModuleList(gate_up_proj)
        self.down_proj = torch.nn.ModuleList(down_proj)
        self.act_fn = act_fn
        self.layout = layout
        self.pooled_gate_up_calibrator = pooled_gate_up_calibrator
        self.pooled_down_calibrator = pooled_down_calibrator
        self.tokens_per_expert = [0] * len(gate_up_proj)
        self.layer_name = layer_name
        self.activation_recipe = activation_recipe

    @property
    def num_experts(self) -> int:
        return len(self.gate_up_proj)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self.gate_up_proj[0].check_input(hidden_states)  # before the pooled calibrator sees it
        check_routing(hidden_states, top_k_index, top_k_weights, self.layer_name, self.gate_up_proj[0].weight.device)
        check_expert_indices(top_k_index, self.num_experts, self.layer_name, " (the batch was not observed)")
        routing = route(top_k_index, self.num_experts)
        x = hidden_states[routing.token_of_row]
        bounds = routing.expert_offsets.tolist()
        expert_rows = x.new_zeros(x.shape[0], hidden_states.shape[-1])
        if bounds[-1]:
            # The tokens some expert receives (index num_experts routes a slot to none), each once.
            routed = top_k_index.lt(self.num_experts).any(dim=-1)
            with torch.no_grad():
                self.pooled_gate_up_calibrator.collect(
                    hidden_states.detach() if bool(routed.all()) else hidden_states.detach()[routed]
                )
        intermediates = []
        for expert, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == first:
                continue
            gate, up = self.gate_up_proj[expert](x[first:end]).chunk(2, dim=-1)
            intermediates.append(self.act_fn(gate) * up)
            expert_rows[first:end] = self.down_proj[expert](intermediates[-1])
            self.tokens_per_expert[expert] += end - first
        if intermediates:
            with torch.no_grad():
                self.pooled_down_calibrator.collect(torch.cat(intermediates).detach())
        return combine(expert_rows, routing, top_k_weights, hidden_states.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.gate_up_proj[0].in_features}, "
            f"intermediate={self.down_proj[0].in_features}, "
            f"act_calibrator={type(self.pooled_gate_up_calibrator).__name__}"
        )
