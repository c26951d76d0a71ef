"""The CPU weight-scale sweep (``references.fp8_scale_sweep``) on an idle and on a busy machine.

    python examples/benchmarks/bench_cpu_sweep.py [--shapes 576x1536 1536x576 2048x2048] [--cap 60]

Times the plain and the Hessian-weighted sweep of mid-size float32 weights under three thread
setups, all in one run:

- ``1 thread``: ``torch.set_num_threads(1)``;
- ``N threads, caller's``: ``torch.set_num_threads(N)`` (N = the CPU count) and the sweep running
  with them (``references.SWEEP_CPU_THREADS = None``);
- ``N threads, sweep policy``: the same caller, the sweep under its own thread policy
  (``references.SWEEP_CPU_THREADS`` as the package sets it).

and three machine states: ``idle`` (nothing started by the benchmark; other users' work is not
controlled, so the load average is printed), ``spin`` (one busy Python loop per core) and
``torch`` (one process running small elementwise torch ops with N intra-op threads, as another
sweep or test run would). Each time is the wall time of the sweep over the whole weight, fed to
the sweep one step (``references.sweep_rows_per_chunk`` rows) at a time so that a setup slower
than ``--cap`` seconds can stop early: it then shows ``>cap (share of rows done)``. The scales of
every setup are checked bit for bit against the 1-thread ones.
"""

import argparse
import multiprocessing
import os
import statistics
import time

import torch

LOADS = ("idle", "spin", "torch")


def spin(ready) -> None:
    ready.set()
    while True:
        pass


def torch_ops(ready, threads: int) -> None:
    torch.set_num_threads(threads)
    x = torch.randn(1 << 17)
    ready.set()
    while True:
        x = (x * 1.0001).clamp(-5.0, 5.0)


def start_load(kind: str, cores: int) -> list:
    """Start the background load ``kind`` and return its processes once they run."""
    if kind == "idle":
        return []
    context = multiprocessing.get_context("spawn")
    if kind == "spin":
        jobs = [(spin, ()) for _ in range(cores)]
    else:
        jobs = [(torch_ops, (cores,))]
    processes = []
    for target, args in jobs:
        ready = context.Event()
        process = context.Process(target=target, args=(ready, *args), daemon=True)
        process.start()
        ready.wait()
        processes.append(process)
    time.sleep(1.0)
    return processes


def stop_load(processes: list) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


def timed_sweep(references, weight, global_amax, hessian, cap_s: float):
    """``(seconds, share of rows done, scales of the rows done)``; stops once past ``cap_s``."""
    step = references.sweep_rows_per_chunk(weight.shape[1], weight.device)
    pieces, elapsed, done = [], 0.0, 0
    for rows in weight.split(step):
        start = time.perf_counter()
        pieces.append(references.fp8_scale_sweep(rows, global_amax, hessian))
        elapsed += time.perf_counter() - start
        done += rows.shape[0]
        if elapsed > cap_s and done < weight.shape[0]:
            break
    return elapsed, done / weight.shape[0], torch.cat(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576", "2048x2048"])
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    parser.add_argument("--cap", type=float, default=60.0, help="seconds before a setup stops")
    parser.add_argument("--repeats", type=int, default=1, help="median of this many runs")
    args = parser.parse_args()

    # Imported here, not at the top: the load processes are spawned and import this module.
    from nvfp4_static import references

    cores = os.cpu_count()
    package_policy = references.SWEEP_CPU_THREADS
    setups = {
        "1 thread": (1, None),
        f"{cores} threads, caller's": (cores, None),
        f"{cores} threads, sweep policy": (cores, package_policy),
    }
    cases = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=generator)
        hessian = references.block_hessian(torch.randn(64, k, generator=generator))
        cases += [(f"{n} x {k}", "plain", weight, None), (f"{n} x {k}", "Hessian", weight, hessian)]

    results = {}
    for load in args.loads:
        processes = start_load(load, cores)
        print(f"load {load}: load average {os.getloadavg()[0]:.2f} at start", flush=True)
        try:
            for shape, mode, weight, hessian in cases:
                global_amax = weight.abs().max()
                expected = None
                for setup, (threads, policy) in setups.items():
                    torch.set_num_threads(threads)
                    references.SWEEP_CPU_THREADS = policy
                    runs = []
                    for _ in range(args.repeats):
                        seconds, share, scales = timed_sweep(
                            references, weight, global_amax, hessian, args.cap
                        )
                        if expected is None:
                            expected = scales
                        rows = min(expected.shape[0], scales.shape[0])
                        bits = (expected[:rows].view(torch.uint8), scales[:rows].view(torch.uint8))
                        assert torch.equal(*bits), f"{shape} {mode}, {setup}, {load}: scales differ"
                        runs.append((seconds, share))
                    seconds = statistics.median(run[0] for run in runs)
                    share = min(run[1] for run in runs)
                    text = f"{seconds:.2f}" if share == 1.0 else f">{args.cap:.0f} ({share:.0%})"
                    results[shape, mode, load, setup] = text
                    print(f"  {shape} {mode}, {setup}: {text} s", flush=True)
        finally:
            stop_load(processes)
            references.SWEEP_CPU_THREADS = package_policy

    columns = [(load, setup) for load in args.loads for setup in setups]
    print()
    print("| weight | error | " + " | ".join(f"{load}: {setup}" for load, setup in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for shape, mode, _, _ in cases:
        cells = [results[shape, mode, load, setup] for load, setup in columns]
        print(f"| {shape} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
