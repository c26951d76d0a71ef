"""Loading an NVFP4 serving checkpoint (compressed-tensors or ModelOpt) into converted layers.

Checkpoints made by llm-compressor, by NVIDIA ModelOpt or by ``export_checkpoint`` carry
everything an ``NVFP4StaticLinear`` holds: packed E2M1 weights, FP8 block scales, a weight
per-tensor scale and a static activation per-tensor scale. ``import_checkpoint`` turns each
quantized linear of the folder into an ``NVFP4StaticLinear`` (the per-expert linears of an MoE
layer into an ``NVFP4StaticExperts``, ``nvfp4_static.experts.serving``) that runs with the
checkpoint's own activation scale, on every backend of this package (engines on Hopper ignore
that scale and run W4A16). The two formats' per-tensor scales are converted as docs/design.md ("Checkpoints")
describes: ModelOpt's are ours; compressed-tensors stores their reciprocals.

Only what this package runs is accepted: W4A4 NVFP4 with 16-element blocks, FP8 E4M3 block
scales and a static activation global scale. Anything else (a dynamic activation global scale,
weight-only W4A16, another bit width, a KV-cache scheme, a missing tensor) is refused with an
error naming the layer and the field, before the model is changed.
"""

import fnmatch
import json
import os
import pathlib
import re
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from nvfp4_static.checkpoint import check_backend_runs_on_model, check_load_target, later_names, replace_submodule
from nvfp4_static.experts import NVFP4StaticExperts
from nvfp4_static.experts.serving import (
    as_loaded,
    expert_linear_stubs,
    fuse_float_experts,
    loaded_module_names,
    stack_imported_experts,
)
from nvfp4_static.export import (
    CONFIG_FILE,
    INDEX_FILE,
    MODELOPT_QUANT_CONFIG_FILE,
    PER_TENSOR_SCALES_METADATA,
    has_class_named,
)
from nvfp4_static.linear import (
    IMPORTED,
    RECIPE_CHOICES,
    NVFP4StaticLinear,
    check_block_scale_codes,
    check_checkpoint_scale_values,
)
from nvfp4_static.numerics import BLOCK_SIZE, E2M1_MAX, E4M3_MAX
from nvfp4_static.tensor import NVFP4StaticTensor, host_scale_product

__all__ = ["import_checkpoint"]

# Tensor names per quantized layer, and whether the per-tensor scales are stored inverted.
_FIELDS = {
    "compressed-tensors": {
        "packed": "weight_packed",
        "block_scales": "weight_scale",
        "weight_scale": "weight_global_scale",
        "input_scale": "input_global_scale",
        "reciprocal": True,
    },
    "modelopt": {
        "packed": "weight",
        "block_scales": "weight_scale",
        "weight_scale": "weight_scale_2",
        "input_scale": "input_scale",
        "reciprocal": False,
    },
}
_TENSOR_KEYS = ("packed", "block_scales", "weight_scale", "input_scale")
_NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK_SIZE}


def import_checkpoint(
    directory: Union[str, os.PathLike],
    model: Optional[torch.nn.Module] = None,
    *,
    backend: Optional[str] = None,
) -> torch.nn.Module:
    """Load a compressed-tensors or ModelOpt NVFP4 folder into a model of converted layers.

    Args:
        directory: a folder with ``config.json`` (with a ``quantization_config`` block, or a
            ModelOpt ``hf_quant_config.json`` beside it) and safetensors weights.
        model: the float model to load into, built as the checkpoint's architecture; its
            quantized linears are replaced by ``NVFP4StaticLinear`` and every other tensor is
            loaded. None builds it from ``config.json`` with transformers (the class named in
            ``architectures``), in the config's dtype.
        backend: force the inference route of the loaded layers (see the config's ``backend``).

    Returns:
        The model, loaded in place when given.

    Raises:
        ValueError: a scheme this package does not run, or a folder and model that do not
            match (a missing, extra or misshapen tensor): the model is left as it was.
        FileNotFoundError: no ``config.json`` or no safetensors file in ``directory``.
    """
    folder = pathlib.Path(directory)
    config = _read_json(folder / CONFIG_FILE)
    format, quantization_config = _quantization_config(folder, config)
    checkpoint, exact_scales = _read_tensors(folder)
    if model is None:
        model = _model_from_config(folder, config)
    check_load_target(model, "import_checkpoint")
    converted = [
        n for n, m in model.named_modules() if isinstance(m, (NVFP4StaticLinear, NVFP4StaticExperts))
    ]
    if converted:
        raise ValueError(
            f"nvfp4_static: the model already holds converted layers (first: '{converted[0]}'); "
            f"import into the float model the checkpoint was made from"
        )
    fields = [_FIELDS[format][key] for key in _TENSOR_KEYS]
    checkpoint, exact_scales = as_loaded(model, checkpoint, exact_scales, fields)
    for key in ("ignore", "exclude_modules"):
        if quantization_config.get(key):
            quantization_config = {**quantization_config, key: loaded_module_names(model, quantization_config[key])}
    # The model's modules and, for MoE layers, one linear per expert and projection.
    expert_linears = expert_linear_stubs(model)
    candidates = {**dict(model.named_modules()), **expert_linears}
    if format == "compressed-tensors":
        quantized = _compressed_tensors_layers(candidates, quantization_config)
    else:
        quantized = _modelopt_layers(candidates, quantization_config)
    layers = {
        name: _layer_from_checkpoint(
            name, candidates[name], checkpoint, exact_scales, format, backend
        )
        for name in quantized
    }
    if "" in layers:
        raise ValueError(
            "nvfp4_static: the model is itself a linear; import into a model that holds it"
        )
    experts = stack_imported_experts(model, layers)
    checkpoint = fuse_float_experts(model, checkpoint, experts)
    aliases = later_names(model)  # a module held under several names gets its layer at each
    remainder = _remaining_tensors(model, checkpoint, layers, format, experts, aliases)
    check_backend_runs_on_model(model, backend, "import_checkpoint")
    linears = {name: layer for name, layer in layers.items() if name not in expert_linears}
    for name, layer in {**linears, **experts}.items():
        for place in (name, *aliases.get(name, ())):
            replace_submodule(model, place, layer)
    model.load_state_dict(remainder, strict=False)
    return model


# --- the folder -----------------------------------------------------------------------------------


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"nvfp4_static: no {path.name} in {path.parent}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"nvfp4_static: {path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"nvfp4_static: {path} holds a JSON {type(value).__name__}, not an object")
    return value


def _quantization_config(folder: pathlib.Path, config: dict) -> tuple:
    """``(format, block)``: the checkpoint's quantization settings and which format they are."""
    block = config.get("quantization_config")
    if block is not None and not isinstance(block, dict):
        raise ValueError(
            f"nvfp4_static: {folder / CONFIG_FILE}: quantization_config is a {type(block).__name__}, "
            f"not an object"
        )
    method = (block or {}).get("quant_method")
    if method == "compressed-tensors":
        return "compressed-tensors", block
    if method == "modelopt" or (block is None and (folder / MODELOPT_QUANT_CONFIG_FILE).is_file()):
        if block is None:  # older ModelOpt exports: the settings live in hf_quant_config.json
            legacy = _read_json(folder / MODELOPT_QUANT_CONFIG_FILE).get("quantization", {})
            block = {**legacy, "ignore": legacy.get("exclude_modules", [])}
        return "modelopt", block
    raise ValueError(
        f"nvfp4_static: {folder / CONFIG_FILE} has no compressed-tensors or ModelOpt "
        f"quantization_config (quant_method is {method!r}); it is not an NVFP4 serving checkpoint"
    )


def _read_tensors(folder: pathlib.Path) -> tuple:
    """``(tensors, exact per-tensor scales)``: every tensor of the folder, and the scales
    ``export_checkpoint`` recorded in the safetensors headers (``{}`` for other writers)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"nvfp4_static: {index} has no weight_map object (tensor name -> file)")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"nvfp4_static: no safetensors weights in {folder}")
    tensors, exact_scales = {}, {}
    for file in files:
        try:
            tensors.update(load_file(folder / file))
            with safe_open(folder / file, framework="pt") as handle:
                recorded = (handle.metadata() or {}).get(PER_TENSOR_SCALES_METADATA)
        except SafetensorError as error:
            raise ValueError(f"nvfp4_static: {folder / file} is not a readable safetensors file: {error}") from error
        exact_scales.update(_recorded_scales(folder / file, recorded) if recorded else {})
    return tensors, exact_scales


def _recorded_scales(path: pathlib.Path, recorded: str) -> dict:
    """The header's record of exact per-tensor scales: tensor name -> float hex string."""
    try:
        scales = json.loads(recorded)
    except json.JSONDecodeError:
        scales = None
    if not isinstance(scales, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in scales.items()
    ):
        raise ValueError(
            f"nvfp4_static: {path}: the header's {PER_TENSOR_SCALES_METADATA!r} is not a JSON object "
            f"of tensor names to float hex strings ({recorded[:80]!r}); the file is damaged, or "
            f"delete that header entry to import the stored scales as they are"
        )
    return scales


def _model_from_config(folder: pathlib.Path, config_json: dict) -> torch.nn.Module:
    """The float model ``config.json`` describes, with uninitialised weights (all are loaded)."""
    import transformers
    from transformers.initialization import no_init_weights

    if "model_type" not in config_json:
        raise ValueError(
            f"nvfp4_static: {folder / CONFIG_FILE} names no model_type (an export of a model that "
            f"is not a transformers model?), so no model can be built from it; build the float "
            f"model yourself and pass it as model="
        )
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the layers are swapped here, not by a transformers quantizer
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise ValueError(
            f"nvfp4_static: transformers has no model class {architectures} named in "
            f"{folder / CONFIG_FILE}; build the float model yourself and pass it as model="
        )
    with no_init_weights():
        model = model_class._from_config(config, dtype=config.dtype)
    model.tie_weights()  # skipped under no_init_weights; a tied lm_head is not in the folder
    return model


# --- which layers are quantized ------------------------------------------------------------------


def _compressed_tensors_layers(modules: dict, block: dict) -> list:
    """The linears among ``modules`` (``{name: module}``) the config groups target, each group
    checked to be NVFP4 as we run it."""
    fmt = block.get("format")
    _refuse_extras(
        "compressed-tensors",
        {
            "kv_cache_scheme": block.get("kv_cache_scheme"),
            "transform_config": block.get("transform_config"),
            "sparsity_config": block.get("sparsity_config"),
        },
    )
    groups = block.get("config_groups") or {}
    if not groups:
        raise ValueError(
            "nvfp4_static: the compressed-tensors quantization_config has no config_groups"
        )
    ignore = block.get("ignore") or []
    quantized = {}
    for group_name, scheme in groups.items():
        if not isinstance(scheme, dict):
            raise ValueError(
                f"nvfp4_static: compressed-tensors config group '{group_name}' is a preset "
                f"name with targets {scheme}; only explicit schemes are read"
            )
        layers = [
            name
            for name, module in modules.items()
            if _ct_matches(name, module, scheme.get("targets") or [])
            and not _ct_matches(name, module, ignore)
        ]
        if layers:
            _check_ct_scheme(group_name, scheme, scheme.get("format") or fmt, layers[0])
        for name in layers:
            quantized.setdefault(name, group_name)
    return list(quantized)


def _ct_matches(name: str, module: torch.nn.Module, targets) -> bool:
    """compressed-tensors' target rule: the exact module name, a ``re:`` regex matched at the
    start of the name, or the name of a class in the module's class hierarchy."""
    for target in [targets] if isinstance(targets, str) else targets:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target == name or has_class_named(module, target):
            return True
    return False


def _check_ct_scheme(group: str, scheme: dict, fmt, layer: str) -> None:
    where = f"layer '{layer}' (compressed-tensors config group '{group}')"
    if fmt != "nvfp4-pack-quantized":
        raise ValueError(
            f"nvfp4_static: {where}: format is {fmt!r}; only 'nvfp4-pack-quantized' is NVFP4"
        )
    inputs = scheme.get("input_activations")
    if inputs is None:
        raise ValueError(
            f"nvfp4_static: {where}: input_activations is null (weight-only NVFP4, W4A16); "
            f"nvfp4_static runs W4A4 with a static activation global scale"
        )
    expected_dynamic = {"weights": False, "input_activations": "local"}
    for field, dynamic in expected_dynamic.items():
        args = scheme.get(field)
        if args is None:
            raise ValueError(f"nvfp4_static: {where}: {field} is null")
        for key, expected in {**_NVFP4_ARGS, "dynamic": dynamic}.items():
            value = args.get(key)
            if isinstance(value, str):
                value = value.lower()
            if value != expected:
                raise ValueError(
                    f"nvfp4_static: {where}: {field}.{key} is {args.get(key)!r}, NVFP4 as "
                    f"nvfp4_static runs it needs {expected!r}"
                    + (_DYNAMIC_EXPLAINED if key == "dynamic" and field == "input_activations" else "")
                )
        if not args.get("symmetric", True):
            raise ValueError(
                f"nvfp4_static: {where}: {field}.symmetric is false; NVFP4 is symmetric"
            )
        if args.get("scale_dtype") not in (None, "torch.float8_e4m3fn", "float8_e4m3fn"):
            raise ValueError(
                f"nvfp4_static: {where}: {field}.scale_dtype is {args['scale_dtype']!r}; NVFP4 "
                f"block scales are float8_e4m3fn"
            )
    if scheme.get("output_activations") is not None:
        raise ValueError(f"nvfp4_static: {where}: output_activations are quantized; not supported")


_DYNAMIC_EXPLAINED = (
    " (input_activations.dynamic 'local' means block scales per call and a calibrated global "
    "scale, this package's scheme; true computes the global scale on every call, which a "
    "static-scale layer cannot reproduce)"
)


def _modelopt_layers(modules: dict, block: dict) -> list:
    """Every linear among ``modules`` (``{name: module}``) not excluded, after checking the
    algorithm is W4A4 NVFP4."""
    algo = str(block.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        hint = " (weight-only: no activation scale)" if algo == "W4A16_NVFP4" else ""
        raise ValueError(
            f"nvfp4_static: the ModelOpt checkpoint's quant_algo is {block.get('quant_algo')!r}"
            f"{hint}; nvfp4_static imports 'NVFP4' (W4A4) only"
        )
    if block.get("group_size", BLOCK_SIZE) != BLOCK_SIZE:
        raise ValueError(
            f"nvfp4_static: the ModelOpt checkpoint's group_size is {block['group_size']}; "
            f"NVFP4 blocks hold {BLOCK_SIZE} elements"
        )
    _refuse_extras("ModelOpt", {"kv_cache_quant_algo": block.get("kv_cache_quant_algo")})
    excluded = block.get("ignore") or block.get("exclude_modules") or []
    return [
        name
        for name, module in modules.items()
        if isinstance(module, torch.nn.Linear)
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded)
    ]


def _refuse_extras(format: str, settings: dict) -> None:
    for field, value in settings.items():
        if value:
            raise ValueError(
                f"nvfp4_static: the {format} checkpoint sets {field} = {value!r}; nvfp4_static "
                f"imports NVFP4 linear layers only"
            )


# --- building the layers ------------------------------------------------------------------------


def _layer_from_checkpoint(
    name: str,
    module: torch.nn.Module,
    checkpoint: dict,
    exact_scales: dict,
    format: str,
    backend: Optional[str],
) -> NVFP4StaticLinear:
    """The converted layer for ``name``, every tensor checked against ``module``'s shape."""
    fields = _FIELDS[format]
    if not isinstance(module, torch.nn.Linear):
        raise ValueError(
            f"nvfp4_static: layer '{name}' is quantized in the checkpoint but the model has a "
            f"{type(module).__name__} there"
        )
    out_features, in_features = module.out_features, module.in_features

    def tensor(field: str, dtype: torch.dtype, shape: Optional[tuple]) -> torch.Tensor:
        key = f"{name}.{field}"
        if key not in checkpoint:
            raise ValueError(
                f"nvfp4_static: layer '{name}': the checkpoint has no '{field}' ({key}); an "
                f"NVFP4 {format} layer needs {', '.join(fields[k] for k in _TENSOR_KEYS)}"
            )
        value = checkpoint[key]
        shape_ok = value.numel() == 1 if shape is None else tuple(value.shape) == shape
        if value.dtype != dtype or not shape_ok:
            raise ValueError(
                f"nvfp4_static: layer '{name}': '{field}' is {value.dtype} of shape "
                f"{list(value.shape)}; expected {dtype} of shape "
                f"{'one element' if shape is None else list(shape)} for the model's "
                f"Linear({in_features} -> {out_features})"
            )
        return value.to(module.weight.device)

    if in_features % BLOCK_SIZE or out_features % BLOCK_SIZE:
        raise ValueError(
            f"nvfp4_static: layer '{name}' is Linear({in_features} -> {out_features}); NVFP4 needs "
            f"dims that are multiples of {BLOCK_SIZE}"
        )
    qdata = tensor(fields["packed"], torch.uint8, (out_features, in_features // 2))
    scale = tensor(
        fields["block_scales"], torch.float8_e4m3fn, (out_features, in_features // BLOCK_SIZE)
    )
    check_block_scale_codes(scale, name)
    weight_scale, input_scale = (
        _per_tensor_scale(
            name,
            fields[key],
            tensor(fields[key], torch.float32, None),
            fields["reciprocal"],
            exact_scales.get(f"{name}.{fields[key]}"),
        )
        for key in ("weight_scale", "input_scale")
    )
    check_checkpoint_scale_values(input_scale, weight_scale, name)
    bias = _bias(name, module, checkpoint)
    weight = NVFP4StaticTensor(
        qdata,
        scale,
        BLOCK_SIZE,
        module.weight.dtype,
        weight_scale,
        input_scale,
        backend_override=backend,
        output_scale=host_scale_product(input_scale, weight_scale),
    )
    act_global_amax = float(input_scale) * E4M3_MAX * E2M1_MAX
    stats = {"g_amax": act_global_amax, "set_by": f"{format} checkpoint"}
    recipe = dict.fromkeys(RECIPE_CHOICES, IMPORTED)
    return NVFP4StaticLinear(weight, bias, recipe, name, stats)


def _per_tensor_scale(
    name: str, field: str, stored: torch.Tensor, reciprocal: bool, exact_hex: Optional[str]
) -> torch.Tensor:
    """Our per-tensor scale (``amax / 2688``, float32 0-d) from the stored value.

    For compressed-tensors that is ``1 / global_scale``, unless the header records the exact
    scale the global scale was made from (``export_checkpoint``) and that scale's reciprocal
    is the stored global scale: a float32 reciprocal can come from two neighbouring scales, and
    the record says which (see ``export._exact_per_tensor_scales``).
    """
    value = stored.reshape(())
    scale = 1.0 / value if reciprocal else value
    if reciprocal and exact_hex is not None:
        exact = torch.tensor(float.fromhex(exact_hex), dtype=torch.float32, device=value.device)
        if torch.equal(1.0 / exact, value):
            scale = exact
    if not bool(torch.isfinite(scale)) or scale < 0:
        raise ValueError(
            f"nvfp4_static: layer '{name}': '{field}' is {float(value)!r}, which gives the "
            f"per-tensor scale {float(scale)!r}; it must be finite and not negative"
        )
    return scale


def _bias(name: str, module: torch.nn.Linear, checkpoint: dict) -> Optional[torch.nn.Parameter]:
    key = f"{name}.bias"
    if (module.bias is None) != (key not in checkpoint):
        has = "has" if key in checkpoint else "has no"
        raise ValueError(
            f"nvfp4_static: layer '{name}': the checkpoint {has} a bias but the model's layer "
            f"{'has none' if module.bias is None else 'has one'}"
        )
    if module.bias is None:
        return None
    value = checkpoint[key]
    if not value.is_floating_point():
        raise ValueError(f"nvfp4_static: layer '{name}': bias is {value.dtype}; expected a floating-point tensor")
    if tuple(value.shape) != tuple(module.bias.shape):
        raise ValueError(
            f"nvfp4_static: layer '{name}': bias has shape {list(value.shape)}, the model's "
            f"{list(module.bias.shape)}"
        )
    return torch.nn.Parameter(value.to(module.bias.device, module.bias.dtype), requires_grad=False)


def _remaining_tensors(
    model: torch.nn.Module, checkpoint: dict, layers: dict, format: str, experts: dict, aliases: dict
) -> dict:
    """The checkpoint's other tensors, checked to be exactly the model's other tensors (a name
    the model ties to another, such as a tied ``lm_head.weight``, may be absent); the state of
    the ``experts`` modules, and of the layers under their ``aliases``, is replaced whole."""
    layer_fields = [_FIELDS[format][key] for key in _TENSOR_KEYS] + ["bias"]
    consumed = {f"{name}.{field}" for name in layers for field in layer_fields}
    def places(names) -> list:
        return [place for name in names for place in (name, *aliases.get(name, ()))]

    state = model.state_dict()
    replaced = {f"{place}.{leaf}" for place in places(layers) for leaf in ("weight", "bias")}
    expert_places = places(experts)
    replaced |= {key for key in state if any(key.startswith(f"{place}.") for place in expert_places)}
    expected = {k: v for k, v in state.items() if k not in replaced}
    remainder = {k: v for k, v in checkpoint.items() if k not in consumed}
    unexpected = sorted(set(remainder) - set(expected))
    if unexpected:
        raise ValueError(
            f"nvfp4_static: the checkpoint holds {len(unexpected)} tensor(s) the model does not "
            f"have, e.g. {unexpected[:3]}; build the architecture the checkpoint was saved from"
        )
    present = {_storage(v) for k, v in expected.items() if k in remainder}
    missing = sorted(
        k for k, v in expected.items() if k not in remainder and _storage(v) not in present
    )
    if missing:
        raise ValueError(
            f"nvfp4_static: the checkpoint lacks {len(missing)} tensor(s) of the model, e.g. "
            f"{missing[:3]}; build the architecture the checkpoint was saved from"
        )
    for key, value in remainder.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"nvfp4_static: '{key}' has shape {list(value.shape)} in the checkpoint and "
                f"{list(expected[key].shape)} in the model"
            )
        if _number_kind(value) != _number_kind(expected[key]):
            raise ValueError(
                f"nvfp4_static: '{key}' is {value.dtype} in the checkpoint and {expected[key].dtype} "
                f"in the model; loading would convert its values as numbers (a layer quantized in "
                f"another scheme?)"
            )
    _check_tied_entries(expected, remainder)
    return remainder


def _number_kind(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "boolean"
    if tensor.is_complex():
        return "complex"
    return "floating-point" if tensor.is_floating_point() else "integer"


def _check_tied_entries(expected: dict, remainder: dict) -> None:
    """Refuse different checkpoint tensors for names the model ties together (a tied
    ``lm_head`` and embedding): loading writes both into the one tensor, the last one winning."""
    first_name = {}
    for key in remainder:
        storage = _storage(expected[key])
        if storage not in first_name:
            first_name[storage] = key
            continue
        other = first_name[storage]
        if not torch.equal(remainder[key], remainder[other]):
            one, two = sorted((key, other))
            raise ValueError(
                f"nvfp4_static: the model ties '{one}' to '{two}' (one tensor), but the "
                f"checkpoint holds different values for them; build the model untied (e.g. "
                f"tie_word_embeddings=False) to load this checkpoint"
            )


def _storage(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape)
