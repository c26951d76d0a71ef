"""Sweep tile configs of the grouped NVFP4 GEMM per token count, to (re)fill
``kernels.grouped_gemm.GROUPED_GEMM_CONFIGS``.

The layer of ``bench_moe.py`` (Qwen3-30B-A3B-shaped: 128 experts, top-8, hidden 2048, expert
intermediate 768), random weights and routing. For each token count and candidate tile, both
grouped GEMMs of the layer (gate/up and down, each the routed-rows quantize kernel then the GEMM)
run with that tile, are checked against the table's default tile (the same exact products, summed
in another order), and are timed as a CUDA graph replay (do_bench median, L2 flushed). Prints the
time of every candidate and the best per token count, with rows per expert (what the table is
keyed on). Run on one GPU:

    cd examples/benchmarks && python tune_grouped_gemm.py [--tokens 1 16 128 1024 4096]
"""

import torch
from bench_moe import (
    EXPERTS,
    HIDDEN,
    HIDDEN_AMAX,
    INTERMEDIATE,
    INTERMEDIATE_AMAX,
    TOP_K,
    float_experts,
    graph_ms,
    nvfp4_grouped,
    token_counts,
)

from nvfp4_static.experts.routing import route
from nvfp4_static.kernels.grouped_gemm import GroupedGemmConfig, launch_grouped_nvfp4_gemm

# (block_m, block_n, block_k, num_warps, num_stages, weight_as_mma_a). Transposed tiles put the
# weight on the MMA's M side, so they take block_n >= 64.
CANDIDATES = [
    GroupedGemmConfig(16, 64, 256, 4, 3, weight_as_mma_a=True),
    GroupedGemmConfig(16, 128, 256, 4, 3, weight_as_mma_a=True),
    GroupedGemmConfig(16, 128, 128, 4, 3, weight_as_mma_a=True),
    GroupedGemmConfig(16, 64, 256, 4, 4),
    GroupedGemmConfig(32, 128, 128, 4, 3, weight_as_mma_a=True),
    GroupedGemmConfig(64, 128, 128, 4, 3),
    GroupedGemmConfig(64, 128, 128, 8, 3, weight_as_mma_a=True),
    GroupedGemmConfig(64, 256, 128, 8, 3),
    GroupedGemmConfig(128, 128, 128, 8, 3),
    GroupedGemmConfig(128, 128, 64, 4, 4),
    GroupedGemmConfig(128, 256, 64, 8, 3),
]


def main():
    tokens_to_run = token_counts(__doc__.splitlines()[0])
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    bf16 = float_experts()
    gate_up = nvfp4_grouped(bf16.gate_up_proj.detach(), HIDDEN_AMAX)
    down = nvfp4_grouped(bf16.down_proj.detach(), INTERMEDIATE_AMAX)
    for tokens in tokens_to_run:
        hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        top_k_index = torch.topk(torch.randn(tokens, EXPERTS, device="cuda"), TOP_K).indices
        routing = route(top_k_index, EXPERTS)
        token_of_row = routing.token_of_row
        rows = token_of_row.shape[0]
        intermediate = torch.randn(rows, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        outs = (torch.empty(rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16),
                torch.empty(rows, HIDDEN, device="cuda", dtype=torch.bfloat16))

        def both(config):
            for grouped, x, out, source in ((gate_up, hidden, outs[0], token_of_row), (down, intermediate, outs[1], None)):
                launch_grouped_nvfp4_gemm(
                    x, routing.expert_offsets, grouped.qdata, grouped.scale, grouped.per_tensor_scale,
                    grouped.act_per_tensor_scale, out, config, source,
                )

        both(None)
        reference = [out.float().clone() for out in outs]
        timings = {}
        for config in CANDIDATES:
            both(config)
            error = max(float((out.float() - ref).norm() / ref.norm()) for out, ref in zip(outs, reference))
            assert error < 1e-2, f"{config}: relative difference {error} from the default tile"
            timings[config] = graph_ms(lambda: both(config))  # noqa: B023
        best = min(timings, key=timings.get)
        print(f"T = {tokens} ({rows / EXPERTS:.2f} rows per expert): default {graph_ms(lambda: both(None)):.4f} ms")
        for config, ms in timings.items():
            print(f"  {ms:.4f} ms {'*' if config is best else ' '} {config}")


if __name__ == "__main__":
    main()
