"""A whole transformer block, compiled: bf16 vs NVFP4 static (W4A4) at decode and prefill sizes.

The block is Llama-shaped (dim 4096, 32 heads, SwiGLU MLP 14336): seven linears dominate its
time at decode, where our weights stream 3.6x fewer bytes than bf16's. Run on one GPU:

    python examples/benchmarks/bench_block.py [--tokens 1 16 64 4096]

Prints, per token count, the compiled bf16 and compiled NVFP4 times (backend chosen for the
device) and their ratio, all measured in the same run: once as called from Python
(``do_bench``: host overhead included), once as the calling thread's CPU time per call (the
host's own work, which wall time on a shared host inflates by up to 2x between runs), and once
replayed from a CUDA graph (GPU time, as a serving loop under CUDA graphs sees it).
``unwrapped`` is the NVFP4 block after torchao's ``unwrap_tensor_subclass`` (each weight held as
plain tensors that a parametrization rebuilds inside the graph), so the compiled call does not
flatten five weight subclasses on every call.
"""

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torchao.quantization import quantize_
from torchao.utils import unwrap_tensor_subclass
from triton.testing import do_bench

from bench_linear import graph_ms
from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable


class SwiGLUBlock(torch.nn.Module):
    """Pre-norm attention + SwiGLU MLP; inputs are ``[batch, seq, dim]``."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, dim))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def decode_or_prefill_input(tokens: int, dim: int) -> torch.Tensor:
    """Decode: ``tokens`` sequences of one token; prefill (> 64 tokens): one long sequence."""
    shape = (tokens, 1, dim) if tokens <= 64 else (1, tokens, dim)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def bf16_and_converted_blocks(dim: int, heads: int, hidden: int) -> tuple[SwiGLUBlock, SwiGLUBlock]:
    """A seeded bf16 block on the GPU, and a copy converted to NVFP4 static (max-calibrated
    weights: the timing does not depend on the scales) after one 256-token calibration batch."""
    torch.manual_seed(0)
    block = SwiGLUBlock(dim, heads, hidden).cuda().to(torch.bfloat16)
    quantized = copy.deepcopy(block)
    quantize_(
        quantized, NVFP4StaticActivationConfig(step="prepare", weight_scale="max"), filter_fn=is_quantizable
    )
    with torch.no_grad():
        quantized(decode_or_prefill_input(256, dim))
    quantize_(
        quantized, NVFP4StaticActivationConfig(step="convert", weight_scale="max"), filter_fn=is_quantizable
    )
    return block, quantized


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 4096])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=14336)
    args = parser.parse_args()

    block, quantized = bf16_and_converted_blocks(args.dim, args.heads, args.hidden)
    backend = quantized.qkv.weight.linear_backend
    unwrapped = unwrap_tensor_subclass(copy.deepcopy(quantized))

    # The default dynamic setting, as a user compiles: the token count turns dynamic after the
    # first recompile while the hidden sizes stay static. The three blocks share one forward
    # code object, whose graphs dynamo counts together (about three per block: one token, the
    # dynamic decode sizes, a prefill batch of one), beyond its default limit of 8.
    torch._dynamo.config.recompile_limit = 32
    compiled_bf16 = torch.compile(block, fullgraph=True)
    compiled_nvfp4 = torch.compile(quantized, fullgraph=True)
    compiled_unwrapped = torch.compile(unwrapped, fullgraph=True)
    print(f"device: {torch.cuda.get_device_name()}, nvfp4 backend: {backend}")
    print(
        f"{'tokens':>7} {'timing':>8} {'bf16 ms':>9} {'nvfp4 ms':>9} {'bf16/nvfp4':>10} "
        f"{'unwrapped ms':>12} {'bf16/unwrapped':>14}"
    )
    with torch.no_grad():
        for tokens in args.tokens:
            x = decode_or_prefill_input(tokens, args.dim)
            if not torch.equal(compiled_unwrapped(x), compiled_nvfp4(x)):
                raise AssertionError(f"unwrapped weights changed the block's output at {tokens} tokens")
            for timing, timer in [("python", _python_ms), ("host cpu", _host_cpu_ms), ("graph", graph_ms)]:
                bf16_ms = timer(lambda: compiled_bf16(x))
                nvfp4_ms = timer(lambda: compiled_nvfp4(x))
                unwrapped_ms = timer(lambda: compiled_unwrapped(x))
                print(
                    f"{tokens:>7} {timing:>8} {bf16_ms:>9.4f} {nvfp4_ms:>9.4f} {bf16_ms / nvfp4_ms:>10.2f} "
                    f"{unwrapped_ms:>12.4f} {bf16_ms / unwrapped_ms:>14.2f}"
                )


def _python_ms(fn) -> float:
    """Host-bound calls vary with the host's other work: the best of five medians."""
    return min(do_bench(fn, return_mode="median") for _ in range(5))


def _host_cpu_ms(fn, calls: int = 200) -> float:
    """The calling thread's CPU time per call, best of three runs of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return best


if __name__ == "__main__":
    main()
