"""Experts in serving checkpoints: one quantized linear per expert and projection, under the names
the architecture's own checkpoints use.

vLLM's compressed-tensors and ModelOpt MoE loaders read an MoE layer's experts as three linears
each, ``experts.{e}.gate_proj``, ``up_proj`` and ``down_proj`` (Mixtral: ``w1``, ``w3``, ``w2``),
every one with the format's four tensors, and run gate and up as one GEMM with one weight and
one input scale per expert. transformers 5.x also loads some architectures under other module
names than their checkpoints use (Mixtral's ``block_sparse_moe`` is its ``mlp``) and renames
them back when it saves. So an export writes each expert's projections as linears
(``NVFP4StaticExperts.expert_linears``) and renames everything as ``save_pretrained`` would
(transformers' own reverse conversion); an import renames the folder's names the other way and
stacks each expert's linears back into an ``NVFP4StaticExperts``. Experts left float take the
same path: ``save_pretrained``'s split of their fused weights on export (each per-expert linear
listed as unquantized), stacked back into the fused parameters on import.
"""

from collections.abc import Iterable

import torch

from nvfp4_static.experts.converted import NVFP4StaticExperts, NVFP4StaticGroupedLinear
from nvfp4_static.experts.layouts import experts_layout, fused_shapes, why_experts_left_float
from nvfp4_static.linear import NVFP4StaticLinear

__all__ = [
    "converted_expert_linears",
    "saved_module_names",
    "as_saved",
    "as_loaded",
    "expert_linear_stubs",
    "stack_imported_experts",
    "fuse_float_experts",
    "loaded_module_names",
]


def _converted_experts(model: torch.nn.Module) -> dict[str, NVFP4StaticExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4StaticExperts)}


def converted_expert_linears(model: torch.nn.Module) -> dict[str, NVFP4StaticLinear]:
    """Every converted expert projection of ``model`` as a linear, by its model-side name."""
    return {
        f"{name}.{relative}": linear
        for name, experts in _converted_experts(model).items()
        for relative, linear in experts.expert_linears().items()
    }


def _float_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The registered experts modules of ``model`` still float, whose fused weights fit their
    layout (``[E, 2I, H]`` and ``[E, H, I]``)."""
    return {
        name: module
        for name, module in model.named_modules()
        if experts_layout(module) is not None and fused_shapes(module) is not None
    }


def _expert_linear_names(name: str, module: torch.nn.Module) -> list[str]:
    """The per-expert linears of the experts module ``name`` as checkpoints name them
    (``<name>.{e}.gate_proj``), expert by expert, in the layout's gate, up, down order."""
    num_experts = fused_shapes(module)[0]
    return [
        f"{name}.{expert}.{projection}"
        for expert in range(num_experts)
        for projection in experts_layout(module).checkpoint_names
    ]


def saved_module_names(model: torch.nn.Module, unquantized: list[str]) -> list[str]:
    """The names of the float linears ``unquantized``, of the routers beside converted
    experts (``ExpertsLayout.router``, which engines keep in float) and of each float experts
    module's per-expert linears, sorted, as ``as_saved`` names the modules."""
    experts = _converted_experts(model)
    routers = [f"{name.rpartition('.')[0]}.{module.layout.router}".lstrip(".") for name, module in experts.items()]
    float_experts = [
        linear for name, module in _float_experts(model).items() for linear in _expert_linear_names(name, module)
    ]
    names = unquantized + routers + float_experts
    if not experts and not float_experts:
        return sorted(names)
    saved = saved_names(model, [f"{name}.weight" for name in names])
    return sorted(saved[f"{name}.weight"].removesuffix(".weight") for name in names)


def _reverse_conversion(model: torch.nn.Module):
    """transformers' save-time renaming for ``model``, or None for a model it does not rename."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion if isinstance(model, PreTrainedModel) else None


def as_saved(model: torch.nn.Module, tensors: dict, per_tensor_scales: dict) -> tuple[dict, dict]:
    """``tensors`` under the names ``save_pretrained`` writes for ``model`` (float 3-D experts
    split per expert as it splits them), and ``per_tensor_scales``, keyed by tensor name,
    renamed alike. Unchanged for a model without registered experts, whose export keeps the
    model's own names."""
    revert = _reverse_conversion(model)
    if revert is None or not (_converted_experts(model) or _float_experts(model)):
        return tensors, per_tensor_scales
    saved = revert(model, tensors)
    name_of = {id(tensor): name for name, tensor in saved.items()}
    return saved, {name_of[id(tensors[name])]: value for name, value in per_tensor_scales.items()}


def saved_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """``{name: its name in a folder save_pretrained writes}`` for state-dict names that
    transformers renames without converting (not a fused 3-D expert weight)."""
    probes = {name: torch.empty(0) for name in names}
    revert = _reverse_conversion(model)
    if revert is None:
        return {name: name for name in probes}
    name_of = {id(tensor): new for new, tensor in revert(model, probes).items()}
    return {name: name_of[id(probe)] for name, probe in probes.items()}


def expert_linear_stubs(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """For each registered float experts module that NVFP4 can hold, one bias-free
    ``nn.Linear`` per expert and projection, by its model-side name (``<experts>.{e}.gate_proj``):
    the shapes, device and dtype an import checks a folder's per-expert tensors against. Their
    weights are zero-stride views of one element, not copies."""
    stubs = {}
    for name, module in model.named_modules():
        layout = experts_layout(module)
        if layout is None or why_experts_left_float(module) is not None:
            continue
        gate_up, down = layout.weights(module)
        hidden, intermediate = down.shape[1:]
        shapes = dict(zip(layout.checkpoint_names, ((intermediate, hidden),) * 2 + ((hidden, intermediate),)))
        for expert in range(len(gate_up)):
            for projection, (out_features, in_features) in shapes.items():
                with torch.device("meta"):
                    stub = torch.nn.Linear(in_features, out_features, bias=False)
                element = torch.empty((), dtype=gate_up.dtype, device=gate_up.device)
                stub.weight = torch.nn.Parameter(element.expand(out_features, in_features), requires_grad=False)
                stubs[f"{name}.{expert}.{projection}"] = stub
    return stubs


def as_loaded(model: torch.nn.Module, checkpoint: dict, per_tensor_scales: dict, fields) -> tuple[dict, dict]:
    """A folder's tensors (and ``per_tensor_scales``, keyed by tensor name) under ``model``'s
    own names: the inverse of ``as_saved``'s renaming, for the model's other tensors and each
    expert projection's ``fields`` (or float ``weight``). Unchanged for a model without
    registered experts."""
    experts = _float_experts(model)
    if not experts:
        return checkpoint, per_tensor_scales
    names = [key for key in model.state_dict() if key.rpartition(".")[0] not in experts]
    linears = [linear for name, module in experts.items() for linear in _expert_linear_names(name, module)]
    names += [f"{linear}.{field}" for linear in linears for field in {*fields, "weight"}]
    loaded_name = {saved: name for name, saved in saved_names(model, names).items()}
    return (
        {loaded_name.get(key, key): value for key, value in checkpoint.items()},
        {loaded_name.get(key, key): value for key, value in per_tensor_scales.items()},
    )


def loaded_module_names(model: torch.nn.Module, names: Iterable[str]) -> list[str]:
    """A folder's module names (its ignore list) under ``model``'s own names: the names
    ``as_saved`` renames (Mixtral's ``block_sparse_moe`` for ``mlp``), per-expert linears
    included, renamed back; patterns and other names kept as they are."""
    experts = _float_experts(model)
    names = list(names)
    if not experts:
        return names
    modules = [name for name, _ in model.named_modules() if name]
    modules += [linear for name, module in experts.items() for linear in _expert_linear_names(name, module)]
    saved = saved_names(model, [f"{module}.weight" for module in modules])
    loaded = {saved[f"{module}.weight"].removesuffix(".weight"): module for module in modules}
    return [loaded.get(name, name) for name in names]


def stack_imported_experts(model: torch.nn.Module, layers: dict) -> dict[str, NVFP4StaticExperts]:
    """``{experts module name: NVFP4StaticExperts}`` from the imported per-expert linears in
    ``layers`` (named as ``expert_linear_stubs`` names them). An experts module is imported
    whole or not at all; an expert whose gate and up carry different scales is refused (they
    run as one GEMM with one scale, here as in vLLM)."""
    stubs = expert_linear_stubs(model)
    imported = {}
    for name in sorted({stub.rsplit(".", 2)[0] for stub in stubs}):
        members = [stub for stub in stubs if stub.rsplit(".", 2)[0] == name]
        found = [member for member in members if member in layers]
        if not found:
            continue
        if len(found) != len(members):
            missing = next(member for member in members if member not in layers)
            raise ValueError(
                f"nvfp4_static: experts '{name}' are partly quantized in the checkpoint ('{missing}' "
                f"is not); nvfp4_static runs an MoE layer's experts all in NVFP4 or all in float"
            )
        module = model.get_submodule(name)
        layout = experts_layout(module)
        gate, up, down = layout.checkpoint_names
        num_experts = len(layout.weights(module)[0])
        gate_up_rows = []
        for expert in range(num_experts):
            pair = [layers[f"{name}.{expert}.{projection}"].weight for projection in (gate, up)]
            for field in ("per_tensor_scale", "act_per_tensor_scale"):
                if not torch.equal(getattr(pair[0], field), getattr(pair[1], field)):
                    raise ValueError(
                        f"nvfp4_static: experts '{name}': expert {expert}'s {gate} and {up} have "
                        f"different {'weight' if field == 'per_tensor_scale' else 'input'} global "
                        f"scales ({float(getattr(pair[0], field)):.6g} and "
                        f"{float(getattr(pair[1], field)):.6g}); they run as one GEMM with one scale"
                    )
            gate_up_rows.append(pair)
        gate_up = NVFP4StaticGroupedLinear(
            torch.stack([torch.cat([w.qdata for w in pair]) for pair in gate_up_rows]),
            torch.stack([torch.cat([w.scale for w in pair]) for pair in gate_up_rows]),
            torch.stack([pair[0].per_tensor_scale for pair in gate_up_rows]),
            torch.stack([pair[0].act_per_tensor_scale for pair in gate_up_rows]),
        )
        imported[name] = NVFP4StaticExperts(
            gate_up,
            NVFP4StaticGroupedLinear.from_linears([layers[f"{name}.{e}.{down}"] for e in range(num_experts)]),
            getattr(module, layout.act_fn),
            layout,
            layout.weights(module)[0].dtype,
            layers[found[0]].recipe,
            name,
            backend_override=layers[found[0]].weight.backend_override,
        )
    return imported


def fuse_float_experts(model: torch.nn.Module, checkpoint: dict, imported: Iterable[str]) -> dict:
    """``checkpoint`` (under the model's names, as ``as_loaded`` gives it) with each float
    experts module's per-expert weights (``<experts>.{e}.gate_proj.weight``, as
    ``save_pretrained`` splits them) stacked into the module's fused parameters, which
    ``load_state_dict`` then loads: expert ``e``'s gate then up rows are ``gate_up[e]``, its
    down weight ``down[e]``. Experts modules in ``imported`` (stacked from quantized linears)
    and a folder holding the fused names themselves are left alone; an experts module whose
    per-expert weights are in the folder only partly is refused naming the first missing."""
    fused = dict(checkpoint)
    for name, module in _float_experts(model).items():
        if name in imported:
            continue
        weights = [f"{linear}.weight" for linear in _expert_linear_names(name, module)]
        missing = [weight for weight in weights if weight not in checkpoint]
        if len(missing) == len(weights):
            continue
        if missing:
            raise ValueError(
                f"nvfp4_static: experts '{name}' are in the checkpoint only partly as float "
                f"per-expert weights: '{missing[0]}' is missing ({len(weights) - len(missing)} "
                f"of {len(weights)} found)"
            )
        layout = experts_layout(module)
        per_expert = [[checkpoint[weight] for weight in weights[i : i + 3]] for i in range(0, len(weights), 3)]
        for weight in weights:
            del fused[weight]
        fused[f"{name}.{layout.gate_up}"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in per_expert])
        fused[f"{name}.{layout.down}"] = torch.stack([down for _, _, down in per_expert])
    return fused
