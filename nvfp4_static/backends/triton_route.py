"""The Triton route of the static NVFP4 linear: CUDA GPUs without FP4 tensor cores (Hopper, Ampere).

Two steps: the activation is quantized under its static global scale and written as the GEMM
operand ``q * s_b`` (the op ``gemm_activation_operand``, kernel in ``kernels.act_quantize``), then
the GEMM reads the packed weight, dequantizes it and applies both global scales and the bias in
its epilogue (the op ``nvfp4_gemm``, kernel in ``kernels.gemm``;
at large M cuBLAS does the product, with the epilogue fused where ``output_scale`` is known:
eagerly, never in a traced graph).
At the smallest decode sizes the GEMM quantizes the activation itself: one launch (at one row
always, the Hopper decode tile too where each of its programs runs one K split; at 2-16 rows on
eager calls, whose time is their host's, ``gemm.quantizes_eagerly``). Traced, where the table runs
the Hopper decode tile, the two steps are one op (``decode_linear_partial_products``) that
launches the GEMM to overlap the quantize kernel, as the eager route does, or at one row the
decode tile quantizing the row itself.
Numerically this is ``backends.cpu`` up to the order of fp32 sums.
Non-CUDA tensors take the ``cpu`` route.

The token count M picks the GEMM's tiles (``kernels.gemm.GEMM_CONFIGS``). Eagerly that is a
Python branch; under ``torch.compile`` it is a ``torch.cond`` per table boundary, so a graph
compiled for a dynamic M holds every bucket's kernels and serves any M without recompiling.
"""

import warnings
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from nvfp4_static.backends import cpu
from nvfp4_static.kernels import gemm_warp_specialized
from nvfp4_static.kernels.gemm import (
    DECODE_TILE,
    GEMM_CONFIGS,
    activation_operand_dtype,
    config_for_width,
    epilogue_as_ops,
    gemm_bucket,
    is_decode_tile,
    operand_config,
    operand_in_mma_order,
    quantizes_activation_in_gemm,
    quantizes_eagerly,
    split_k_for,
)
from nvfp4_static.kernels.ops import (
    decode_linear_partial_products,
    gemm_activation_operand,
    nvfp4_gemm,
    quantizing_nvfp4_gemm,
    runs_eagerly,
)


def static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    output_scale: Optional[float] = None,
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` with ``x`` quantized to NVFP4 under its static global scale;
    same arguments and result as ``backends.cpu.static_nvfp4_linear``."""
    weights = (weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale)
    if x.device.type != "cuda":
        return cpu.static_nvfp4_linear(x, *weights, bias)
    if runs_eagerly(x):
        return _linear_in_bucket(gemm_bucket(_rows(x)), output_scale, x, weights, bias)
    return _linear_branching_on_m(output_scale, x, weights, bias)


def _rows(x: torch.Tensor):
    """M: the rows of ``x`` flattened to ``[M, K]``."""
    return x.numel() // x.shape[-1]


def _linear_in_bucket(
    bucket: int,
    output_scale: Optional[float],
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """The linear with the tiles of ``GEMM_CONFIGS[bucket]``, whatever M is; ``x [..., K]``,
    ``weights`` as ``static_nvfp4_linear`` takes them (qdata, block scales, weight and
    activation global scales)."""
    weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale = weights
    leading_shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    traced = not runs_eagerly(x)
    config = operand_config(bucket, weight_qdata.shape[-2], 2 * weight_qdata.shape[-1], x.device, traced)
    if is_decode_tile(config) and traced and gemm_warp_specialized.available(x.device):
        out = _decode_tile_linear_traced(x, weights, bias)
    elif quantizes_activation_in_gemm(config) or (
        not traced and quantizes_eagerly(x.shape[0], x.dtype, config, x.device)
    ):
        out = quantizing_nvfp4_gemm(
            x, weight_qdata, weight_block_scales, act_per_tensor_scale, weight_per_tensor_scale, bias, bucket
        )
    else:
        operand = gemm_activation_operand(
            x,
            act_per_tensor_scale,
            activation_operand_dtype(config, x.dtype, output_scale, bias),
            operand_in_mma_order(config),
        )
        out = nvfp4_gemm(
            operand,
            weight_qdata,
            weight_block_scales,
            act_per_tensor_scale,
            weight_per_tensor_scale,
            bias,
            x.dtype,
            output_scale,
            bucket,
        )
    return out.reshape(*leading_shape, out.shape[-1])


def _decode_tile_linear_traced(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """Traced, the decode tile's linear of ``x [M, K]``: the activation's quantize kernel and the
    decode tile as one op (``decode_linear_partial_products``, which starts the GEMM while the
    quantize kernel runs, as the eager route does; at one row the decode tile quantizes the row
    itself, one split per program), then the K splits' sum, both global scales
    and the bias as the torch ops ``nvfp4_gemm`` traces for this tile (``epilogue_as_ops``: the
    same output), which Inductor fuses into the kernel reading the output."""
    weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale = weights
    N, K = weight_qdata.shape[0], 2 * weight_qdata.shape[1]
    split_k = split_k_for(config_for_width(DECODE_TILE, K), N, K, x.device)
    act_scale = act_per_tensor_scale.to(torch.float32).reshape(1)
    weight_scale = weight_per_tensor_scale.to(torch.float32).reshape(1)
    codes = weight_block_scales.contiguous().view(torch.uint8)
    partials = decode_linear_partial_products(x, act_scale, weight_qdata.contiguous(), codes, split_k)
    return epilogue_as_ops(partials, act_scale, weight_scale, bias).to(x.dtype)


def _linear_branching_on_m(
    output_scale: Optional[float], x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """Under tracing: a tree of ``cond`` on M over the table's buckets, each leaf one bucket's
    ``_linear_in_bucket``. With a symbolic M the graph keeps every branch and picks one per call,
    with no guard on M; with a static M the branch is taken while tracing. ``cond`` takes
    tensors only, so a missing bias leaves the operands rather than passing None; each branch
    returns a 1-tuple, the form torch 2.11's Inductor lowers (a bare tensor it misreads). ``x``
    enters the branches unflattened: a branch can then name each of its leading sizes, where the
    flattened M (their product) would leave torch 2.11's Inductor unable to define them."""
    operands = (x, *weights) + (() if bias is None else (bias,))

    def leaf(bucket: int):
        def linear(x, *weights_and_maybe_bias):
            bias = weights_and_maybe_bias[4] if len(weights_and_maybe_bias) > 4 else None
            return (_linear_in_bucket(bucket, output_scale, x, weights_and_maybe_bias[:4], bias),)

        return linear

    def tree(buckets: range):
        if len(buckets) == 1:
            return leaf(buckets[0])
        half = len(buckets) // 2
        lower, upper = tree(buckets[:half]), tree(buckets[half:])
        largest_lower_m = GEMM_CONFIGS[buckets[half] - 1][0]

        def branch(*operands):
            lower_holds_m = _rows(operands[0]) <= largest_lower_m
            if not torch.compiler.is_dynamo_compiling():
                # Outside dynamo (a tensor subclass's linear runs while AOTAutograd traces) a
                # static M, or a symbolic one whose range decides, takes its branch now rather
                # than tracing one that cannot run (dynamo makes every symbolic size >= 2, so a
                # symbolic M never takes the M = 1 bucket).
                if statically_known_true(lower_holds_m):
                    return lower(*operands)
                if statically_known_true(torch.sym_not(lower_holds_m)):
                    return upper(*operands)
            # The operator rather than torch.cond: outside dynamo, torch.cond would compile its
            # branches with dynamo, which turns the closures' ints into graph inputs that torch
            # 2.11's Inductor refuses.
            return torch.ops.higher_order.cond(lower_holds_m, lower, upper, operands)

        return branch

    # Under dynamo a static M makes each predicate a constant, for which dynamo warns that the
    # cond takes one branch: expected here.
    with warnings.catch_warnings(record=True):
        (out,) = tree(range(len(GEMM_CONFIGS)))(*operands)
    return out
