"""Writing a converted model as a folder that serving engines load.

Two formats carry exactly what convert produces (packed E2M1 weights, FP8 block scales, a weight
per-tensor scale and a static activation per-tensor scale) and differ only in names and in how
they store the two per-tensor scales (docs/design.md, "Checkpoints"):

- ``"compressed-tensors"`` (``nvfp4-pack-quantized``; vLLM, SGLang, transformers): per layer
  ``weight_packed``, ``weight_scale``, and the *reciprocal* scales ``weight_global_scale`` and
  ``input_global_scale`` (``1 / per_tensor_scale``, float32 ``[1]``), plus a
  ``quantization_config`` block in ``config.json``.
- ``"modelopt"`` (NVIDIA ModelOpt's Hugging Face export; vLLM, SGLang, TensorRT-LLM): per layer
  ``weight`` (packed), ``weight_scale``, ``weight_scale_2`` and ``input_scale`` (our per-tensor
  scales as they are, float32 scalars), plus ``hf_quant_config.json`` and a ``config.json`` block.

The experts of a mixture-of-experts layer are written as one such layer per expert and
projection, under the names the architecture's checkpoints use (``nvfp4_static.experts.serving``).
Everything else in the state dict is written as it is (unquantized tensors in their own dtype),
in safetensors shards with an index. Everything is checked before anything is written, and the
files are assembled in a temporary folder beside the target and moved in at the end, so a
refused or failed export leaves the target as it was.
"""

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence
from typing import Union

import torch
from safetensors.torch import save_file

from nvfp4_static.arguments import check_flags, uncompiled
from nvfp4_static.checkpoint import later_names
from nvfp4_static.experts import NVFP4StaticExperts, NVFP4StaticObservedExperts
from nvfp4_static.experts.serving import as_saved, converted_expert_linears, saved_module_names
from nvfp4_static.fused_layers import STANDARD_FUSION_GROUPS, find_fusion_groups
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.numerics import BLOCK_SIZE, E2M1_MAX, E4M3_MAX
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["FORMATS", "PER_TENSOR_SCALES_METADATA", "export_checkpoint"]

FORMATS = ("compressed-tensors", "modelopt")

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MODELOPT_QUANT_CONFIG_FILE = "hf_quant_config.json"
# safetensors header entry holding the exact per-tensor scales behind compressed-tensors' global
# scales (see _exact_per_tensor_scales).
PER_TENSOR_SCALES_METADATA = "nvfp4_static.per_tensor_scales"
# What a model folder holds besides its config and weights, copied from the folder the model was
# loaded from so that the export is a complete model (tokenizer, generation defaults).
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
# Files a loader reads as weights or quantization settings: an export that leaves a stale one
# of these beside its own would load wrongly, so their presence is refused (see _check_target).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def export_checkpoint(
    model: torch.nn.Module,
    directory: Union[str, os.PathLike],
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
    fusion_groups: Sequence[Sequence[str]] = STANDARD_FUSION_GROUPS,
    max_shard_bytes: int = 5 * 2**30,
) -> pathlib.Path:
    """Write a converted model to ``directory`` in a serving engine's NVFP4 format.

    Args:
        model: a model whose linears ``quantize_(..., step="convert")`` turned into
            ``NVFP4StaticLinear`` (a Hugging Face model, or any ``nn.Module``). Linears left in
            float are written unquantized and listed as such (``ignore`` /
            ``exclude_modules``). For a Hugging Face model the config is written from
            ``model.config``, and the tokenizer and generation files are copied from the folder
            it was loaded from (``model.name_or_path``) when that folder exists.
        directory: the folder to write; created if missing.
        format: ``"compressed-tensors"`` or ``"modelopt"``.
        overwrite: allow writing into a non-empty folder. Only the files this export writes are
            replaced; nothing else is deleted. Weight files it would not replace are refused
            (a loader would read them too).
        fusion_groups: sibling-name groups engines run as one GEMM (see
            ``nvfp4_static.tie_fused_layers``); every such group must be all converted with
            equal weight and activation scales, or the export is refused. ``()`` skips the
            check (vLLM then runs each fused GEMM with the largest member scale, without
            re-deriving the block scales).
        max_shard_bytes: the largest safetensors shard (a bigger tensor gets a shard alone).

    Returns:
        The folder written.

    Raises:
        ValueError: unknown format, a model with no converted layer or still holding
            observers, a layer or tensor the format cannot carry, an untied fusion group.
        FileExistsError: ``directory`` is not empty and ``overwrite`` is False, or holds
            weight files this export would not replace.
    """
    if format not in FORMATS:
        raise ValueError(
            f"nvfp4_static: unknown export format {format!r}; choose one of {', '.join(FORMATS)}"
        )
    check_flags("export_checkpoint", overwrite=overwrite)
    model = uncompiled(model)
    converted = _converted_layers(model)
    if fusion_groups:
        _check_fusion_groups_tied(model, fusion_groups)
    tensors = _tensors_to_write(model, converted, format)
    exact_scales = _exact_per_tensor_scales(converted) if format == "compressed-tensors" else {}
    tensors, exact_scales = as_saved(model, tensors, exact_scales)
    shards = _shards(tensors, max_shard_bytes)
    quantization_config = _quantization_config(model, converted, format)
    config = _model_config(model, converted)
    config["quantization_config"] = quantization_config
    json_files = {CONFIG_FILE: config, INDEX_FILE: _index(tensors, shards)}
    if format == "modelopt":
        json_files[MODELOPT_QUANT_CONFIG_FILE] = _modelopt_hf_quant_config(quantization_config)
    companions = _companion_files(model)
    target = pathlib.Path(directory)
    _check_target(target, set(shards) | set(json_files) | {path.name for path in companions}, overwrite)
    _write(target, tensors, shards, exact_scales, json_files, companions)
    return target


# --- what is written ------------------------------------------------------------------------------


def _converted_layers(model: torch.nn.Module) -> dict:
    """``{name: NVFP4StaticLinear}``, each expert projection of converted experts one of them,
    refusing models a format cannot describe."""
    observed = [
        n for n, m in model.named_modules()
        if isinstance(m, (NVFP4StaticObservedLinear, NVFP4StaticObservedExperts))
    ]
    observed = [n for n in observed if not any(n.startswith(f"{o}.") for o in observed)]  # experts: once
    if observed:
        raise ValueError(
            f"nvfp4_static: cannot export: {len(observed)} layer(s) are prepared but not "
            f"converted (first: '{observed[0]}'); run quantize_(model, "
            f"NVFP4StaticActivationConfig(step='convert'), filter_fn=...) first"
        )
    empty = [
        n for n, m in model.named_modules() if isinstance(m, (NVFP4StaticLinear, NVFP4StaticExperts)) and not m.loaded
    ]
    if empty:
        raise ValueError(
            f"nvfp4_static: cannot export: {len(empty)} layer(s) are empty placeholders of "
            f"step='prepare_for_loading' (first: '{empty[0]}'), whose weights are zeros; load a "
            f"checkpoint into the model first"
        )
    converted = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)}
    converted.update(converted_expert_linears(model))
    if not converted:
        raise ValueError(
            "nvfp4_static: cannot export: the model has no NVFP4StaticLinear layer; prepare, "
            "calibrate and convert it with NVFP4StaticActivationConfig first"
        )
    for name, module in converted.items():
        weight = module.weight
        if type(weight) is not NVFP4StaticTensor or weight.block_size != BLOCK_SIZE:
            raise ValueError(
                f"nvfp4_static: layer '{name}' holds a {type(weight).__name__} with block size "
                f"{getattr(weight, 'block_size', None)}; only NVFP4StaticTensor weights with "
                f"{BLOCK_SIZE}-element blocks can be exported"
            )
        if weight.is_swizzled_scales:
            raise ValueError(
                f"nvfp4_static: layer '{name}': its FP8 block scales are stored swizzled (the "
                f"Blackwell tile layout); both formats store them row-major [out, in/16]"
            )
    return converted


def _check_fusion_groups_tied(model: torch.nn.Module, groups) -> None:
    """Refuse fusion groups an engine cannot run as one GEMM with one set of scales."""
    for names in find_fusion_groups(model, groups):
        members = {name: model.get_submodule(name) for name in names}
        converted = [n for n, m in members.items() if isinstance(m, NVFP4StaticLinear)]
        if not converted:
            continue
        if len(converted) != len(members):
            floats = [n for n in members if n not in converted]
            raise ValueError(
                f"nvfp4_static: fusion group {list(names)} is partly quantized ({floats} left in "
                f"float); engines run the group as one GEMM, so quantize all of it or none (or "
                f"pass fusion_groups=() to export anyway)"
            )
        for field in ("per_tensor_scale", "act_per_tensor_scale"):
            values = [getattr(m.weight, field) for m in members.values()]
            if not all(torch.equal(v, values[0]) for v in values[1:]):
                amaxes = ", ".join(
                    f"'{n}': {float(v) * E4M3_MAX * E2M1_MAX:.6g}" for n, v in zip(names, values)
                )
                what = "weight" if field == "per_tensor_scale" else "activation"
                raise ValueError(
                    f"nvfp4_static: fusion group {list(names)} is not tied: {what} global amaxes "
                    f"{amaxes}. Engines run the group as one GEMM with one scale; call "
                    f"nvfp4_static.tie_fused_layers(model) between calibration and convert (or "
                    f"pass fusion_groups=() to export untied scales)"
                )


def _tensors_to_write(model: torch.nn.Module, converted: dict, format: str) -> dict:
    """Every tensor of the file set, by name, in state-dict order: each converted layer's weight
    becomes the format's tensors; later names for an already-listed tensor (tied embeddings)
    are left out, as ``save_pretrained`` does."""
    tensors, seen = {}, set()
    experts = {n: False for n, m in model.named_modules() if isinstance(m, NVFP4StaticExperts)}
    # A module's later names (a module held under several): its tensors are written once.
    later = [name for names in later_names(model).values() for name in names]
    for key, value in model.state_dict().items():
        layer, _, leaf = key.rpartition(".")
        if any(layer == name or layer.startswith(f"{name}.") for name in later):
            continue
        owner = next((name for name in experts if key.startswith(f"{name}.")), None)
        if owner is not None:  # the experts' stacked tensors: their per-expert linears instead
            if not experts[owner]:
                experts[owner] = True
                for name in [n for n in converted if n.startswith(f"{owner}.")]:
                    tensors.update(_layer_tensors(name, converted[name].weight, format))
            continue
        if layer in converted and leaf == "_extra_state":
            continue
        if layer in converted and leaf == "weight":
            tensors.update(_layer_tensors(layer, converted[layer].weight, format))
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"nvfp4_static: state entry '{key}' is a {type(value).__name__}, not a tensor; "
                f"safetensors checkpoints hold tensors only"
            )
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(
                f"nvfp4_static: '{key}' is a {type(value).__name__} (a quantized tensor of "
                f"another scheme); only NVFP4StaticLinear layers and float tensors can be exported"
            )
        identity = (value.device, value.data_ptr(), value.dtype, value.shape, value.stride())
        if value.numel() and identity in seen:
            continue
        seen.add(identity)
        tensors[key] = value.detach()
    return tensors


def _layer_tensors(name: str, weight: NVFP4StaticTensor, format: str) -> dict:
    weight_scale, act_scale = weight.per_tensor_scale, weight.act_per_tensor_scale
    if format == "modelopt":
        return {
            f"{name}.weight": weight.qdata,
            f"{name}.weight_scale": weight.scale,
            f"{name}.weight_scale_2": weight_scale.to(torch.float32).reshape(()),
            f"{name}.input_scale": act_scale.to(torch.float32).reshape(()),
        }
    return {
        f"{name}.weight_packed": weight.qdata,
        f"{name}.weight_scale": weight.scale,
        f"{name}.weight_global_scale": _reciprocal(name, "weight", weight_scale),
        f"{name}.input_global_scale": _reciprocal(name, "activation", act_scale),
    }


def _reciprocal(name: str, what: str, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale, ``1 / per_tensor_scale`` in float32, shape ``[1]``: the
    value torchao's quantize multiplies by, so importing it back reproduces our codes."""
    reciprocal = (1.0 / per_tensor_scale.to(torch.float32)).reshape(1)
    if not bool(torch.isfinite(reciprocal).all()) or not bool((reciprocal > 0).all()):
        raise ValueError(
            f"nvfp4_static: layer '{name}': {what} per-tensor scale {float(per_tensor_scale)!r} "
            f"has no finite positive reciprocal, which compressed-tensors stores as the global "
            f"scale (an all-zero weight?); export with format='modelopt' or leave the layer in float"
        )
    return reciprocal


def _exact_per_tensor_scales(converted: dict) -> dict:
    """``{global-scale tensor name: our per-tensor scale as float.hex}``.

    A float32 global scale ``G = fl(1 / p)`` does not always give ``p`` back: about one float32
    scale in six shares its rounded reciprocal with a neighbour. Export records the exact
    ``p`` in the safetensors header (``PER_TENSOR_SCALES_METADATA``), which engines do not
    read; ``import_checkpoint`` uses it where it is consistent with ``G`` (``fl(1 / p) == G``),
    so our own exports round-trip bit for bit while every other reader gets ``G`` alone.
    """
    scales = {}
    for name, module in converted.items():
        for field, tensor in (
            ("weight_global_scale", module.weight.per_tensor_scale),
            ("input_global_scale", module.weight.act_per_tensor_scale),
        ):
            scales[f"{name}.{field}"] = float(tensor.to(torch.float32)).hex()
    return scales


def _nvfp4_args(dynamic) -> dict:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": BLOCK_SIZE,
        "strategy": "tensor_group",
        "dynamic": dynamic,
        "scale_dtype": "torch.float8_e4m3fn",
    }


def has_class_named(module: torch.nn.Module, name: str) -> bool:
    """compressed-tensors' rule for a class target: a class of that name in the module's class
    hierarchy."""
    return any(cls.__name__ == name for cls in type(module).__mro__)


def _quantization_config(model: torch.nn.Module, converted: dict, format: str) -> dict:
    """The ``config.json`` block, naming every linear left in float, and the routers of
    converted experts, as not quantized. A linear is what compressed-tensors' ``"Linear"``
    target matches: a module with a class named ``Linear`` in its class hierarchy (an
    ``nn.Linear``, or a model's own ``Linear`` class)."""
    unquantized = saved_module_names(
        model,
        [
            name
            for name, module in model.named_modules()
            if has_class_named(module, "Linear") and name not in converted
        ],
    )
    if format == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": BLOCK_SIZE,
            "kv_cache_quant_algo": None,
            "ignore": unquantized,
            "producer": {"name": "nvfp4_static", "version": _package_version()},
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _nvfp4_args(dynamic=False),
                # "local": block scales computed per call, the global scale fixed: exactly
                # this package's static-activation scheme.
                "input_activations": _nvfp4_args(dynamic="local"),
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": unquantized,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def _modelopt_hf_quant_config(quantization_config: dict) -> dict:
    """``hf_quant_config.json``, the file engines detect ModelOpt checkpoints by."""
    return {
        "producer": quantization_config["producer"],
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": quantization_config["ignore"],
        },
    }


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvfp4_static")
    except PackageNotFoundError:
        return "unknown"


def _model_config(model: torch.nn.Module, converted: dict) -> dict:
    """The Hugging Face config as ``save_pretrained`` writes it (architecture, dtype), without
    any earlier quantization block; ``{}`` for a model without one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    data = json.loads(config.to_json_string(use_diff=True))
    data.pop("quantization_config", None)
    data["architectures"] = [type(model).__name__]
    data["dtype"] = str(_model_dtype(model, converted)).removeprefix("torch.")
    return data


def _model_dtype(model: torch.nn.Module, converted: dict) -> torch.dtype:
    """The dtype the model computes in: the converted layers' original dtype (their activations'
    dtype), which every converted layer shares in a model converted as a whole."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(iter(converted.values())).weight.orig_dtype


def _companion_files(model: torch.nn.Module) -> list:
    """Tokenizer and generation files of the folder the model was loaded from, plus the code
    files its config names for ``trust_remote_code``."""
    config = getattr(model, "config", None)
    source = getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "")
    if not source or not os.path.isdir(source):
        return []
    names = list(COMPANION_FILES)
    for reference in (getattr(config, "auto_map", None) or {}).values():
        for entry in [reference] if isinstance(reference, str) else reference or []:
            if entry and "--" not in entry:  # "repo--module.Class" lives in another repository
                names.append(entry.rpartition(".")[0] + ".py")
    folder = pathlib.Path(source)
    return [folder / name for name in dict.fromkeys(names) if (folder / name).is_file()]


# --- sharding and writing -------------------------------------------------------------------------


def _shards(tensors: dict, max_shard_bytes: int) -> dict:
    """``{file name: [tensor names]}``, filled in order up to ``max_shard_bytes`` each."""
    if max_shard_bytes <= 0:
        raise ValueError(f"nvfp4_static: max_shard_bytes must be positive, got {max_shard_bytes}")
    groups, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    count = len(groups)
    return {
        f"model-{i + 1:05d}-of-{count:05d}.safetensors": names for i, names in enumerate(groups)
    }


def _index(tensors: dict, shards: dict) -> dict:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {name: file for file, names in shards.items() for name in names}
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def _check_target(target: pathlib.Path, written: set, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"nvfp4_static: export target {target} exists and is not a folder")
    existing = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if existing and not overwrite:
        raise FileExistsError(
            f"nvfp4_static: export folder {target} is not empty ({len(existing)} entries, e.g. "
            f"{existing[0]!r}); pass overwrite=True to replace the files an export writes "
            f"(other files are kept), or choose an empty folder"
        )
    stale = [
        name
        for name in existing
        if name not in written
        and (
            name.endswith(_WEIGHT_SUFFIXES)
            or name.endswith(".index.json")
            or name == MODELOPT_QUANT_CONFIG_FILE
        )
    ]
    if stale:
        raise FileExistsError(
            f"nvfp4_static: export folder {target} holds weight or quantization files this export "
            f"would not replace: {stale}; a loader would read them with the export. Remove them "
            f"or choose another folder (nothing was written)"
        )


def _apart(shard: dict) -> dict:
    """``shard`` with every tensor in memory of its own: safetensors refuses tensors that share
    storage, as the global scales of a fused group's members do (``fuse_sibling_linears``)."""
    seen = set()
    apart = {}
    for name, tensor in shard.items():
        storage = tensor.untyped_storage().data_ptr()
        apart[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return apart


def _give_default_permissions(folder: pathlib.Path) -> None:
    """The folder and its files readable as ``mkdir`` and ``open`` would have made them (the
    umask's): ``mkdtemp`` makes the folder owner-only and safetensors its files, which a server
    running as another user could not read."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _write(
    target: pathlib.Path,
    tensors: dict,
    shards: dict,
    exact_scales: dict,
    json_files: dict,
    companions,
) -> None:
    """Assemble the files in a temporary folder beside ``target``, then move them in."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
    try:
        for file, names in shards.items():
            shard = _apart({name: tensors[name].to("cpu").contiguous() for name in names})
            metadata = {"format": "pt"}
            shard_scales = {n: exact_scales[n] for n in names if n in exact_scales}
            if shard_scales:
                metadata[PER_TENSOR_SCALES_METADATA] = json.dumps(shard_scales)
            save_file(shard, staging / file, metadata=metadata)
        for file, content in json_files.items():
            (staging / file).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        for path in companions:
            shutil.copyfile(path, staging / path.name)
        _give_default_permissions(staging)
        if not target.exists():
            staging.rename(target)
            return
        for path in staging.iterdir():
            os.replace(path, target / path.name)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
