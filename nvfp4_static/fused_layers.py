"""Fusion groups: linears a serving engine runs as one GEMM, which must share their scales.

vLLM, SGLang and TensorRT-LLM concatenate q/k/v projections into one GEMM, and gate/up (MoE:
w1/w3) into another. One GEMM has one weight per-tensor scale and one input scale, so the layers
of a group must be converted with the same two global amaxes:

- **weights**: the group's largest ``max |w|``, fixed *before* the FP8 block-scale sweep: the
  sweep's candidates are block amaxes relative to the global amax, so block scales chosen under a
  layer's own amax are wrong under the shared one (vLLM takes the max of mismatched scales
  without re-deriving the block scales; TensorRT-LLM refuses them);
- **activations**: the group's layers read the same input, so their calibrators hold the same
  statistics; they are merged into one calibrator that every member then reads.

``quantize_`` hands its handler one module at a time, so no handler can see a layer's siblings.
``tie_fused_layers(model)`` is therefore a model-level pass run between calibration and
``step="convert"``: it records the group's weight global amax on each observed layer and gives
them one shared activation calibrator; convert reads both. Export refuses a converted model whose
groups are not tied (``nvfp4_static.export``), so a forgotten call is caught before serving.
"""

import copy
from collections.abc import Iterable, Sequence

import torch

from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers import MergeableObserver

__all__ = [
    "STANDARD_FUSION_GROUPS",
    "find_fusion_groups",
    "tie_fused_layers",
]

# Sibling names that engines fuse, as Hugging Face models name them: attention q/k/v, the gated
# MLP's gate/up, Mixtral-style experts' w1/w3, and DeepSeek's MLA down-projections, which vLLM
# fuses into one GEMM because both read the layer's hidden states.
STANDARD_FUSION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


def find_fusion_groups(
    model: torch.nn.Module, groups: Sequence[Sequence[str]] = STANDARD_FUSION_GROUPS
) -> list[tuple[str, ...]]:
    """The fully qualified names of each fusion group present in ``model``.

    A group is two or more linear children of one parent whose names appear together in one
    entry of ``groups`` (sibling names such as ``("q_proj", "k_proj", "v_proj")``). Every
    ``nn.Linear`` counts, whether float, observed or converted.
    """
    groups = _checked_groups(groups)
    found = []
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        for sibling_names in groups:
            members = [
                name for name in sibling_names if isinstance(children.get(name), torch.nn.Linear)
            ]
            if len(members) >= 2:
                prefix = f"{parent_name}." if parent_name else ""
                found.append(tuple(prefix + name for name in members))
    _check_no_layer_in_two_groups(found)
    return found


def tie_fused_layers(
    model: torch.nn.Module, groups: Sequence[Sequence[str]] = STANDARD_FUSION_GROUPS
) -> list[tuple[str, ...]]:
    """Make each fusion group of a calibrated model share its global amaxes at convert.

    Call it after calibration and before ``quantize_(..., step="convert")``. For every group of
    ``groups`` found in ``model`` (see ``find_fusion_groups``) whose prepared layers number two
    or more, it

    - records on each prepared member the group's weight global amax, the largest ``max |w|``
      (convert runs the block-scale sweep against it and stores it as the per-tensor scale);
    - replaces the members' activation calibrators by one: their merge when they are
      mergeable (histogram and max calibrators: the members saw the same inputs, so the merge
      reads as each of them), else the member calibrator with the largest global amax, so that
      no member clips more than it did alone.

    Members left unprepared (e.g. excluded by the ``filter_fn``) stay as they are; export then
    refuses the group, since an engine cannot fuse a quantized layer with a float one. Calling
    it again is harmless. Pass ``groups=[...]`` for other sibling names (``[]`` ties nothing).

    Returns:
        The tied groups, as fully qualified layer names.

    Raises:
        ValueError: a member is already converted (tying must precede convert: the block
            scales depend on the weight global amax).
        RuntimeError: a member's calibrator has no data to compare (non-mergeable calibrators).
    """
    plans = []
    for names in find_fusion_groups(model, groups):
        members = {name: model.get_submodule(name) for name in names}
        converted = [name for name, m in members.items() if isinstance(m, NVFP4StaticLinear)]
        if converted:
            raise ValueError(
                f"nvfp4_static: cannot tie fusion group {list(names)}: {converted} already "
                f"converted. Call tie_fused_layers(model) after calibration and before "
                f"quantize_(..., step='convert'); the FP8 block scales are chosen relative to "
                f"the shared weight global amax"
            )
        widths = {n: m.in_features for n, m in members.items() if isinstance(m, torch.nn.Linear)}
        if len(set(widths.values())) > 1:
            raise ValueError(
                f"nvfp4_static: cannot tie fusion group {list(names)}: its linears read inputs of "
                f"different widths {widths}, so they are not siblings reading one input (engines fuse "
                f"linears that share their input)"
            )
        observed = {n: m for n, m in members.items() if isinstance(m, NVFP4StaticObservedLinear)}
        if len(observed) >= 2:
            plans.append((names, observed))
    # Decide everything before changing anything, so that a refusal leaves the model as it was.
    ties = [
        (names, observed, _group_weight_global_amax(observed), _group_act_calibrator(observed))
        for names, observed in plans
    ]
    for names, observed, weight_global_amax, act_calibrator in ties:
        for module in observed.values():
            module.tied_weight_global_amax = weight_global_amax
            module.act_calibrator = act_calibrator
    return [tuple(observed) for _, observed, _, _ in ties]


def _checked_groups(groups) -> tuple[tuple[str, ...], ...]:
    """``groups`` as tuples (an iterator is read once, here), refused where a group is not a
    tuple of distinct sibling names."""
    if isinstance(groups, str) or not isinstance(groups, Iterable):
        raise TypeError(
            f"nvfp4_static: fusion groups must be a sequence of sibling-name tuples such as "
            f"[('q_proj', 'k_proj', 'v_proj')], got {groups!r}"
        )
    checked = []
    for given in groups:
        group = None if isinstance(given, str) or not isinstance(given, Iterable) else tuple(given)
        if group is None or not all(isinstance(name, str) for name in group):
            raise TypeError(
                f"nvfp4_static: each fusion group must be a tuple of child names such as "
                f"('gate_proj', 'up_proj'), got {given!r}"
            )
        if any("." in name for name in group):
            raise ValueError(
                f"nvfp4_static: fusion group {group!r} names a nested module; a group lists "
                f"sibling names (children of one parent), which are matched under every parent"
            )
        if len(set(group)) < len(group):
            raise ValueError(f"nvfp4_static: fusion group {group!r} names a linear twice")
        checked.append(group)
    return tuple(checked)


def _check_no_layer_in_two_groups(found: list[tuple[str, ...]]) -> None:
    """One linear cannot share two groups' global amaxes, nor run in two fused GEMMs."""
    seen = {}
    for group in found:
        for name in group:
            if name in seen:
                raise ValueError(
                    f"nvfp4_static: linear '{name}' is in two fusion groups, {list(seen[name])} and "
                    f"{list(group)}; each linear fuses with one group of siblings"
                )
            seen[name] = group


def _group_weight_global_amax(observed: dict) -> torch.Tensor:
    amaxes = [m.weight.detach().abs().amax().to(torch.float32) for m in observed.values()]
    device = amaxes[0].device
    return torch.stack([amax.to(device) for amax in amaxes]).amax()


def _group_act_calibrator(observed: dict):
    """One calibrator for the whole group (see ``tie_fused_layers``); the members' own
    calibrators are not modified."""
    calibrators = list({id(m.act_calibrator): m.act_calibrator for m in observed.values()}.values())
    if len(calibrators) == 1:
        return calibrators[0]
    if all(isinstance(c, MergeableObserver) for c in calibrators):
        try:
            merged = copy.deepcopy(calibrators[0])
            for other in calibrators[1:]:
                merged.merge(other)
        except ValueError as error:
            raise ValueError(
                f"nvfp4_static: cannot merge the activation calibrators of fusion group "
                f"{list(observed)}: {error}"
            ) from error
        merged.name = _group_label(list(observed))
        return merged
    amaxes = []
    for name, module in observed.items():
        try:
            amaxes.append(float(module.act_calibrator.compute_amax()))
        except RuntimeError as error:
            raise RuntimeError(
                f"nvfp4_static: cannot tie fusion group {list(observed)}: layer '{name}': {error}"
            ) from error
    return list(observed.values())[amaxes.index(max(amaxes))].act_calibrator


def _group_label(names: list) -> str:
    """``model.layers.0.self_attn.{q_proj,k_proj,v_proj}``: how messages name a group."""
    parent = names[0].rpartition(".")[0]
    children = ",".join(name.rpartition(".")[2] for name in names)
    return f"{parent}.{{{children}}}" if parent else f"{{{children}}}"
