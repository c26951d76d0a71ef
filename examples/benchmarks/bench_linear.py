"""One static NVFP4 linear on the Triton route against bf16 ``F.linear`` and the naive emulation.

For each weight shape (K, N) and token count M, in one run on one GPU:

- ``bf16``: ``F.linear`` with the bf16 weight (cuBLAS), the baseline;
- ``ours``: ``backends.triton_route.static_nvfp4_linear`` eagerly, given the host copy of the scale
  product that an ``NVFP4StaticTensor`` carries (at M > 64 cuBLAS then applies scale and bias);
  ``no alpha`` the same call without it (fp32 product + Triton epilogue), as the baseline of that
  change;
- ``api``: the same through the public API, ``F.linear`` on an ``NVFP4StaticTensor`` weight,
  eager and compiled (fullgraph, dynamic);
- ``layer``: the converted layer (``NVFP4StaticLinear``) called eagerly, which replays the
  route's recorded launches (``backends.triton_eager``) from its second call of a shape;
- ``naive``: dequantize the weight to bf16, quantize-dequantize the activation, ``F.linear``, compiled;
- ``read``: one Triton kernel that only reads the packed weight and its scales, in a CUDA graph
  (the fastest of 15 launch shapes): the floor of any linear that streams the weight, timed
  the way ``graph`` is.

Every time is a triton.testing.do_bench median (which flushes L2 between runs, so the weight
streams from DRAM). Eager and compiled calls also pay Python launch overhead, which at decode
sizes exceeds the GPU time, so ``bf16 graph``, ``graph`` and ``no alpha`` time the bf16 and
eager-ours calls captured in a CUDA graph (GPU time alone, as a served model would run them). The last
columns compare those two: bf16 over ours as a speedup, and the weight-streaming rate ours
achieves (packed weight + scales bytes / time) as a share of a device-to-device copy measured
in the same run. With ``--rounds R`` each cell is the median of R rounds, every column timed
once per round, for differences of a few percent. Run:

    python examples/benchmarks/bench_linear.py [--m 1 16 64 512 4096] [--rounds 1]
"""

import argparse
import statistics
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.numerics import dequantize_nvfp4, fake_quantize_nvfp4, per_tensor_amax_to_scale, quantize_nvfp4
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.tensor import NVFP4StaticTensor

SHAPES = [(8192, 8192), (4096, 14336), (14336, 4096)]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * source.numel() / ms / 1e6


def captured(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one call outside it (Triton compiles, cuBLAS
    picks its kernels, workspaces are made). A linear captured into a graph may take other
    tiles than one called outside it (``gemm.captured_into_a_graph``); their kernels are then
    compiled, and their workspaces made, while capturing."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn) -> float:
    """Median GPU time of ``fn`` replayed from a CUDA graph (L2 flushed before each replay)."""
    return do_bench(captured(fn).replay, return_mode="median")


def naive_linear(x, weight_qdata, weight_block_scales, weight_scale, act_scale, bias):
    """The emulation one would write first: everything back to bf16, then cuBLAS."""
    weight = dequantize_nvfp4(weight_qdata, weight_block_scales, weight_scale, torch.bfloat16)
    return F.linear(fake_quantize_nvfp4(x, act_scale), weight, bias)


@triton.jit
def _read_kernel(words_ptr, n_words, side_ptr, n_side, total_ptr, BLOCK: tl.constexpr, SIDE_BLOCK: tl.constexpr):
    """Sum ``BLOCK`` int32 words of one buffer and ``SIDE_BLOCK`` of a second: every byte is
    loaded once and almost nothing else is done."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_side = tl.program_id(0) * SIDE_BLOCK + tl.arange(0, SIDE_BLOCK)
    total = tl.sum(tl.load(words_ptr + offs, mask=offs < n_words, other=0))
    total += tl.sum(tl.load(side_ptr + offs_side, mask=offs_side < n_side, other=0))
    tl.atomic_add(total_ptr, total)


def bare_read_ms(timer, tensor: torch.Tensor, side: Optional[torch.Tensor] = None) -> float:
    """The least time ``timer`` (``graph_ms`` or ``do_bench``) gives for reading ``tensor`` (and
    ``side``, e.g. a weight's scales) once in one kernel, over 15 launch shapes (1024-16384 words
    and 4-16 warps per program): the floor of any kernel that must read those bytes."""
    words = tensor.reshape(-1).view(torch.uint8).view(torch.int32)
    side_words = words[:0] if side is None else side.reshape(-1).view(torch.uint8).view(torch.int32)
    total = torch.zeros((), dtype=torch.int32, device=tensor.device)
    best = float("inf")
    for block in (1024, 2048, 4096, 8192, 16384):
        programs = triton.cdiv(words.numel(), block)
        side_block = max(1, triton.next_power_of_2(triton.cdiv(side_words.numel(), programs)))
        for num_warps in (4, 8, 16):
            launch = lambda: _read_kernel[(programs,)](  # noqa: E731
                words, words.numel(), side_words, side_words.numel(), total,
                BLOCK=block, SIDE_BLOCK=side_block, num_warps=num_warps,
            )
            best = min(best, timer(launch))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per cell (median)")
    args = parser.parse_args()
    torch.manual_seed(0)
    # One graph per weight shape and function, and M = 1 on its own: more than dynamo's default
    # of 8 recompiles.
    torch._dynamo.config.recompile_limit = 64
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, device-to-device copy {copy_gbs:.0f} GB/s")

    api_compiled = torch.compile(F.linear, fullgraph=True, dynamic=True)
    naive_compiled = torch.compile(naive_linear, fullgraph=True, dynamic=True)

    names = ["bf16", "bf16 graph", "eager", "graph", "no alpha", "compiled", "api", "layer", "naive", "read"]
    header = f"{'K':>6} {'N':>6} {'M':>5} | " + " ".join(f"{name:>10}" for name in names) + " (ms)"
    print(header + f" | {'bf16/ours':>9} {'weight GB/s':>11} {'of copy':>7}")
    with torch.no_grad():
        for K, N in SHAPES:
            weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            act_amax = torch.tensor(4.0, device="cuda")
            weight_scale = per_tensor_amax_to_scale(weight.abs().amax().float())
            act_scale = per_tensor_amax_to_scale(act_amax)
            weight_qdata, weight_block_scales = quantize_nvfp4(weight, weight_scale)
            operands = (weight_qdata, weight_block_scales, weight_scale, act_scale, bias)
            api_weight = NVFP4StaticTensor.from_float(weight, act_amax, backend_override="triton")
            output_scale = api_weight.output_scale
            layer = NVFP4StaticLinear(api_weight, torch.nn.Parameter(bias), recipe={}, layer_name="bench")
            weight_bytes = weight_qdata.numel() + weight_block_scales.numel()
            read_ms = bare_read_ms(graph_ms, weight_qdata, weight_block_scales)
            for M in args.m:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ours = lambda: static_nvfp4_linear(x, *operands, output_scale)  # noqa: E731
                bf16 = lambda: F.linear(x, weight, bias)  # noqa: E731
                timers = {
                    "bf16": lambda: do_bench(bf16, return_mode="median"),
                    "bf16 graph": lambda: graph_ms(bf16),
                    "eager": lambda: do_bench(ours, return_mode="median"),
                    "graph": lambda: graph_ms(ours),
                    "no alpha": lambda: graph_ms(lambda: static_nvfp4_linear(x, *operands)),
                    "compiled": lambda: do_bench(lambda: api_compiled(x, api_weight, bias), return_mode="median"),
                    "api": lambda: do_bench(lambda: F.linear(x, api_weight, bias), return_mode="median"),
                    "layer": lambda: do_bench(lambda: layer(x), return_mode="median"),
                    "naive": lambda: do_bench(lambda: naive_compiled(x, *operands), return_mode="median"),
                }
                rounds = [{name: timer() for name, timer in timers.items()} for _ in range(args.rounds)]
                ms = {name: statistics.median(times[name] for times in rounds) for name in timers}
                ms["read"] = read_ms
                weight_gbs = weight_bytes / ms["graph"] / 1e6
                print(
                    f"{K:>6} {N:>6} {M:>5} | " + " ".join(f"{ms[name]:10.4f}" for name in names) + "      | "
                    f"{ms['bf16 graph'] / ms['graph']:9.2f} {weight_gbs:11.0f} {weight_gbs / copy_gbs:7.0%}"
                )


if __name__ == "__main__":
    main()
