"""Where layer-by-layer calibration spends its time: a torch.profiler trace per rank.

    python examples/benchmarks/profile_layer_by_layer.py                      # small, CPU
    python examples/benchmarks/profile_layer_by_layer.py --device cuda --preset 8b \
        --dtype bfloat16 --layers 8 --batches 16 --batch-size 4 --seq-len 2048
    torchrun --nproc-per-node 2 examples/benchmarks/profile_layer_by_layer.py --device cuda ...

The model and data are ``calibrate_large.py``'s (its first ``--layers`` decoder layers). One run
warms up (Triton compiles, cuBLAS starts, pinned memory is first allocated), one is timed, and
one runs under torch.profiler. Printed per rank: the two runs' seconds and phases. Written to
``--out`` per rank: ``trace_rank<r>.json`` (chrome://tracing or Perfetto; each phase of
``calibrate_layer_by_layer`` is a range "nvfp4_static <phase>") and ``profile_rank<r>.txt``: the
phases, the ops by host time, the kernels by device time and, on CUDA, the runtime calls by
total time (an allocation of pinned memory, ``cudaHostAlloc``, holds the driver and stalls the
other threads' launches; a launch that waits on one shows there as a long ``cudaLaunchKernel``).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from calibrate_large import PRESETS, add_run_arguments, build, not_lm_head, start_processes, token_batches  # noqa: E402

from nvfp4_static import NVFP4StaticActivationConfig, calibrate_layer_by_layer  # noqa: E402
from nvfp4_static.norm_smoothing import DEFAULT_ALPHA  # noqa: E402


def calibrated_seconds(args, config, batches, device, dtype, world, timings) -> float:
    """One layer-by-layer run on a freshly built model, timed from a common start."""
    model = build(args.preset, dtype, device, layers=args.layers).to("cpu")
    if world > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    calibrate_layer_by_layer(model, batches, config, device=device, filter_fn=not_lm_head, progress=False,
                             smooth_alpha=DEFAULT_ALPHA if args.smooth else None,
                             group=True if world > 1 else None, timings=timings)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def phase_line(seconds: float, timings: dict) -> str:
    return f"{seconds:.3f} s; " + ", ".join(f"{phase} {s:.3f}" for phase, s in timings.items())


def tables(prof, device: torch.device) -> str:
    averages = prof.key_averages()
    parts = [averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)]
    if device.type == "cuda":
        parts.append(averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        runtime = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("cu"):
                total, calls, longest = runtime.get(event.name, (0.0, 0, 0.0))
                runtime[event.name] = (total + event.cpu_time_total, calls + 1, max(longest, event.cpu_time_total))
        lines = [f"{'CUDA runtime call':<32} {'calls':>7} {'total ms':>10} {'longest ms':>11}"]
        for name, (total, calls, longest) in sorted(runtime.items(), key=lambda item: -item[1][0])[:15]:
            lines.append(f"{name:<32} {calls:>7} {total / 1e3:>10.1f} {longest / 1e3:>11.2f}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, weight="hessian_mse")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    parser.add_argument("--out", default=".", help="folder for the traces and tables")
    args = parser.parse_args(argv)

    device, rank, world = start_processes(torch.device(args.device))
    dtype = getattr(torch, args.dtype)
    config = NVFP4StaticActivationConfig(act_calibration=args.act, weight_scale=args.weight)
    _, shards = token_batches(args, PRESETS[args.preset][5], world)  # the preset's vocabulary

    def run(timings=None) -> float:
        return calibrated_seconds(args, config, shards[rank], device, dtype, world, timings)

    run()  # warm-up
    timed = {}
    print(f"[rank {rank}] timed: {phase_line(run(timed), timed)}", flush=True)
    profiled = {}
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities) as prof:
        line = phase_line(run(profiled), profiled)
    print(f"[rank {rank}] profiled: {line}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace_rank{rank}.json"))
    with open(os.path.join(args.out, f"profile_rank{rank}.txt"), "w") as f:
        f.write(f"{line}\n\n{tables(prof, device)}\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
