"""``NVFP4StaticTensor``: an NVFP4 weight that carries its layer's static activation scale.

A subclass of torchao's ``NVFP4Tensor`` (same data layout: packed E2M1 ``qdata`` ``[N, K/2]``,
unswizzled FP8 ``scale`` ``[N, K/16]``, ``per_tensor_scale``, ``act_per_tensor_scale``), so
torchao's tooling recognises it. Two things differ:

- torchao's op overrides build ``NVFP4Tensor`` by name, so ``t``/``view``/``transpose``/``to``/
  slicing/``pin_memory`` would drop the subclass; they are overridden here to keep it.
- torchao's ``linear``/``mm``/``addmm`` call an FP4 ``torch._scaled_mm`` that only sm100 has.
  Here they quantize the activation with the static global scale and hand the GEMM to the
  backend chosen for the tensor's device when it was built (``linear_backend``, see
  ``nvfp4_static.backends``).
"""

import hashlib
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import return_and_correct_aliasing
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.utils import TorchAOBaseTensor, fill_defaults

from nvfp4_static.backends import linear_function, resolve_backend
from nvfp4_static.kernels import quantize_weight_nvfp4
from nvfp4_static.numerics import (
    AMAX_ROUNDING,
    BLOCK_SIZE,
    E4M3_MIN_NORMAL,
    SUPPORTED_DTYPES,
    is_usable_act_per_tensor_scale,
    per_tensor_amax_to_scale,
)

__all__ = ["NVFP4StaticTensor", "UnpresentableDtypeError", "static_linear"]

# Attributes held on the host only: left out of the flatten metadata (a traced graph would hold
# them as constants) and unknown (None) in a rebuilt tensor.
_HOST_ONLY = ("output_scale",)

aten = torch.ops.aten


class UnpresentableDtypeError(ValueError):
    """A cast of an NVFP4 weight to a dtype it cannot present as (its layer names itself in
    the error it raises from this one)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(f"nvfp4_static: an NVFP4 tensor can present as fp32/bf16/fp16, not {dtype}")
        self.dtype = dtype


class NVFP4StaticTensor(NVFP4Tensor):
    """NVFP4 weight + static activation global scale, runnable on every device.

    Attributes beyond ``NVFP4Tensor``'s:
        backend_override: backend forced by the config (None: choose by device).
        linear_backend: the backend this tensor's linear runs on (derived, shown in ``repr``).
        output_scale: ``act_per_tensor_scale * per_tensor_scale`` as a Python float
            (``host_scale_product``), or None where unknown. ``from_float`` and an in-place copy
            read it from the scales (one device sync), the constructor takes it as given and
            never reads a device. A host copy lets the eager large-M GEMM give the scale to
            cuBLAS as ``alpha`` without a sync per call. It is not part of the flatten metadata,
            so a traced graph never holds it as a constant: traced, the weight is rebuilt with
            it None and the graph scales by the global-scale tensors, which it reads on every
            call like the packed values.
    """

    optional_tensor_attribute_names = NVFP4Tensor.optional_tensor_attribute_names + [
        "backend_override",
        "output_scale",
    ]

    def __new__(
        cls,
        qdata,
        scale,
        block_size,
        orig_dtype,
        per_tensor_scale=None,
        act_per_tensor_scale=None,
        is_swizzled_scales=False,
        use_triton_kernel=False,
        act_quant_kwargs=None,
        backend_override=None,
        output_scale=None,
    ):
        _check_layout(block_size, is_swizzled_scales)
        _check_data(qdata, scale, orig_dtype)
        _check_global_scales(per_tensor_scale, act_per_tensor_scale)
        self = super().__new__(
            cls,
            qdata,
            scale,
            block_size,
            orig_dtype,
            per_tensor_scale,
            act_per_tensor_scale,
            is_swizzled_scales,
            use_triton_kernel,
            act_quant_kwargs,
        )
        self.backend_override = backend_override
        self.output_scale = output_scale
        self.linear_backend = resolve_backend(qdata.device, backend_override)
        linear_function(self.linear_backend)  # import now, outside any compiled region
        return self

    def __tensor_flatten__(self):
        """torchao's flatten, computed once per object and again only after one of its fields is
        set: a compiled model calls it two or three times per weight on every call (dynamo's
        guards on the weight's metadata and inner tensors, AOTAutograd's unwrapping of its
        inputs), where torchao's form takes about 1.7 us on a CPU host and this one 0.2. The
        metadata dict is shared by every caller and replaced, never changed, when a field is
        set, so a guard that kept the old dict sees the change."""
        flattened = self.__dict__.get(_FLATTENED)
        if flattened is None:
            names, metadata = super().__tensor_flatten__()
            metadata = {name: value for name, value in metadata.items() if name not in _HOST_ONLY}
            flattened = self.__dict__[_FLATTENED] = (tuple(names), metadata)
        names, metadata = flattened
        return list(names), metadata

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, metadata, outer_size, outer_stride):
        """torchao's rebuild, with ``output_scale`` unknown: a rebuild is traced (the scales
        fake) or, in a model torchao's ``unwrap_tensor_subclass`` unwrapped, runs on every
        call, where reading the scales would sync the device."""
        metadata = {**metadata, **dict.fromkeys(_HOST_ONLY)}
        return super().__tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _FLATTENED_FIELDS:
            self.__dict__.pop(_FLATTENED, None)

    def __getstate__(self):
        """The pickled state, without the flatten cache (rebuilt on first use)."""
        state = dict(self.__dict__)
        state.pop(_FLATTENED, None)
        return state

    # torchao's NVFP4Tensor disables __torch_function__; re-enable it so F.linear is caught
    # whole (any leading dims, one activation quantization) instead of after decomposition into
    # a transpose (a new subclass object) and addmm. Bound to this class: torchao looks up the
    # handler table of the class it is bound to.
    __torch_function__ = classmethod(TorchAOBaseTensor.__torch_function__.__func__)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        act_global_amax: torch.Tensor,
        block_scales_e4m3: Optional[torch.Tensor] = None,
        backend_override: Optional[str] = None,
        weight_global_amax: Optional[torch.Tensor] = None,
    ) -> "NVFP4StaticTensor":
        """Quantize a ``[N, K]`` weight.

        Args:
            weight: the float weight.
            act_global_amax: the calibrated activation global amax (> 0).
            block_scales_e4m3: ``[N, K/16]`` FP8 block scales (e.g. from the MSE sweep); None
                computes them from block maxes, exactly as torchao does.
            backend_override: force a backend (see ``nvfp4_static.backends``).
            weight_global_amax: the weight's global amax, by default its ``max(|w|)``; a layer
                of a tied fusion group takes the group's.
        """
        act_global_amax = _one_amax(act_global_amax, "act_global_amax")
        act_per_tensor_scale = per_tensor_amax_to_scale(act_global_amax)
        weight_max = weight.detach().abs().amax().to(torch.float32)
        if weight_global_amax is None:
            weight_global_amax = weight_max
        weight_global_amax = _one_amax(weight_global_amax, "weight_global_amax")
        weight_per_tensor_scale = per_tensor_amax_to_scale(weight_global_amax.to(weight.device))
        scalars = (act_per_tensor_scale, act_global_amax, weight_per_tensor_scale, weight_global_amax, weight_max)
        values = _host_values(weight.device, *scalars)
        output_scale, all_zero = None, False
        if values is not None:
            _check_amaxes(*values)
            act_scale, _, weight_scale, _, _ = values
            output_scale = float(act_scale * weight_scale)
            all_zero = bool(weight_scale == 0)
            if block_scales_e4m3 is None and all_zero:
                # An all-zero weight: block max would be 0 / 0 under its zero global scale. It
                # takes the sweep's smallest normal block scale.
                rows, columns = weight.shape[-2], weight.shape[-1] // BLOCK_SIZE
                block_scales_e4m3 = torch.full((rows, columns), E4M3_MIN_NORMAL, device=weight.device)
                block_scales_e4m3 = block_scales_e4m3.to(torch.float8_e4m3fn)
        qdata, scale = quantize_weight_nvfp4(weight.detach(), weight_per_tensor_scale, block_scales_e4m3)
        if all_zero:  # its elements were scaled to 0 / 0, NaN, whose E2M1 code differs by device
            qdata = torch.zeros_like(qdata)
        return cls(
            qdata,
            scale,
            BLOCK_SIZE,
            weight.dtype,
            weight_per_tensor_scale,
            act_per_tensor_scale.to(weight.device),
            backend_override=backend_override,
            output_scale=output_scale,
        )

    def _stable_hash_for_caching(self) -> str:
        """What an AOTAutograd cache key needs of this weight: its class, shape and flatten
        attributes, and the layout of its inner tensors, whose values are graph inputs."""
        inner_names, attributes = self.__tensor_flatten__()
        layouts = [
            (name, tuple(t.shape), t.stride(), str(t.dtype), str(t.device))
            for name in inner_names
            for t in (getattr(self, name),)
        ]
        key = repr((type(self).__qualname__, tuple(self.shape), attributes, layouts))
        return hashlib.sha256(key.encode()).hexdigest()

    def _rewrap(self, qdata: torch.Tensor, scale: torch.Tensor, **changes) -> "NVFP4StaticTensor":
        """A tensor like ``self`` with new data, keeping the class and every attribute."""
        fields = dict(
            block_size=self.block_size,
            orig_dtype=self.orig_dtype,
            per_tensor_scale=self.per_tensor_scale,
            act_per_tensor_scale=self.act_per_tensor_scale,
            is_swizzled_scales=self.is_swizzled_scales,
            use_triton_kernel=self.use_triton_kernel,
            act_quant_kwargs=self.act_quant_kwargs,
            backend_override=self.backend_override,
            output_scale=self.output_scale,
        )
        fields.update(changes)
        return type(self)(qdata, scale, **fields)

    def is_transposed(self) -> bool:
        """Whether this is the ``[K, N]`` transpose (``.t()``) of a stored ``[N, K]`` weight."""
        return self.qdata.stride(-2) < self.qdata.stride(-1)

    def __repr__(self):
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.orig_dtype}, "
            f"device={self.device}, backend={self.linear_backend}, "
            f"act_global_amax={_amax_of(self.act_per_tensor_scale)}, "
            f"weight_global_amax={_amax_of(self.per_tensor_scale)})"
        )


def host_scale_product(
    act_per_tensor_scale: Optional[torch.Tensor], per_tensor_scale: Optional[torch.Tensor]
) -> Optional[float]:
    """The ``output_scale`` of a weight with these global scales: their product in fp32, as a
    float; None if it cannot be read (a scale missing, fake or on ``meta``). Syncs the device."""
    scales = (act_per_tensor_scale, per_tensor_scale)
    if any(s is None or not _holds_values(s) for s in scales):
        return None
    return float(scales[0].to(torch.float32) * scales[1].to(torch.float32))


def _one_amax(amax, name: str) -> torch.Tensor:
    """``amax`` (a one-element tensor or a Python number) as a float32 scalar tensor, refusing
    anything else: a several-element amax would broadcast the per-tensor scale over the weight."""
    if isinstance(amax, (int, float)) and not isinstance(amax, bool):
        amax = torch.tensor(float(amax))
    if not isinstance(amax, torch.Tensor):
        raise ValueError(f"nvfp4_static: from_float takes {name} as one real number; got {amax!r}")
    if amax.numel() != 1 or amax.dtype.is_complex or amax.dtype == torch.bool:
        got = f"a tensor of shape {list(amax.shape)} {amax.dtype}"
        raise ValueError(f"nvfp4_static: from_float takes {name} as one real number; got {got}")
    return amax.detach().reshape(()).to(torch.float32)


def _host_values(device: torch.device, *scalars: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
    """The scalars' values on the host as float32, those not there yet gathered on ``device``
    and read in one transfer (one wait for a GPU); None where one has none to read (fake while
    tracing, or on ``meta``)."""
    if not all(_holds_values(s) for s in scalars):
        return None
    elsewhere = [s.to(device=device, dtype=torch.float32) for s in scalars if s.device.type != "cpu"]
    read = iter(torch.stack(elsewhere).cpu().unbind() if elsewhere else ())
    return tuple(s.to(torch.float32) if s.device.type == "cpu" else next(read) for s in scalars)


def _check_amaxes(act_scale, act_global_amax, weight_scale, weight_global_amax, weight_max) -> None:
    """Refuse, from their host values, global amaxes that would quantize to NaN or to another
    weight than the given one (an amax under the weight's max |w| saturates block scales)."""
    if not is_usable_act_per_tensor_scale(act_scale):
        raise ValueError(
            f"nvfp4_static: activation global amax {float(act_global_amax):.3g} is below what "
            f"NVFP4 can quantize with: it must be finite and above about 5e-34 (below it, "
            f"block-scale reciprocals overflow float32)"
        )
    if not bool(torch.isfinite(weight_max)):
        raise ValueError("nvfp4_static: from_float needs a finite weight; this one holds NaN or Inf values")
    usable = bool(torch.isfinite(weight_scale)) and weight_scale >= 0
    if not usable or weight_max > weight_global_amax * (1 + AMAX_ROUNDING):
        raise ValueError(
            f"nvfp4_static: weight global amax {float(weight_global_amax):.6g} cannot quantize a "
            f"weight whose max |w| is {float(weight_max):.6g}: it must be finite and at least "
            f"that max (a smaller one clips the largest blocks)"
        )


def _holds_values(t: torch.Tensor) -> bool:
    """False for tensors without data to read: on ``meta``, or fake while tracing."""
    return t.device.type != "meta" and not is_fake(t)


def _amax_of(per_tensor_scale: Optional[torch.Tensor]) -> str:
    """The amax behind a per-tensor scale, for ``repr``; no value while tracing or on meta."""
    if per_tensor_scale is None:
        return "None"
    if not _holds_values(per_tensor_scale):
        return "?"
    return f"{float(per_tensor_scale) * 448 * 6:.6g}"


implements = NVFP4StaticTensor.implements
implements_torch_function = NVFP4StaticTensor.implements_torch_function


def static_linear(
    x: torch.Tensor, weight: NVFP4StaticTensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``x @ weight.T + bias`` for any leading dims of ``x``, on the weight's backend;
    ``weight`` in its stored ``[N, K]`` orientation (the GEMM multiplies by its transpose only)."""
    if isinstance(x, NVFP4Tensor):
        raise NotImplementedError(
            "nvfp4_static: the activation must be a plain tensor; NVFP4StaticTensor quantizes it "
            "itself with its static activation scale"
        )
    if weight.is_transposed():
        raise ValueError(
            f"nvfp4_static: linear takes an NVFP4StaticTensor weight as [out_features, in_features]; "
            f"got its transpose, of shape {tuple(weight.shape)} (the NVFP4 GEMM computes x @ w.T of the "
            f"stored weight only: F.linear(x, w), or x @ w.t())"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"nvfp4_static: activation of shape {tuple(x.shape)} does not match weight of shape "
            f"{tuple(weight.shape)} (in_features {weight.shape[-1]})"
        )
    if x.device != weight.qdata.device:  # the inner tensor's device: the subclass's costs a dispatch
        raise ValueError(
            f"nvfp4_static: activation of shape {tuple(x.shape)} is on {x.device}, the NVFP4 weight of "
            f"shape {tuple(weight.shape)} on {weight.device}; move the input (or the model) so that both "
            f"are on one device"
        )
    if x.dtype not in SUPPORTED_DTYPES:  # with or without tokens, on every route
        raise ValueError(
            f"nvfp4_static: static NVFP4 linear of an activation {tuple(x.shape)}: activation "
            f"dtype {x.dtype} (float32, bfloat16 or float16)"
        )
    if x.numel() == 0:  # no tokens: the kernels have no rows to work on
        out = x.new_zeros(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.to(x.dtype)
    return linear_function(weight.linear_backend)(
        x,
        weight.qdata,
        weight.scale,
        weight.per_tensor_scale,
        weight.act_per_tensor_scale,
        bias,
        weight.output_scale,
    )


@implements_torch_function([torch.Tensor.share_memory_])
def _share_memory(func, types, args, kwargs):
    """Each inner tensor's memory moved to shared memory (``model.share_memory()``): torch's own
    form would share the storage of the wrapper, which has none."""
    weight = args[0]
    for name in weight.__tensor_flatten__()[0]:
        getattr(weight, name).share_memory_()
    return weight


@implements_torch_function([torch.Tensor.is_shared])
def _is_shared(func, types, args, kwargs):
    weight = args[0]
    return all(getattr(weight, name).is_shared() for name in weight.__tensor_flatten__()[0])


@implements_torch_function([torch.Tensor.storage])
def _storage(func, types, args, kwargs):
    raise RuntimeError(
        "nvfp4_static: an NVFP4StaticTensor is several tensors (packed values, block scales, "
        "global scales) with no single storage, so safetensors and transformers' "
        "save_pretrained cannot write it. To save a converted model: "
        "nvfp4_static.export_checkpoint(model, folder, format='compressed-tensors') writes a "
        "folder vLLM, SGLang and transformers load; torch.save(model.state_dict(), path) with "
        "nvfp4_static.load_quantized(model, path) round-trips it for this package"
    )


@implements_torch_function([torch.nn.functional.linear])
def _functional_linear(func, types, args, kwargs):
    x, weight, bias = fill_defaults(list(args), 3, [None])
    bias = kwargs.get("bias", bias)
    return static_linear(x, weight, bias)


@implements([aten.linear.default])
def _linear(func, types, args, kwargs):
    x, weight, bias = fill_defaults(list(args), 3, [None])
    return static_linear(x, weight, bias)


def _stored_weight(weight_t: NVFP4StaticTensor, op: str) -> NVFP4StaticTensor:
    """The stored weight of the ``w.t()`` that ``x @ w.t()`` (``mm``, ``matmul``, ``addmm``)
    multiplies by; a weight in its stored orientation would ask for ``x @ w``, which the GEMM
    cannot compute."""
    if not weight_t.is_transposed():
        raise ValueError(
            f"nvfp4_static: {op} multiplies by an NVFP4StaticTensor only as x @ w.t() (its transpose); "
            f"got it in its stored [out_features, in_features] orientation, of shape {tuple(weight_t.shape)}"
        )
    return weight_t.t()


@implements([aten.mm.default, aten.matmul.default])
def _mm_and_matmul(func, types, args, kwargs):
    x, weight_t = args[0], args[1]
    return static_linear(x, _stored_weight(weight_t, func.__name__.split(".")[0]), None)


@implements([aten.addmm.default])
def _addmm(func, types, args, kwargs):
    bias, x, weight_t = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1:
        raise NotImplementedError("nvfp4_static: addmm with beta/alpha other than 1")
    return static_linear(x, _stored_weight(weight_t, "addmm"), bias)


@implements([aten.clone.default])
def _clone(func, types, args, kwargs):
    """A copy of every inner tensor; a transposed weight is copied as its stored weight and
    transposed back: its packed values run along the stored rows."""
    old = args[0]
    if old.is_transposed():
        return _clone(func, types, (old.t(),), {}).t()
    scales = {
        name: None if getattr(old, name) is None else getattr(old, name).clone()
        for name in ("per_tensor_scale", "act_per_tensor_scale")
    }
    return old._rewrap(old.qdata.clone(), old.scale.clone(), **scales)


@implements_torch_function([torch.Tensor.contiguous])
def _contiguous(func, types, args, kwargs):
    """The weight itself where its inner tensors are contiguous; a transposed weight stays the
    transpose of its stored weight, made contiguous (its packed values cannot be laid out
    along the other dim)."""
    old = args[0]
    if old.is_transposed():
        return old.t().contiguous().t()
    return old._apply_fn_to_data(lambda inner: inner.contiguous())


@implements([aten.select.int])
def _select(func, types, args, kwargs):
    raise NotImplementedError(
        f"nvfp4_static: an NVFP4StaticTensor of shape {tuple(args[0].shape)} cannot be indexed down to one "
        f"dim (its codes are packed along the last): slice it instead, e.g. w[i : i + 1]"
    )


@implements([aten.t.default])
def _t(func, types, args, kwargs):
    old = args[0]
    return old._rewrap(old.qdata.t(), old.scale.t())


@implements([aten.transpose.int])
def _transpose(func, types, args, kwargs):
    old, dim0, dim1 = args
    if {dim0 % old.dim(), dim1 % old.dim()} != {old.dim() - 2, old.dim() - 1}:
        raise NotImplementedError(
            f"nvfp4_static: only the last two dims of an NVFP4 tensor can be transposed, got "
            f"({dim0}, {dim1}) for shape {tuple(old.shape)}"
        )
    return old._rewrap(old.qdata.transpose(dim0, dim1), old.scale.transpose(dim0, dim1))


@implements([aten.view.default])
def _view(func, types, args, kwargs):
    old, size = args[0], list(args[1])
    if len(size) < 2 or size[-1] != old.shape[-1]:
        raise NotImplementedError(
            f"nvfp4_static: a view of an NVFP4 tensor must keep its last dim "
            f"({old.shape[-1]}), got {size} for shape {tuple(old.shape)}"
        )
    packed_size = size[:-1] + [old.qdata.shape[-1]]
    scale_size = size[:-1] + [old.scale.shape[-1]]
    return old._rewrap(old.qdata.view(packed_size), old.scale.view(scale_size))


@implements([aten.slice.Tensor])
def _slice(func, types, args, kwargs):
    old, dim, start, end, step = fill_defaults(list(args), 5, [0, None, None, 1])
    if old.dim() != 2 or step != 1 or old.qdata.stride(-2) < old.qdata.stride(-1):
        raise NotImplementedError(
            "nvfp4_static: only step-1 slices of a 2D, untransposed NVFP4 tensor are supported"
        )
    dim = dim % 2
    size = old.shape[dim]
    start = 0 if start is None else min(start, size)
    end = size if end is None else min(end, size)
    if dim == 0:
        new = old._rewrap(old.qdata[start:end], old.scale[start:end])
    else:
        if start % BLOCK_SIZE or (end % BLOCK_SIZE and end != size):
            raise ValueError(
                f"nvfp4_static: slicing the last dim of an NVFP4 tensor needs bounds that are "
                f"multiples of {BLOCK_SIZE}, got [{start}:{end}] for shape {tuple(old.shape)}"
            )
        new = old._rewrap(
            old.qdata[:, start // 2 : end // 2],
            old.scale[:, start // BLOCK_SIZE : end // BLOCK_SIZE],
        )
    return return_and_correct_aliasing(func, args, kwargs, new)


@implements([aten._to_copy.default])
def _to_copy(func, types, args, kwargs):
    old = args[0]
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise UnpresentableDtypeError(dtype)

    def move(t):
        return None if t is None or device is None else t.to(device)

    new = old._rewrap(
        move(old.qdata) if device is not None else old.qdata,
        move(old.scale) if device is not None else old.scale,
        orig_dtype=dtype or old.orig_dtype,
        per_tensor_scale=move(old.per_tensor_scale) if device is not None else old.per_tensor_scale,
        act_per_tensor_scale=(
            move(old.act_per_tensor_scale) if device is not None else old.act_per_tensor_scale
        ),
    )
    return return_and_correct_aliasing(func, args, {}, new)


@implements([aten._pin_memory.default])
def _pin_memory(func, types, args, kwargs):
    old = args[0]
    return old._rewrap(
        old.qdata.pin_memory(),
        old.scale.pin_memory(),
        per_tensor_scale=old.per_tensor_scale.pin_memory(),
        act_per_tensor_scale=old.act_per_tensor_scale.pin_memory(),
    )


def _check_layout(block_size: int, is_swizzled_scales: bool) -> None:
    """Refuse a layout that torchao's ``NVFP4Tensor`` allows but the backends here do not read:
    they take 16-element blocks and row-major ``[N, K/16]`` block scales, and would misread any
    other with no error."""
    if block_size != BLOCK_SIZE:
        raise ValueError(
            f"nvfp4_static: an NVFP4StaticTensor has {BLOCK_SIZE}-element blocks, got block_size={block_size}"
        )
    if is_swizzled_scales:
        raise ValueError(
            "nvfp4_static: an NVFP4StaticTensor keeps its FP8 block scales row-major [N, K/16], got "
            "is_swizzled_scales=True (the blocked layout of torchao's FP4 _scaled_mm): unswizzle them first"
        )


def _check_data(qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype) -> None:
    """Refuse packed codes and block scales that do not describe one weight: the backends would
    misread them (another scale format), or fail deep in a kernel (shapes that do not match).
    Every rebuild of a weight runs it (an unwrapped model's, at each call), so it stays cheap."""
    codes, scales = qdata.shape, scale.shape
    shapes_fit = len(codes) == len(scales) >= 2 and (
        _fits_packed_along(codes, scales, -1) or _fits_packed_along(codes, scales, -2)
    )
    if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or not shapes_fit:
        raise ValueError(
            f"nvfp4_static: an NVFP4StaticTensor holds uint8 codes [N, K/2] and float8_e4m3fn block scales "
            f"[N, K/16]; got codes {list(qdata.shape)} {qdata.dtype} and scales {list(scale.shape)} {scale.dtype}"
        )
    if orig_dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"nvfp4_static: an NVFP4StaticTensor stands for a weight of dtype "
            f"{', '.join(map(str, SUPPORTED_DTYPES))}; got orig_dtype={orig_dtype}"
        )


def _check_global_scales(per_tensor_scale, act_per_tensor_scale) -> None:
    """Refuse global scales that are not one-element tensors: the weight's and the activation's
    scale are what makes the tensor static, and every route reads both."""
    for name, value in (("per_tensor_scale", per_tensor_scale), ("act_per_tensor_scale", act_per_tensor_scale)):
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"nvfp4_static: an NVFP4StaticTensor holds its {name} as a one-element float32 "
                f"tensor (a static weight needs both global scales); got {got}"
            )


def _fits_packed_along(codes_shape: torch.Size, scales_shape: torch.Size, packed: int) -> bool:
    """Whether codes and block scales of these shapes fit codes packed along dim ``packed`` (-1
    stored, -2 transposed): 8 bytes of codes per block scale there, the same size elsewhere."""
    codes, scales = list(codes_shape), list(scales_shape)
    if codes[packed] != scales[packed] * (BLOCK_SIZE // 2):
        return False
    del codes[packed], scales[packed]
    return codes == scales


# Called with (destination, source) before ``copy_`` writes into an NVFP4StaticTensor, once the
# copy is known to fit, by what shares a weight's tensors with other weights: it may give the
# destination tensors of its own first (``sibling_linears``).
BEFORE_COPY: list = []


def copy_refusal(dst: "NVFP4StaticTensor", src) -> Optional[str]:
    """Why ``dst.copy_(src)`` refuses ``src``, None where it copies: ``src`` must be an
    NVFP4StaticTensor whose four tensors have ``dst``'s shapes, with uint8 codes and FP8 block
    scales (checked when one is made, but not when ``torch.load`` restores one). Loading checks
    it for every layer before copying into any: ``copy_`` copies the four one by one."""
    if not isinstance(src, NVFP4StaticTensor):
        return (
            f"a {type(src).__name__} cannot be copied into an NVFP4StaticTensor: the checkpoint and "
            f"the model disagree on which layers are quantized. Load an NVFP4 checkpoint into a model "
            f"prepared with step='prepare_for_loading', and a float checkpoint into a float model."
        )
    for name in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
        ours, theirs = getattr(dst, name), getattr(src, name)
        if ours.shape != theirs.shape:
            return f"the NVFP4 weight's {name} has shape {tuple(theirs.shape)}, the model's {tuple(ours.shape)}"
    # Copied, codes or block scales of another dtype would be converted as numbers.
    for name, dtype in (("qdata", torch.uint8), ("scale", torch.float8_e4m3fn)):
        if getattr(src, name).dtype != dtype:
            return f"the NVFP4 weight's {name} is {getattr(src, name).dtype}, not {dtype}"
    return None


@implements([aten.copy_.default])
def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, NVFP4StaticTensor):
        raise ValueError(
            f"nvfp4_static: cannot copy an NVFP4StaticTensor into a {type(dst).__name__}: the checkpoint "
            f"and the model disagree on which layers are quantized. Load an NVFP4 checkpoint into a "
            f"model prepared with step='prepare_for_loading', and a float checkpoint into a float model."
        )
    refusal = copy_refusal(dst, src)
    if refusal is not None:
        raise ValueError(f"nvfp4_static: cannot copy into an NVFP4 weight of shape {tuple(dst.shape)}: {refusal}")
    for before_copy in BEFORE_COPY:
        before_copy(dst, src)
    for name in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
        getattr(dst, name).copy_(getattr(src, name))
    dst.output_scale = host_scale_product(dst.act_per_tensor_scale, dst.per_tensor_scale)
    return dst


torch.serialization.add_safe_globals([NVFP4StaticTensor])

# ``__tensor_flatten__``'s cache, in the tensor's ``__dict__``, and the fields it is computed from.
_FLATTENED = "_flattened"
_FLATTENED_FIELDS = frozenset(
    NVFP4StaticTensor.tensor_data_names
    + NVFP4StaticTensor.optional_tensor_data_names
    + NVFP4StaticTensor.tensor_attribute_names
    + NVFP4StaticTensor.optional_tensor_attribute_names
) - set(_HOST_ONLY)
