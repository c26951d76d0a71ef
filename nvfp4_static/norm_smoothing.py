"""Per-channel smoothing of the inputs a normalization layer feeds, folded into the float model.

In a decoder layer, q/k/v read the output of ``input_layernorm`` and gate/up the output of
``post_attention_layernorm``. The channels of those outputs differ in size by orders of
magnitude, always the same channels. An NVFP4 activation block's scale follows its largest
value, so in a block that holds a large channel the small ones round to zero. Dividing channel
``k`` of the norm's weight (and bias) by ``s_k`` and multiplying column ``k`` of every consumer's
weight by ``s_k`` computes the same function (up to one rounding of each changed weight to its
dtype), and with (SmoothQuant's choice)

    s_k = a_k ** alpha / w_k ** (1 - alpha),    then divided by the geometric mean of all s_k

where ``a_k`` is the channel's largest ``|input|`` over the batches ``forward_loop`` runs and
``w_k`` the consumers' largest ``|weight|`` in column ``k``, it moves part of each channel's size
from the activation, whose blocks cannot follow it, into the weight, whose block scales are
chosen offline. The dividing by the geometric mean leaves the overall size of the input alone.

Run it on the float model before ``step="prepare"``: calibration then sees the smoothed inputs.
The result is an ordinary model with other norm and linear weights, so every export format holds
it, and q/k/v and gate/up keep one input each (``tie_fused_layers`` still applies).
"""

import copy
import numbers
import weakref
from collections.abc import Callable
from typing import Optional

import torch

from nvfp4_static.messages import warn

__all__ = [
    "DEFAULT_NORM_CONSUMERS",
    "check_alpha",
    "find_norm_groups",
    "fold_smoothing_scales",
    "smooth_norm_inputs",
    "smoothing_scales",
]

# Norm attribute -> the linears (relative to the same parent) that read its output: the
# transformers names of Llama, Mistral, Qwen2/3 and SmolLM decoder layers.
DEFAULT_NORM_CONSUMERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
DEFAULT_ALPHA = 0.5


@torch.no_grad()
def smooth_norm_inputs(
    model: torch.nn.Module,
    forward_loop: Callable[[torch.nn.Module], None],
    *,
    alpha: float = DEFAULT_ALPHA,
    norm_consumers: Optional[dict[str, tuple[str, ...]]] = None,
) -> dict[str, torch.Tensor]:
    """Fold per-channel smoothing scales into every norm and the linears that read it.

    Args:
        model: the float model, before ``step="prepare"``.
        forward_loop: runs calibration batches through the model it is given (a batch or two is
            enough: only each channel's largest value is kept).
        alpha: how much of each channel's size moves into the weight, in [0, 1]; 0 divides by
            the weights' column maxima only, 1 by the activations' channel maxima only.
        norm_consumers: norm attribute -> names of the linears reading it, relative to the
            module holding the norm (default ``DEFAULT_NORM_CONSUMERS``).

    Returns:
        Each smoothed norm's name -> the scales ``s`` its weight was divided by.

    Raises:
        ValueError: ``alpha`` outside [0, 1]; no norm with all its consumers in ``model``; a
            consumer that is not a plain ``nn.Linear`` of the norm's width (e.g. already
            prepared or converted); a norm without a weight, or whose output does not scale with
            its weight (Gemma's ``1 + weight``); a norm ``forward_loop`` did not reach, or whose
            output was not finite. In every case the model is left as it was.
    """
    groups = _norm_groups(model, DEFAULT_NORM_CONSUMERS if norm_consumers is None else norm_consumers)
    scales = smoothing_scales(model, groups, forward_loop, alpha)
    fold_smoothing_scales(groups, scales)
    return scales


def find_norm_groups(module: torch.nn.Module, norm_consumers: Optional[dict] = None) -> dict:
    """Norm name -> (norm, [consumer linears]) in ``module``, each group checked; may be empty.
    A norm with only some of its consumers, a linear two groups name, or a weight that two
    places share (a norm module used twice, tied linear weights) is refused: folding scales
    into part of what reads a norm, or twice into one tensor, changes what the model computes."""
    norm_consumers = DEFAULT_NORM_CONSUMERS if norm_consumers is None else norm_consumers
    _check_norm_consumers(norm_consumers)
    groups, owner, folded_into = {}, {}, {}
    for parent_name, parent in module.named_modules():
        for norm_attr, consumer_names in norm_consumers.items():
            norm = getattr(parent, norm_attr, None)
            consumers = [_submodule_or_none(parent, name) for name in consumer_names]
            if norm is None or all(c is None for c in consumers):
                continue
            name = _qualified(parent_name, norm_attr)
            missing = [n for n, c in zip(consumer_names, consumers) if c is None]
            if missing:
                raise ValueError(
                    f"nvfp4_static: smooth_norm_inputs: norm '{name}' has only some of its consumers "
                    f"{list(consumer_names)} beside it (missing: {missing}); name every linear that reads it"
                )
            _check_group(name, norm, consumers, consumer_names)
            for consumer_name, consumer in zip(consumer_names, consumers):
                if consumer in owner:
                    raise ValueError(
                        f"nvfp4_static: smooth_norm_inputs: '{consumer_name}' is named as a consumer of "
                        f"both '{owner[consumer]}' and '{name}'; a linear reads one norm"
                    )
                owner[consumer] = name
            holders = [(name, norm)] + [(_qualified(parent_name, n), c) for n, c in zip(consumer_names, consumers)]
            for place, holder in holders:
                first = folded_into.setdefault(id(holder.weight), place)
                if first != place:
                    raise ValueError(
                        f"nvfp4_static: smooth_norm_inputs: '{place}' and '{first}' hold one weight "
                        f"(a module used twice, or tied weights); folding the scales into it twice "
                        f"would change what the model computes"
                    )
            groups[name] = (norm, consumers)
    return groups


def _qualified(parent_name: str, attribute: str) -> str:
    return f"{parent_name}.{attribute}" if parent_name else attribute


def _check_norm_consumers(norm_consumers) -> None:
    """Refuse a ``norm_consumers`` that is not norm attribute -> distinct linear names."""
    well_formed = isinstance(norm_consumers, dict) and norm_consumers and all(
        isinstance(norm, str) and isinstance(names, (tuple, list)) and names
        and all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
        for norm, names in norm_consumers.items()
    )
    if not well_formed:
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs: norm_consumers maps each norm's attribute name to the "
            f"distinct names of the linears reading it, e.g. {DEFAULT_NORM_CONSUMERS}; got {norm_consumers!r}"
        )


@torch.no_grad()
def smoothing_scales(model: torch.nn.Module, groups: dict, forward_loop, alpha: float) -> dict:
    """Each group's scales ``s`` from the norm outputs ``forward_loop`` produces; checks that
    every norm can take them, changing nothing. A group whose named consumers are not exactly
    the linears that read the norm's output gets scales of 1 (it stays as it is), with a
    warning: folding would change what the other readers compute."""
    check_alpha(alpha, "smooth_norm_inputs")
    channel_amax, readers = _norm_output_channel_amax(model, groups, forward_loop)
    names = {module: name for name, module in model.named_modules()}
    scales = {}
    for name, (_, consumers) in groups.items():
        problem = _readers_problem(consumers, readers[name], names)
        if problem is None:
            scales[name] = _smoothing_scales(channel_amax[name], consumers, alpha)
            continue
        warn(f"nvfp4_static: smoothing leaves norm '{name}' as it is: {problem}")
        scales[name] = torch.ones_like(channel_amax[name]).to(consumers[0].weight.device)
    for name, (norm, _) in groups.items():
        _check_output_follows_weight(name, norm, scales[name])
    return scales


def check_alpha(alpha: float, caller: str, argument: str = "alpha") -> None:
    """Refuse an alpha outside [0, 1] (NaN too, and what is not a number), naming ``caller``'s
    ``argument``."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"nvfp4_static: {caller}: {argument}={alpha!r} must be a number in [0, 1]")


@torch.no_grad()
def fold_smoothing_scales(groups: dict, scales: dict) -> None:
    """Divide each norm by its scales and multiply its consumers' weight columns by them."""
    for name, (norm, consumers) in groups.items():
        s = scales[name]
        _divide_norm_by(norm, s)
        for linear in consumers:
            linear.weight.copy_((linear.weight.float() * s).to(linear.weight.dtype))


def _norm_groups(model: torch.nn.Module, norm_consumers: dict) -> dict:
    groups = find_norm_groups(model, norm_consumers)
    if not groups:
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs found no norm with its consumers in the model "
            f"(looked for {dict(norm_consumers)}); pass norm_consumers for this architecture"
        )
    return groups


def _submodule_or_none(parent: torch.nn.Module, name: str):
    try:
        return parent.get_submodule(name)
    except AttributeError:
        return None


def _check_group(name: str, norm, consumers, consumer_names) -> None:
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs: norm '{name}' has no 1-D weight to fold the "
            f"scales into (elementwise_affine=False?)"
        )
    for linear, linear_name in zip(consumers, consumer_names):
        if type(linear) is not torch.nn.Linear or linear.in_features != weight.numel():
            raise ValueError(
                f"nvfp4_static: smooth_norm_inputs: '{linear_name}' next to norm '{name}' is a "
                f"{type(linear).__name__} ({getattr(linear, 'in_features', '?')} inputs), not a "
                f"float nn.Linear of the norm's width {weight.numel()}; smooth the float model "
                f"before step='prepare'"
            )


def _readers_problem(consumers, readers: set, names: dict) -> Optional[str]:
    """What differs between a norm's named consumers and the linears that read its output."""
    unread = [names.get(c, "?") for c in consumers if c not in readers]
    if unread:
        return f"{unread} do not read its output (another kind of norm there?)"
    others = sorted(names.get(m, "?") for m in readers if m not in consumers)
    if others:
        return f"{others} also read its output, and norm_consumers does not name them"
    return None


def _norm_output_channel_amax(model, groups: dict, forward_loop) -> tuple[dict, dict]:
    """Each norm's largest ``|output|`` per channel over ``forward_loop`` (float32), and the
    linears of ``model`` that read that output (the tensor itself, or a view of it)."""
    amax: dict[str, torch.Tensor] = {}
    readers: dict[str, set] = {name: set() for name in groups}
    outputs: dict[int, tuple] = {}  # id of a norm's output -> (a weak reference to it, the norm's name)

    def recorder(name):
        def hook(module, args, output):
            outputs[id(output)] = (weakref.ref(output), name)
            if not output.numel():  # a batch without tokens, which the model runs
                return
            seen = output.detach().abs().flatten(0, -2).amax(0).float()
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)
        return hook

    def reader(module, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        for tensor in (x, getattr(x, "_base", None)):
            ref, name = outputs.get(id(tensor), (None, None))
            if tensor is not None and ref is not None and ref() is tensor:
                readers[name].add(module)

    handles = [norm.register_forward_hook(recorder(name)) for name, (norm, _) in groups.items()]
    handles += [m.register_forward_pre_hook(reader, with_kwargs=True)
                for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        forward_loop(model)
    finally:
        for handle in handles:
            handle.remove()
    unseen = [name for name in groups if name not in amax]
    if unseen:
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs: norms {', '.join(unseen)} saw no input (or "
            f"only batches without tokens); forward_loop must run batches through the model it "
            f"is given. Nothing was changed"
        )
    bad = [name for name, a in amax.items() if not bool(torch.isfinite(a).all())]
    if bad:
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs: the output of norms {', '.join(bad)} was not "
            f"finite during forward_loop. Nothing was changed"
        )
    return amax, readers


def _divide_norm_by(norm: torch.nn.Module, s: torch.Tensor) -> None:
    """Divide the norm's weight (and bias) by ``s`` per channel, rounding once to their dtype."""
    norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.copy_((norm.bias.float() / s).to(norm.bias.dtype))


def _check_output_follows_weight(name: str, norm: torch.nn.Module, s: torch.Tensor) -> None:
    """Refuse a norm whose output does not divide by ``s`` when its weight (and bias) do, e.g.
    Gemma's ``x * (1 + weight)``: folding the scales there would change what the model
    computes. Checked on a copy of the norm with a random input; outputs under the dtype's
    smallest normal (fp16's 6e-5) are compared absolutely, their subnormal rounding being
    coarser than the relative tolerance."""
    folded = copy.deepcopy(norm)
    _divide_norm_by(folded, s)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, s.numel(), generator=generator).to(norm.weight.device, norm.weight.dtype)
    expected = norm(x).float() / s.to(x.device)
    atol = max(1e-6 * float(expected.abs().max()), torch.finfo(x.dtype).tiny)
    if not torch.allclose(folded(x).float(), expected, rtol=2e-2, atol=atol):
        raise ValueError(
            f"nvfp4_static: smooth_norm_inputs: norm '{name}' ({type(norm).__name__}) does not "
            f"scale its output with its weight, so the smoothing cannot be folded into it. "
            f"Nothing was changed"
        )


def _smoothing_scales(channel_amax: torch.Tensor, consumers, alpha: float) -> torch.Tensor:
    """``a^alpha / w^(1 - alpha)`` over the geometric mean; 1 where a channel or column is 0
    (nothing to balance there)."""
    weight_amax = torch.stack([c.weight.detach().abs().amax(0).float() for c in consumers]).amax(0)
    weight_amax = weight_amax.to(channel_amax.device)
    live = (channel_amax > 0) & (weight_amax > 0)
    log_s = torch.where(
        live,
        alpha * channel_amax.clamp(min=1e-30).log() - (1 - alpha) * weight_amax.clamp(min=1e-30).log(),
        0.0,
    )
    if bool(live.any()):
        log_s = torch.where(live, log_s - log_s[live].mean(), 0.0)
    return log_s.exp().to(consumers[0].weight.device)
