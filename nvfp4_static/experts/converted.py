"""The converted experts: every expert's two GEMMs in static NVFP4, run as grouped GEMMs."""

import math
import os
from typing import Optional

import torch

from nvfp4_static.backends import BACKEND_ENV_VAR, resolve_backend
from nvfp4_static.deferred_read import DeferredRead
from nvfp4_static.experts.eager import EagerExpertsLaunches
from nvfp4_static.experts.layouts import ExpertsLayout
from nvfp4_static.experts.routing import check_expert_indices, check_routing, combine, route
from nvfp4_static.inference_only import InferenceOnly, records_gradients, refusing_gradients
from nvfp4_static.kernels.ops import (
    grouped_static_nvfp4_linear,
    grouped_static_nvfp4_linear_reference,
    require_triton,
)
from nvfp4_static.linear import (
    NVFP4StaticLinear,
    check_block_scale_codes,
    check_checkpoint_scale_values,
)
from nvfp4_static.numerics import BLOCK_SIZE, SUPPORTED_DTYPES, largest_at_most
from nvfp4_static.tensor import NVFP4StaticTensor, host_scale_product

__all__ = ["NVFP4StaticGroupedLinear", "NVFP4StaticExperts", "experts_backend"]

_BUFFERS = ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale")
PROJECTIONS = ("gate_up_proj", "down_proj")

# The experts' routes (see nvfp4_static.backends for the linears'): "triton" is the grouped
# Triton GEMM on CUDA tensors and the torch reference on others, as the linears' Triton route
# is; "cpu" is the torch reference on every device.
_GROUPED_ROUTES = {"cpu": grouped_static_nvfp4_linear_reference, "triton": grouped_static_nvfp4_linear}


def experts_backend(device: torch.device, override: Optional[str], layer_name: str) -> str:
    """The route of the experts ``layer_name`` on ``device``: ``override`` (the config's
    ``backend``), else ``$NVFP4_STATIC_BACKEND``, else the Triton grouped GEMM on CUDA and the
    torch reference elsewhere. There is no grouped FP4 ``_scaled_mm`` route, so a forced
    ``"blackwell"`` is refused; left unset, an sm100 GPU runs its linears on ``blackwell`` and
    its experts on the Triton grouped GEMM."""
    if not (override or os.environ.get(BACKEND_ENV_VAR)):
        backend = "triton" if device.type == "cuda" else "cpu"
    else:
        backend = resolve_backend(device, override)  # refuses an unknown name
    if backend not in _GROUPED_ROUTES:
        raise ValueError(
            f"nvfp4_static: experts '{layer_name}': backend {backend!r} (from the config's backend "
            f"or ${BACKEND_ENV_VAR}) has no grouped GEMM for mixture-of-experts layers; experts "
            f"run on {' or '.join(repr(b) for b in _GROUPED_ROUTES)}. Choose one of those, or "
            f"leave backend unset (an sm100 GPU then runs the linears on 'blackwell' and the "
            f"experts on 'triton')"
        )
    if backend == "triton":
        require_triton(f"experts '{layer_name}' on backend 'triton' (the grouped GEMM)")
    return backend


class NVFP4StaticGroupedLinear(torch.nn.Module):
    """``E`` experts' ``[N, K]`` static NVFP4 linears, stacked, without bias.

    Buffers, per expert what an ``NVFP4StaticTensor`` holds: ``qdata`` uint8 ``[E, N, K/2]``,
    ``scale`` float8_e4m3fn ``[E, N, K/16]``, ``per_tensor_scale`` and ``act_per_tensor_scale``
    float32 ``[E]``. ``forward(x, expert_offsets, source_rows=None)`` runs the grouped op of
    ``backend`` (``"triton"``: ``kernels.ops.grouped_static_nvfp4_linear``; ``"cpu"``: its torch
    reference on any device; by device until the owning ``NVFP4StaticExperts`` sets it): for
    each expert's rows (``x[source_rows]`` where given), exactly the converted
    ``NVFP4StaticLinear`` of that expert.

    ``clip_counters``: while the clip monitor runs (``start_clip_monitor``), per expert the
    input elements above its ``act_global_amax``, the elements seen and the largest magnitude,
    ``[E + 1]`` each on the module's device (the last bin takes rows routed to no expert).
    """

    def __init__(self, qdata, scale, per_tensor_scale, act_per_tensor_scale):
        super().__init__()
        for name, value in zip(_BUFFERS, (qdata, scale, per_tensor_scale, act_per_tensor_scale)):
            self.register_buffer(name, value)
        self.backend = "triton" if qdata.is_cuda else "cpu"
        self.clip_counters: Optional[dict[str, torch.Tensor]] = None

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
        if self.clip_counters is not None:
            self._count_clipped(x if source_rows is None else x[source_rows], expert_offsets)
        return _GROUPED_ROUTES[self.backend](
            x, expert_offsets, self.qdata, self.scale, self.per_tensor_scale, self.act_per_tensor_scale, source_rows
        )

    def start_clip_monitor(self) -> None:
        """Count, from now on, each expert's inputs above its ``act_global_amax``."""
        bins = dict(size=(self.num_experts + 1,), device=self.act_per_tensor_scale.device)
        self.clip_counters = {
            "clipped": torch.zeros(**bins, dtype=torch.int64),
            "seen": torch.zeros(**bins, dtype=torch.int64),
            "max_abs": torch.zeros(**bins, dtype=torch.float32),
        }

    def stop_clip_monitor(self) -> None:
        self.clip_counters = None

    @torch.no_grad()
    def _count_clipped(self, rows: torch.Tensor, expert_offsets: torch.Tensor) -> None:
        """Add ``rows`` (sorted by expert, as the forward takes them) to each expert's counters,
        with shape-static ops (no host sync, one compiled graph for every routing)."""
        magnitude = rows.detach().abs()
        row_index = torch.arange(magnitude.shape[0], device=magnitude.device)
        # Rows before expert_offsets[1] are expert 0's: the offsets at or below a row, less one,
        # clamped at 0. The boundaries are not sliced (expert_offsets[1:]): Inductor's CUDA
        # lowering of searchsorted ignores a slice's offset (pytorch/pytorch#160964).
        expert_of_row = (torch.searchsorted(expert_offsets, row_index, right=True) - 1).clamp(min=0)
        limits = torch.cat([self.act_global_amax, self.act_global_amax.new_full((1,), torch.inf)])
        clipped = (magnitude > largest_at_most(limits, magnitude.dtype)[expert_of_row, None]).sum(dim=-1)
        counters = self.clip_counters
        counters["clipped"].index_add_(0, expert_of_row, clipped)
        counters["seen"].index_add_(0, expert_of_row, torch.full_like(clipped, magnitude.shape[-1]))
        counters["max_abs"].scatter_reduce_(0, expert_of_row, magnitude.amax(dim=-1).float(), "amax")

    def check_scales(self, state_dict: dict, prefix: str, layer_name: str) -> None:
        """Refuse a checkpoint's tensors of other shapes than these experts', codes or block
        scales of another dtype (copied, they would be converted as numbers: other values without
        an error), and scales that convert never produces, naming the expert."""
        for field in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
            theirs, ours = state_dict.get(prefix + field), getattr(self, field)
            if not isinstance(theirs, torch.Tensor):
                continue  # missing, or not a tensor: load_state_dict names it
            if theirs.shape != ours.shape:
                problem = f"its {field} has shape {tuple(theirs.shape)}, the model's {tuple(ours.shape)}"
            elif field in ("qdata", "scale") and theirs.dtype != ours.dtype:
                problem = f"its {field} is {theirs.dtype}, the model's {ours.dtype}"
            else:
                continue
            raise ValueError(f"nvfp4_static: checkpoint for experts '{layer_name}': {problem}")
        act_scales = state_dict.get(prefix + "act_per_tensor_scale")
        weight_scales = state_dict.get(prefix + "per_tensor_scale")
        block_scales = state_dict.get(prefix + "scale")
        if isinstance(act_scales, torch.Tensor) and isinstance(weight_scales, torch.Tensor):
            for expert, (act_scale, weight_scale) in enumerate(zip(act_scales.cpu(), weight_scales.cpu())):
                check_checkpoint_scale_values(act_scale, weight_scale, f"{layer_name}.{expert}")
        if isinstance(block_scales, torch.Tensor):
            for expert, scales in enumerate(block_scales):
                check_block_scale_codes(scales, f"{layer_name}.{expert}")

    def expert_weight(self, expert: int, rows: slice, orig_dtype: torch.dtype) -> NVFP4StaticTensor:
        """Rows ``rows`` of expert ``expert``'s weight, as the weight of an ``NVFP4StaticLinear``:
        views of the codes and block scales, copies of the two global scales (the gate and the
        up rows of an expert share them, and a file may not hold one tensor twice)."""
        weight_scale = self.per_tensor_scale[expert].clone()
        act_scale = self.act_per_tensor_scale[expert].clone()
        return NVFP4StaticTensor(
            self.qdata[expert, rows],
            self.scale[expert, rows],
            BLOCK_SIZE,
            orig_dtype,
            weight_scale,
            act_scale,
            output_scale=host_scale_product(act_scale, weight_scale),
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
    down projections of all experts as two grouped GEMMs (``NVFP4StaticGroupedLinear``, on
    ``backend``) and sums each token's weighted outputs in expert order. Each
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
        backend_override: the config's ``backend`` (None: by device, see ``experts_backend``).
        backend: the route both grouped GEMMs run on, ``"triton"`` or ``"cpu"``; picked again
            when the module moves to another device.
        calibration_stats: ``tokens_per_expert``, ``pooled_experts`` (the experts that took
            the layer's pooled statistics) and, under ``"gate_up_proj"`` and ``"down_proj"``,
            each expert's calibrator diagnostics (as ``NVFP4StaticLinear.calibration_stats``);
            not saved.
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
        backend_override: Optional[str] = None,
    ):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.layout = layout
        self.orig_dtype = orig_dtype
        self.recipe = dict(recipe)
        self.layer_name = layer_name
        self.calibration_stats = calibration_stats or {}
        self.loaded = True
        self.backend_override = backend_override
        self._indices_in_range = DeferredRead()
        self._eager_launches = EagerExpertsLaunches()
        self._pick_backend()

    def _pick_backend(self) -> None:
        backend = experts_backend(self.gate_up_proj.qdata.device, self.backend_override, self.layer_name)
        self.gate_up_proj.backend = self.down_proj.backend = backend

    @property
    def backend(self) -> str:
        return self.gate_up_proj.backend

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pick_backend()
        return self

    @classmethod
    def placeholder(
        cls,
        experts: torch.nn.Module,
        layout: ExpertsLayout,
        recipe: dict,
        layer_name: str,
        backend_override: Optional[str] = None,
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
            backend_override=backend_override,
        )
        placeholder.loaded = False
        placeholder._unloaded_tensors = {
            f"{projection}.{name}"
            for projection in PROJECTIONS
            for name, _ in getattr(placeholder, projection).named_buffers()
        }
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
            f"{expert}.{name}": self._expert_linear(grouped, expert, rows, f"{expert}.{name}")
            for expert in range(self.num_experts)
            for name, grouped, rows in parts
        }

    def projection_linears(self) -> dict[str, NVFP4StaticLinear]:
        """Every expert's two GEMMs as ``NVFP4StaticLinear``s sharing this module's data, by the
        names calibration gave them relative to this module (``"gate_up_proj.{e}"``,
        ``"down_proj.{e}"``), each with its ``calibration_stats``: its calibrator's diagnostics,
        ``tokens`` (the calibration tokens the expert saw) and ``pooled`` (whether it took the
        layer's pooled statistics); empty after loading a checkpoint."""
        stats = self.calibration_stats
        linears = {}
        for projection in PROJECTIONS:
            for expert in range(self.num_experts):
                name = f"{projection}.{expert}"
                linears[name] = self._expert_linear(getattr(self, projection), expert, slice(None), name)
                if stats:
                    linears[name].calibration_stats = {
                        **stats[projection][expert],
                        "tokens": stats["tokens_per_expert"][expert],
                        "pooled": expert in stats["pooled_experts"],
                    }
        return linears

    def _expert_linear(self, grouped, expert: int, rows: slice, name: str) -> NVFP4StaticLinear:
        return NVFP4StaticLinear(
            grouped.expert_weight(expert, rows, self.orig_dtype), None, self.recipe, f"{self.layer_name}.{name}"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.loaded:
            raise RuntimeError(
                f"nvfp4_static: experts '{self.layer_name}' are an empty placeholder; load a "
                f"checkpoint into them (nvfp4_static.load_quantized or model.load_state_dict) "
                f"before running the model"
            )
        if hidden_states.dtype not in SUPPORTED_DTYPES or hidden_states.shape[-1] != self.gate_up_proj.in_features:
            raise ValueError(
                f"nvfp4_static: experts '{self.layer_name}' take hidden states of size "
                f"{self.gate_up_proj.in_features} in float32, bfloat16 or float16, got shape "
                f"{tuple(hidden_states.shape)} in {hidden_states.dtype}"
            )
        check_routing(hidden_states, top_k_index, top_k_weights, self.layer_name, self.gate_up_proj.qdata.device)
        eager = not torch.compiler.is_compiling()
        if not eager and records_gradients(hidden_states, top_k_weights):
            out = self.forward(hidden_states.detach(), top_k_index, top_k_weights.detach())
            return refusing_gradients(out, hidden_states, top_k_weights)
        if eager and top_k_index.device.type == "cpu":
            check_expert_indices(top_k_index, self.num_experts, self.layer_name)
        # On CUDA outside a graph capture: the count of indices in range, read at the next call.
        deferred = eager and top_k_index.is_cuda and not torch.cuda.is_current_stream_capturing()
        if deferred:
            self._check_indices_of_the_call_before()
        parts = self._eager_launches.parts(self, hidden_states, top_k_index, top_k_weights) if deferred else self
        routing, gate_up = parts._route_and_gate_up(hidden_states, top_k_index)
        if deferred:  # queued before the GEMMs, so that the next call's read need not wait for them
            self._indices_in_range.send(routing.pairs_in_range, tuple(top_k_index.shape))
        out = parts._down_and_combine(self._activated(gate_up), routing, top_k_weights, hidden_states.dtype)
        return InferenceOnly.apply(out) if out.requires_grad else out

    def _weight_tensors(self) -> tuple:
        """Both projections' buffers, gate/up's then down's, each in ``_BUFFERS`` order."""
        return tuple(getattr(projection, name) for projection in (self.gate_up_proj, self.down_proj) for name in _BUFFERS)

    # The forward's two kernel parts, with the activation (the float module's own) between them.
    # An eager call on CUDA may record or replay their launches instead (``experts.eager``).

    def _route_and_gate_up(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        """The routing of ``top_k_index`` and the gate/up projection of the routed rows."""
        routing = route(top_k_index, self.num_experts)
        return routing, self.gate_up_proj(hidden_states, routing.expert_offsets, routing.token_of_row)

    def _activated(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _down_and_combine(self, intermediate: torch.Tensor, routing, top_k_weights: torch.Tensor, dtype) -> torch.Tensor:
        """The down projection of each routed row and each token's weighted sum of its rows."""
        return combine(self.down_proj(intermediate, routing.expert_offsets), routing, top_k_weights, dtype)

    def _check_indices_of_the_call_before(self) -> None:
        """Refuse to go on after a call on CUDA whose ``top_k_index`` held indices outside
        ``0..E``: reading them at that call would have stalled every layer's launches, so the
        count travels to the host behind the call (``DeferredRead``) and is read here. That
        call's tokens got no output from the slots concerned; this call is not run."""
        if self._indices_in_range.note is None:
            return
        shape, in_range = self._indices_in_range.note, self._indices_in_range.read()
        self._indices_in_range.clear()
        pairs = math.prod(shape)
        if in_range != pairs:
            raise ValueError(
                f"nvfp4_static: experts '{self.layer_name}': the call before this one had "
                f"{pairs - in_range} expert indices outside 0..{self.num_experts} in its top_k_index "
                f"{list(shape)} ({self.num_experts} routes a slot to no expert); those slots added "
                f"nothing to their tokens' outputs, so that call's output is wrong. Check the router"
            )

    # The checkpoint record and its checks on load are a converted linear's.
    get_extra_state = NVFP4StaticLinear.get_extra_state
    set_extra_state = NVFP4StaticLinear.set_extra_state
    check_saved_state = NVFP4StaticLinear.check_saved_state

    def check_loadable(self, state_dict: dict, prefix: str) -> None:
        """``NVFP4StaticLinear.check_loadable`` for the experts' recipe and every expert's scales."""
        name = self.layer_name or prefix[:-1]
        if prefix + "_extra_state" in state_dict:
            self.check_saved_state(state_dict[prefix + "_extra_state"])
        self.gate_up_proj.check_scales(state_dict, prefix + "gate_up_proj.", f"{name}.gate_up_proj")
        self.down_proj.check_scales(state_dict, prefix + "down_proj.", f"{name}.down_proj")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.check_loadable(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # Filled once every tensor of both projections is loaded, by one load or by several
        # (strict=False, a shard each).
        if not self.loaded:
            self._unloaded_tensors = {key for key in self._unloaded_tensors if prefix + key not in state_dict}
            self.loaded = not self._unloaded_tensors

    def extra_repr(self) -> str:
        recipe = ", ".join(f"{k}={v}" for k, v in self.recipe.items())
        return f"{recipe}, backend={self.backend}" + ("" if self.loaded else ", empty placeholder")
