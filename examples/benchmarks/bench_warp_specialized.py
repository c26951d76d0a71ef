"""The tall 256 x 128 tile's GEMM, Triton against the warp-specialized Gluon kernel (Hopper).

For each weight shape and M: bf16 ``F.linear``, the table's route for M (``static_nvfp4_linear``:
the activation operand kernel, then the table's GEMM), and the same operand kernel followed by
the tall tile in Triton (``gemm.TALL_TILE_IN_TRITON``) and warp-specialized
(``gemm.TALL_TILE``, what the table runs on Hopper), each replayed from a CUDA graph (GPU time, ms); then the
warp-specialized route timed from Python (host work included). The warp-specialized output is
checked equal to the Triton tile's, bit for bit, before it is timed.

Usage: python bench_warp_specialized.py [--m 200 256 384 512 1024 2048]
"""

import argparse

import torch
import torch.nn.functional as F
from bench_linear import graph_ms
from triton.testing import do_bench
from tune_gemm import make_weight

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm, gemm_activation_operand
from nvfp4_static.kernels.gemm import TALL_TILE, TALL_TILE_IN_TRITON


def tall_tile_route(x, weight, act_scale, config):
    """The operand kernel, then ``config``'s GEMM (what the table runs where it takes the tile)."""

    def run():
        operand = gemm_activation_operand(x, act_scale, mma_order=True)
        out = torch.empty((x.shape[0], weight.qdata.shape[0]), dtype=x.dtype, device=x.device)
        gemm.launch_nvfp4_gemm(operand, weight.qdata, weight.block_scales, act_scale, weight.scale, weight.bias, out, config)
        return out

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[200, 256, 384, 512, 1024, 2048])
    args = parser.parse_args()
    if not gemm.gemm_warp_specialized.available(torch.device("cuda")):
        raise SystemExit("bench_warp_specialized: needs a Hopper GPU and a Triton with Gluon's Hopper API")
    print(f"device: {torch.cuda.get_device_name()}")
    header = "     K      N     M |   bf16   table  triton      ws  ws python | bf16/table bf16/triton bf16/ws"
    print(header)
    for K, N in [(8192, 8192), (4096, 14336), (14336, 4096)]:
        weight = make_weight(K, N)
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            output_scale = float(act_scale * weight.scale)
            triton_tile = tall_tile_route(x, weight, act_scale, TALL_TILE_IN_TRITON)
            warp_specialized = tall_tile_route(x, weight, act_scale, TALL_TILE)
            if not torch.equal(triton_tile(), warp_specialized()):
                raise SystemExit(f"bench_warp_specialized: outputs differ at {K} x {N}, M = {M}")
            bf16 = graph_ms(lambda: F.linear(x, weight.bf16, weight.bias))
            table = graph_ms(
                lambda: static_nvfp4_linear(
                    x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
                )
            )
            triton_ms = graph_ms(triton_tile)
            ws_ms = graph_ms(warp_specialized)
            ws_python = do_bench(warp_specialized, return_mode="median")
            print(
                f"{K:6d} {N:6d} {M:5d} | {bf16:.4f} {table:.4f} {triton_ms:.4f} {ws_ms:.4f} {ws_python:9.4f} | "
                f"{bf16 / table:10.2f} {bf16 / triton_ms:11.2f} {bf16 / ws_ms:7.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
