"""Which modules hold a mixture-of-experts layer's experts, and where their weights are.

Hugging Face transformers 5.x keeps all experts of an MoE layer in one module with fused 3-D
parameters rather than one ``nn.Linear`` per expert: ``gate_up_proj [E, 2I, H]`` (each expert's
gate rows, then its up rows) and ``down_proj [E, H, I]``. ``quantize_`` with
``filter_fn=is_quantizable`` selects the classes registered here; the quantized experts take over
their ``forward``, so a class may be registered only if its forward is transformers' eager one::

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]

Token ``t`` goes to expert ``top_k_index[t, j]`` (an index equal to ``E`` sends it nowhere) with
weight ``top_k_weights[t, j]``; expert ``e`` computes ``down[e] @ (act_fn(gate) * up)`` with
``gate, up = (gate_up[e] @ x).chunk(2)``, no biases; each token's outputs are summed in
ascending expert order. Register another architecture's module that keeps this contract::

    nvfp4_static.register_experts(MyExperts, ExpertsLayout(gate_up="w13", down="w2"))

Classes are matched exactly (a subclass may change the forward), by qualified name, so that
registering costs no import of the model's code.
"""

import dataclasses
from typing import Optional, Union

import torch

from nvfp4_static.numerics import BLOCK_SIZE

__all__ = ["ExpertsLayout", "register_experts", "experts_layout", "fused_shapes", "why_experts_left_float"]


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """Attribute names of an experts module's parts.

    Args:
        gate_up: the ``[E, 2I, H]`` parameter, gate rows first.
        down: the ``[E, H, I]`` parameter.
        act_fn: the activation applied to the gate (a module or function).
        checkpoint_names: the names of an expert's gate, up and down linears in the
            architecture's checkpoints (``experts.{e}.<name>``), which serving engines load.
        router: the experts module's sibling that routes the tokens; engines keep it in float,
            and an export lists it as unquantized.
    """

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    act_fn: str = "act_fn"
    checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"

    def __post_init__(self):
        names = {"gate_up": self.gate_up, "down": self.down, "act_fn": self.act_fn, "router": self.router}
        for field, value in names.items():
            if not isinstance(value, str) or not value:
                raise TypeError(f"nvfp4_static: ExpertsLayout.{field} is an attribute name, got {value!r}")
        if len(set(names.values())) < len(names):
            raise ValueError(
                f"nvfp4_static: ExpertsLayout names four different attributes (gate_up, down, act_fn, router), "
                f"got {names}"
            )
        names = self.checkpoint_names
        if not (
            isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str) and n for n in names)
            and len(set(names)) == 3
        ):
            raise ValueError(
                f"nvfp4_static: ExpertsLayout.checkpoint_names are three different names (an expert's gate, "
                f"up and down linears in checkpoints), got {names!r}"
            )

    def weights(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up, down)`` of ``module``."""
        return getattr(module, self.gate_up), getattr(module, self.down)


_LAYOUTS: dict[str, ExpertsLayout] = {
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts": ExpertsLayout(),
    "transformers.models.mixtral.modeling_mixtral.MixtralExperts": ExpertsLayout(checkpoint_names=("w1", "w3", "w2")),
}


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# nn.Linear and this package's linears by qualified name: a name is checked without importing it.
_LINEAR_NAMES = (
    "torch.nn.modules.linear.Linear",
    "nvfp4_static.observed.NVFP4StaticObservedLinear",
    "nvfp4_static.linear.NVFP4StaticLinear",
)


def register_experts(experts_class: Union[type, str], layout: ExpertsLayout = ExpertsLayout()) -> None:
    """Let ``is_quantizable`` select ``experts_class`` (a class, or its ``module.QualName``)
    and quantize its experts as ``layout`` describes; see this module's docstring for the
    forward the class must have."""
    if not isinstance(layout, ExpertsLayout):
        raise TypeError(f"nvfp4_static: register_experts takes an ExpertsLayout, got {type(layout).__name__}")
    if not (isinstance(experts_class, type) and issubclass(experts_class, torch.nn.Module)) and not (
        isinstance(experts_class, str) and "." in experts_class
    ):
        raise TypeError(
            f"nvfp4_static: register_experts takes an nn.Module class or its qualified name "
            f"('package.module.ClassName'), got {experts_class!r}"
        )
    if isinstance(experts_class, str):
        linear = experts_class in _LINEAR_NAMES
    else:
        linear = issubclass(experts_class, torch.nn.Linear)
    if linear:
        raise ValueError(
            f"nvfp4_static: {experts_class!r} is a linear (nn.Linear or a subclass, such as the layers prepare and "
            f"convert make), quantized as a linear; register an experts module class"
        )
    name = experts_class if isinstance(experts_class, str) else _qualified_name(experts_class)
    _LAYOUTS[name] = layout


def experts_layout(module: torch.nn.Module) -> Optional[ExpertsLayout]:
    """The layout registered for ``module``'s exact class, or None."""
    return _LAYOUTS.get(_qualified_name(type(module)))


def fused_shapes(module: torch.nn.Module) -> Optional[tuple[int, int, int]]:
    """``(experts, hidden, intermediate)`` of the registered experts ``module``, or None where
    its weights are missing or do not fit its layout (``[E, 2I, H]`` and ``[E, H, I]``)."""
    layout = experts_layout(module)
    gate_up, down = (getattr(module, name, None) for name in (layout.gate_up, layout.down))
    if not all(isinstance(part, torch.Tensor) and part.dim() == 3 for part in (gate_up, down)):
        return None
    num_experts, double_intermediate, hidden = gate_up.shape
    if double_intermediate % 2 or tuple(down.shape) != (num_experts, hidden, double_intermediate // 2):
        return None
    return num_experts, hidden, double_intermediate // 2


def why_experts_left_float(module: torch.nn.Module) -> Optional[str]:
    """Why prepare leaves the registered experts ``module`` float (None: it quantizes them):
    weights missing or of shapes that do not fit the layout, or dims NVFP4 cannot block."""
    shapes = fused_shapes(module)
    if shapes is None:
        layout = experts_layout(module)
        found = [
            tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
            for part in (getattr(module, name, None) for name in (layout.gate_up, layout.down))
        ]
        return (
            f"its {layout.gate_up} {found[0]} and {layout.down} {found[1]} are not [E, 2I, H] "
            f"and [E, H, I] (3-D tensors, as its registered ExpertsLayout says)"
        )
    _, hidden, intermediate = shapes
    if hidden % BLOCK_SIZE or intermediate % BLOCK_SIZE:
        return (
            f"NVFP4 needs the hidden size and the expert intermediate size divisible by "
            f"{BLOCK_SIZE}, and they are {hidden} and {intermediate}"
        )
    return None
