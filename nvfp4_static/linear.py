"""The converted linear: an ``nn.Linear`` whose weight is an ``NVFP4StaticTensor``."""

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from nvfp4_static.backends.cpu_eager import EagerCpuKernelCalls, eager_linear
from nvfp4_static.backends.triton_eager import EagerTritonLaunches
from nvfp4_static.config import ACT_CALIBRATIONS, WEIGHT_SCALES
from nvfp4_static.inference_only import InferenceOnly, detached, records_gradients, refusing_gradients
from nvfp4_static.numerics import (
    BLOCK_SIZE,
    LARGEST_GLOBAL_SCALE,
    SUPPORTED_DTYPES,
    is_usable_act_per_tensor_scale,
    largest_at_most,
)
from nvfp4_static.tensor import NVFP4StaticTensor, UnpresentableDtypeError, copy_refusal

__all__ = [
    "NVFP4StaticLinear",
    "check_block_scale_codes",
    "check_checkpoint_scales",
    "check_checkpoint_scale_values",
    "saved_recipe",
]

COMPUTES_IN = "a converted layer computes in float32, bfloat16 or float16"
CHECKPOINT_FORMAT = "nvfp4_static"
CHECKPOINT_VERSION = 1
# Set in the extra state of a layer saved before a checkpoint was loaded into it.
EMPTY_PLACEHOLDER = "empty_placeholder"
# The recipe a converted layer records: the config's two choices, or IMPORTED for both where
# the layer came from another format's checkpoint (``serving_import``).
IMPORTED = "imported"
RECIPE_CHOICES = {"act_calibration": (*ACT_CALIBRATIONS, IMPORTED), "weight_scale": (*WEIGHT_SCALES, IMPORTED)}


def saved_recipe(state, layer_name: str) -> dict:
    """The recipe a converted layer's saved extra state records, refusing a state that is not
    one of ours or that an empty ``prepare_for_loading`` placeholder saved (all-zero weights)."""
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' holds extra state {state!r}, not "
            f"a converted layer's record (format {CHECKPOINT_FORMAT!r})"
        )
    if not isinstance(state.get("version"), int) or state["version"] > CHECKPOINT_VERSION:
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' is of format version "
            f"{state.get('version')!r}; this nvfp4_static reads versions up to {CHECKPOINT_VERSION} "
            f"(upgrade nvfp4_static to load it)"
        )
    if state.get(EMPTY_PLACEHOLDER):
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' was saved from an empty "
            f"placeholder (step='prepare_for_loading' with no checkpoint loaded into it): its "
            f"weights are zeros; save the model after loading or converting it"
        )
    recipe = {k: v for k, v in state.items() if k not in ("format", "version")}
    # A layer built by hand may record none (its recipe {}).
    if not recipe.keys() <= RECIPE_CHOICES.keys() or any(recipe[k] not in RECIPE_CHOICES[k] for k in recipe):
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' records recipe {recipe}; a converted "
            f"layer records act_calibration and weight_scale, one of {RECIPE_CHOICES} each (the "
            f"checkpoint is damaged or was edited)"
        )
    return recipe


def check_checkpoint_scales(weight: torch.Tensor, layer_name: str) -> None:
    """Refuse scales convert never produces (global scales NaN, Inf, an activation scale <= 0
    or too small for NVFP4; block scales NaN or negative): loaded, they would give garbage
    outputs without an error."""
    if not isinstance(weight, NVFP4StaticTensor) or weight.act_per_tensor_scale.is_meta:
        return
    check_checkpoint_scale_values(weight.act_per_tensor_scale, weight.per_tensor_scale, layer_name)
    check_block_scale_codes(weight.scale, layer_name)


def check_block_scale_codes(scale: torch.Tensor, layer_name: str) -> None:
    """Refuse FP8 E4M3 block scales that are NaN (code 0x7F or 0xFF) or negative (the sign bit
    of a nonzero code): NaN outputs, or outputs of the wrong sign, otherwise."""
    if scale.is_meta:
        return
    codes = scale.view(torch.uint8)
    bad = ((codes & 0x7F) == 0x7F) | (codes > 0x80)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' has {int(bad.sum())} FP8 block "
            f"scale(s) that are NaN or negative (the first at index {first}: "
            f"{float(scale[tuple(first)])}); convert only produces finite block scales >= 0 (the "
            f"checkpoint is damaged or was edited)"
        )


def check_checkpoint_scale_values(act_scale: torch.Tensor, weight_scale: torch.Tensor, layer_name: str) -> None:
    """``check_checkpoint_scales`` for one weight's two global scales (scalars). Neither can
    exceed ``LARGEST_GLOBAL_SCALE``, nor their product float32's range: the outputs would
    overflow to Inf or NaN."""
    if not is_usable_act_per_tensor_scale(act_scale) or float(act_scale) > LARGEST_GLOBAL_SCALE:
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' has activation scale "
            f"{float(act_scale)}; convert only produces scales from about 2e-37 to "
            f"{LARGEST_GLOBAL_SCALE:.4g} (the checkpoint is damaged or was edited)"
        )
    if not bool(torch.isfinite(weight_scale)) or not 0 <= float(weight_scale) <= LARGEST_GLOBAL_SCALE:
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' has weight scale "
            f"{float(weight_scale)}; convert only produces scales from 0 to "
            f"{LARGEST_GLOBAL_SCALE:.4g} (the checkpoint is damaged or was edited)"
        )
    product = float(act_scale) * float(weight_scale)
    if product > torch.finfo(torch.float32).max:
        raise ValueError(
            f"nvfp4_static: checkpoint for layer '{layer_name}' has activation scale "
            f"{float(act_scale):.4g} and weight scale {float(weight_scale):.4g}, whose product "
            f"{product:.4g} overflows float32: every output would be Inf or NaN"
        )


class NVFP4StaticLinear(torch.nn.Linear):
    """A linear layer quantized to NVFP4 with a static activation global scale.

    ``forward`` computes ``F.linear`` (the weight subclass does the quantized GEMM; run eagerly,
    the layer calls the subclass's linear directly, skipping the dispatch, and on the Triton
    route replays its kernel launches, see ``backends.triton_eager``), with two guards: an
    empty placeholder from ``prepare_for_loading`` refuses to run before a checkpoint is loaded
    into it, and a backward through the layer raises a clear error. The module adds
    what a user inspects (``extra_repr``, ``calibration_stats``) and a checkpoint guard: the
    recipe is saved as extra state, and loading a checkpoint made with another recipe raises.

    Attributes:
        layer_name: fully qualified name of the module.
        recipe: ``{"act_calibration": ..., "weight_scale": ...}`` this layer was converted with.
        calibration_stats: the activation calibrator's diagnostics (not saved).
        loaded: False for a placeholder until a checkpoint is loaded into it.
        sibling_gemm: the ``SiblingGemm`` whose GEMM this layer's eager calls share with its
            fusion group (``fuse_sibling_linears``), or None.
    """

    # Class defaults: a pickled layer that lacks these attributes loads as an unfused layer
    # whose CPU calls take the general route.
    sibling_gemm = None
    sibling_index = 0
    _eager_cpu_calls: Optional[EagerCpuKernelCalls] = None

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
        self.loaded = True
        self.clip_counters: Optional[dict[str, torch.Tensor]] = None
        self._eager_launches = EagerTritonLaunches()
        self._eager_cpu_calls = EagerCpuKernelCalls()

    @classmethod
    def placeholder(
        cls, linear: torch.nn.Linear, recipe: dict, layer_name: str, backend_override=None
    ) -> "NVFP4StaticLinear":
        """An empty converted layer of ``linear``'s shape, for ``load_state_dict`` to fill."""
        out_features, in_features = linear.weight.shape
        if in_features % BLOCK_SIZE:
            raise ValueError(
                f"nvfp4_static: layer '{layer_name}' is Linear({in_features} -> {out_features}); "
                f"a converted layer needs in_features a multiple of {BLOCK_SIZE} (was the "
                f"checkpoint made from another model?)"
            )
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
        # A copy of the bias: a refused load that puts ``linear`` back leaves it untouched.
        bias = linear.bias
        if bias is not None:
            bias = torch.nn.Parameter(bias.detach().clone(), bias.requires_grad)
        placeholder = cls(weight, bias, recipe, layer_name)
        placeholder.loaded = False
        return placeholder

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers may pass it by keyword
        x = input
        if not self.loaded:
            raise RuntimeError(
                f"nvfp4_static: layer '{self.layer_name}' is an empty placeholder; load a "
                f"checkpoint into it (nvfp4_static.load_quantized or model.load_state_dict) "
                f"before running the model"
            )
        if self.clip_counters is not None:
            self._count_clipped(x)
        if torch.compiler.is_compiling():
            bias = self.bias
            if records_gradients(x, bias):
                return refusing_gradients(F.linear(x.detach(), self.weight, detached(bias)), x, bias)
            return F.linear(x, self.weight, bias)
        try:
            out = None if self.sibling_gemm is None else self.sibling_gemm.output(self.sibling_index, x)
            if out is None:
                # From the parameters' dict: Module.__getattr__ is reached through a failed
                # attribute lookup, 1.9 us per name against 0.08 us for the dict read (on a CPU host).
                parameters = self._parameters
                weight, bias = parameters.get("weight"), parameters["bias"]
                if weight is None:
                    # Held as plain tensors (torchao's unwrap_tensor_subclass) and rebuilt at each
                    # read around the same inner tensors, which is what the replay checks.
                    weight = self.weight
                out = eager_linear(self._eager_cpu_calls, self._eager_launches, x, weight, bias)
        except ValueError as error:  # a refused input: the message names the layer too
            refusal = str(error).removeprefix("nvfp4_static: ")
            raise ValueError(f"nvfp4_static: layer '{self.layer_name}': {refusal}") from error
        return InferenceOnly.apply(out) if out.requires_grad else out

    def _apply(self, fn, recurse=True):
        if parametrize.is_parametrized(self, "weight"):
            self._check_cast_of_unwrapped_weight(fn)
            fn = self._keeping_unwrapped_dtypes(fn)
        try:
            return self._apply_to_tensors(fn, recurse)
        except UnpresentableDtypeError as error:
            raise self._cast_refusal(error.dtype, COMPUTES_IN) from error

    def _apply_to_tensors(self, fn, recurse):
        # Moved or converted, the layer no longer holds a slice of its sibling GEMM's weight,
        # which would stay behind: the siblings run alone from now on.
        if self.sibling_gemm is not None:
            self.sibling_gemm.dissolve()
        # torch converts a tensor-subclass parameter in place (swap_tensors), which it refuses
        # while the parameter is weakly referenced, as the tracing state of a graph compiled
        # through sibling_gemm_backend keeps it: such a parameter gets a new Parameter instead.
        held = {
            key: param
            for key, param in self._parameters.items()
            if param is not None and is_traceable_wrapper_subclass(param) and weakref.getweakrefcount(param)
        }
        if not held:
            return super()._apply(fn, recurse)
        with torch.no_grad():
            converted = {key: torch.nn.Parameter(fn(param), param.requires_grad) for key, param in held.items()}
        self._parameters.update(dict.fromkeys(held))
        try:
            result = super()._apply(fn, recurse)
        except BaseException:
            self._parameters.update(held)
            raise
        self._parameters.update(converted)
        return result

    def _cast_refusal(self, dtype: torch.dtype, problem: str) -> ValueError:
        return ValueError(
            f"nvfp4_static: layer '{self.layer_name}' cannot become {dtype}: {problem}. The "
            f"modules torch reached before this one are {dtype} now: cast the model back "
            f"(model.to({self.weight.dtype}))"
        )

    def _check_cast_of_unwrapped_weight(self, fn) -> None:
        """Refuse, before any of its tensors changes, a cast of a layer whose weight is held
        unwrapped (torchao's ``unwrap_tensor_subclass``) to another dtype: its rebuild keeps
        the weight's dtype (``fn`` of an empty tensor says what the cast does)."""
        dtype = self.weight.dtype
        probe = fn(torch.empty(0, dtype=dtype, device=self.weight.qdata.device))
        if probe.dtype not in SUPPORTED_DTYPES:
            raise self._cast_refusal(probe.dtype, COMPUTES_IN)
        if probe.dtype != dtype:
            raise self._cast_refusal(
                probe.dtype,
                f"its weight is held unwrapped (torchao's unwrap_tensor_subclass), which rebuilds it "
                f"as {dtype}; cast the model before unwrapping it",
            )

    def _keeping_unwrapped_dtypes(self, fn):
        """``fn`` that moves the unwrapped weight's tensors (codes, FP8 block scales, float32
        global scales) without converting them: a cast would convert the scales as numbers."""
        unwrapped = {id(t) for t in self.parametrizations.weight.parameters()}

        def keeping_dtypes(tensor):
            moved = fn(tensor)
            return moved if id(tensor) not in unwrapped or moved.dtype == tensor.dtype else tensor.to(moved.device)

        return keeping_dtypes

    def start_clip_monitor(self) -> None:
        """Count, from now on, the inputs above ``act_global_amax`` (see ``clip_monitor``)."""
        device = self.weight.act_per_tensor_scale.device
        self.clip_counters = {
            "elements": torch.zeros(2, dtype=torch.int64, device=device),  # clipped, seen
            "max_abs": torch.zeros((), dtype=torch.float32, device=device),
        }

    def stop_clip_monitor(self) -> None:
        self.clip_counters = None

    @torch.no_grad()
    def _count_clipped(self, x: torch.Tensor) -> None:
        magnitude = x.detach().abs()
        limit = largest_at_most(self.weight.act_per_tensor_scale.to(torch.float32) * 448 * 6, magnitude.dtype)
        clipped = (magnitude > limit).sum()
        seen = torch.full_like(clipped, magnitude.numel())
        self.clip_counters["elements"].add_(torch.stack([clipped, seen]))
        if magnitude.numel():
            torch.maximum(
                self.clip_counters["max_abs"], magnitude.max().float(), out=self.clip_counters["max_abs"]
            )

    @property
    def act_global_amax(self) -> float:
        return float(self.weight.act_per_tensor_scale) * 448 * 6

    def get_extra_state(self) -> dict:
        state = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **self.recipe}
        return state if self.loaded else {**state, EMPTY_PLACEHOLDER: True}

    def check_loadable(self, state_dict: dict, prefix: str) -> None:
        """Raise for what loading this layer's entries of ``state_dict`` would refuse, or load
        without an error and compute garbage with: another recipe, a weight that is not NVFP4 or
        whose tensors differ in shape or dtype (``copy_refusal``), damaged scales. Loading checks
        this before copying anything into the layer."""
        name = self.layer_name or prefix[:-1]
        if prefix + "_extra_state" in state_dict:
            self.check_saved_state(state_dict[prefix + "_extra_state"])
        weight = state_dict.get(prefix + "weight")
        refusal = None if weight is None else copy_refusal(self.weight, weight)
        if refusal is not None:
            raise ValueError(f"nvfp4_static: checkpoint for layer '{name}': {refusal}")
        check_checkpoint_scales(weight, name)

    def check_saved_state(self, state) -> None:
        """Refuse a saved extra state of another recipe than this layer's."""
        saved = saved_recipe(state, self.layer_name)
        if saved != self.recipe:
            raise ValueError(
                f"nvfp4_static: checkpoint for layer '{self.layer_name}' was made with recipe "
                f"{saved}, but the model was prepared with {self.recipe}; prepare the model with "
                f"the config the checkpoint was converted with"
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.check_loadable(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # The weight fills a placeholder; a load (strict=False) of the extra state alone leaves it empty.
        self.loaded = self.loaded or prefix + "weight" in state_dict

    def set_extra_state(self, state: dict) -> None:
        self.check_saved_state(state)

    def extra_repr(self) -> str:
        recipe = ", ".join(f"{k}={v}" for k, v in self.recipe.items())
        on_meta = self.weight.act_per_tensor_scale.is_meta
        amax = "? (meta)" if on_meta else f"{self.act_global_amax:.4g}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {recipe}, act_global_amax={amax}, "
            f"backend={self.weight.linear_backend}"
            + ("" if self.loaded else ", empty placeholder")
        )
