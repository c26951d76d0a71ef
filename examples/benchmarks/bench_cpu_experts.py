"""A mixture-of-experts layer's grouped NVFP4 GEMM on a CPU against each expert called alone.

    python examples/benchmarks/bench_cpu_experts.py [--experts 32] [--top-k 8] [--tokens 1 16] [--shapes 2048x1536 768x2048]

For each expert weight shape (K x N, every expert its own weight and global scales) and token
count, the routed rows sorted by expert (each token to ``--top-k`` distinct experts, drawn at
random), wall time per call (ms) of: bfloat16 ``F.linear`` on each expert's rows (the float
baseline), ``backends.cpu.grouped_static_nvfp4_linear`` (``grouped``: the stacked operands checked
once, each expert's kernel call by address), and ``static_nvfp4_linear`` on each expert's rows in
turn (``alone``: every call checks and converts its operands, as each expert's own layer would).
Before timing the two NVFP4 outputs are checked to be equal bit for bit. Each cell is the best of
``--rounds`` interleaved rounds; the last columns are grouped's time over the float baseline's and
over alone's. The default shapes are a Qwen3-30B-A3B-sized expert's gate/up (2048 -> 2 x 768) and
down (768 -> 2048).
"""

import argparse

import torch
import torch.nn.functional as F
from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

from bench_cpu_linear import best_of_rounds
from nvfp4_static.backends import cpu, cpu_kernel
from nvfp4_static.numerics import quantize_nvfp4


def stacked_experts(experts: int, k: int, n: int, generator: torch.Generator):
    """Float weights ``[E, N, K]`` (bfloat16) and their NVFP4 stacks, each expert's own scales."""
    weights = torch.randn(experts, n, k, generator=generator)
    scales = torch.stack([per_tensor_amax_to_scale(w.abs().max()) for w in weights])
    packed = [quantize_nvfp4(w, s) for w, s in zip(weights, scales)]
    qdata = torch.stack([codes for codes, _ in packed])
    block_scales = torch.stack([block for _, block in packed])
    return weights.to(torch.bfloat16), qdata, block_scales, scales.reshape(experts)


def routed_rows(tokens: int, experts: int, top_k: int, k: int, generator: torch.Generator):
    """Each token's hidden state once per expert it goes to, sorted by expert, and the offsets."""
    choices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    expert_of_row, pair_of_row = choices.flatten().sort(stable=True)  # pair = token * top_k + slot
    hidden = torch.randn(tokens, k, generator=generator).to(torch.bfloat16)
    counts = torch.bincount(expert_of_row, minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    return hidden[pair_of_row // top_k], offsets


def each_expert(x, offsets, linear) -> torch.Tensor:
    """``linear(rows, expert)`` on each expert's rows, into one output."""
    bounds = offsets.tolist()
    parts = [linear(x[first:end], e) for e, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])) if end > first]
    return torch.cat(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shapes", nargs="+", default=["2048x1536", "768x2048"], help="K x N expert shapes")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.top_k <= args.experts:
        parser.error(f"--top-k must be in 1..--experts ({args.experts}), got {args.top_k}")
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernel is not built (see the warning above): nothing to compare")
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.experts} experts, top {args.top_k}")
    names = ("bf16", "grouped", "alone")
    print(f"{'K':>5} {'N':>5} {'tokens':>6} | " + " ".join(f"{name:>9}" for name in names)
          + " (ms) | grouped/bf16 | grouped/alone")
    with torch.no_grad():
        for shape in args.shapes:
            k, n = (int(size) for size in shape.split("x"))
            weights, qdata, block_scales, weight_scales = stacked_experts(args.experts, k, n, generator)
            act_scales = torch.full((args.experts,), 4.0 / (448 * 6))
            for tokens in args.tokens:
                x, offsets = routed_rows(tokens, args.experts, args.top_k, k, generator)
                stacks = (qdata, block_scales, weight_scales, act_scales)
                calls = {
                    "bf16": lambda: each_expert(x, offsets, lambda rows, e: F.linear(rows, weights[e])),
                    "grouped": lambda: cpu.grouped_static_nvfp4_linear(x, offsets, *stacks),
                    "alone": lambda: each_expert(
                        x, offsets,
                        lambda rows, e: cpu.static_nvfp4_linear(rows, *(stack[e] for stack in stacks), None),
                    ),
                }
                if not torch.equal(calls["grouped"](), calls["alone"]()):
                    raise AssertionError(f"{k} x {n}, {tokens} tokens: the grouped output differs from the experts' own")
                best = best_of_rounds(calls, args.rounds)
                cells = " ".join(f"{best[name] * 1e3:9.3f}" for name in names)
                print(f"{k:>5} {n:>5} {tokens:>6} | {cells}      | {best['grouped'] / best['bf16']:12.3g} |"
                      f" {best['grouped'] / best['alone']:13.3g}")


if __name__ == "__main__":
    main()
