"""Calibration kernels on one GPU: ours, the torch references and ModelOpt, timed in one run.

    python examples/benchmarks/bench_calibration.py

Prints one table: per calibration hot path, our Triton kernel, the plain-torch reference and
ModelOpt's implementation (nvidia-modelopt; its rows say why when it cannot be imported), with
baselines from the same run (a device-to-device copy, ``x.abs().amax()``, a bare read of the
activation), and the calibration overhead of a prepared 8192 -> 28672 -> 8192 MLP (bf16, 4096
tokens) over the same MLP unprepared, through ``quantize_`` and through forward pre-hooks that
call only our ops.
Times are medians of ``triton.testing.do_bench`` (the histogram also from a CUDA graph); a
reference too slow to repeat is timed once.
"""

import argparse
import time

import torch
import triton
from bench_linear import bare_read_ms, graph_ms
from torchao.quantization import quantize_

from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable, kernels, references

TOKENS, HIDDEN, INTERMEDIATE = 4096, 8192, 28672
WEIGHT_ROWS = WEIGHT_COLS = 8192
# Rows of the weight the torch reference of the Hessian sweep runs on (its [rows, K/16, 16, 16]
# temporaries make the whole weight take minutes); its time is scaled to the full weight.
HESSIAN_REFERENCE_ROWS = 256


def bench(fn) -> float:
    """Median milliseconds of ``fn`` on the GPU."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def time_once(fn) -> float:
    fn()  # warm-up: kernels compile, caches fill
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def modelopt_or_reason(load):
    """ModelOpt's callable, or the reason it is unavailable (printed in its table cell)."""
    try:
        return load()
    except Exception as error:  # any import or setup failure is reported, not fatal
        return f"unavailable: {type(error).__name__}: {str(error).splitlines()[0][:80]}"


def load_modelopt_collect():
    from modelopt.torch.quantization.calib.nvfp4_act_headroom import NVFP4ActHeadroomCalibrator

    calibrator = NVFP4ActHeadroomCalibrator()
    return calibrator.collect


def load_modelopt_sweeps():
    from modelopt.torch.kernels.quantization.gemm import (
        nvfp4_fp8_scale_sweep,
        nvfp4_fp8_scale_sweep_hessian,
    )

    return nvfp4_fp8_scale_sweep, nvfp4_fp8_scale_sweep_hessian


class Row:
    """One table row: our time, the reference's, ModelOpt's, and a note."""

    def __init__(self, what, ours, reference, modelopt, note=""):
        self.what, self.ours, self.reference, self.modelopt, self.note = (
            what, ours, reference, modelopt, note
        )

    def cells(self):
        def fmt(value):
            return f"{value:.4f}" if isinstance(value, float) else str(value)

        return [self.what, fmt(self.ours), fmt(self.reference), fmt(self.modelopt), self.note]


def print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus written, in TB/s."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e9


def bench_histogram(x, modelopt_collect, bandwidth):
    edges = references.histogram_bin_edges(512, -40.0, 40.0).cuda()
    counts = torch.zeros(512, dtype=torch.int64, device="cuda")
    amax = torch.zeros((), device="cuda")
    ours = bench(lambda: kernels.collect_block_amax_histogram(x, counts, amax, edges))
    # Launched one after another from Python, a 64 MB read can be shorter than the host's
    # launch; a graph replay shows the kernel's own time, as in a forward that hides the launch.
    ours_gpu = graph_ms(lambda: kernels.collect_block_amax_histogram(x, counts, amax, edges))
    # The floor of any collect: one kernel that only reads the activation, timed both ways.
    read, read_gpu = bare_read_ms(bench, x), bare_read_ms(graph_ms, x)

    def reference():
        batch_counts, batch_amax = references.block_amax_histogram(x, edges)
        counts.add_(batch_counts)
        torch.maximum(amax, batch_amax, out=amax)

    modelopt = modelopt_collect
    if callable(modelopt_collect):
        modelopt = bench(lambda: modelopt_collect(x))
    counts.zero_()
    amax.zero_()
    kernels.collect_block_amax_histogram(x, counts, amax, edges)
    expected_counts, expected_amax = references.block_amax_histogram(x, edges)
    same = torch.equal(counts, expected_counts) and torch.equal(amax, expected_amax)
    achieved = x.numel() * x.element_size() / ours / 1e9
    note = (
        f"{achieved:.2f} TB/s read = {achieved / bandwidth:.0%} of copy; from a CUDA graph "
        f"{ours_gpu:.4f} ms; a bare read of x {read:.4f} ms ({read_gpu:.4f} from a graph); "
        f"identical: {same}"
    )
    return Row(f"histogram collect {tuple(x.shape)} bf16", ours, bench(reference), modelopt, note)


def bench_sweeps(weight, hessian, modelopt_sweeps, name):
    global_amax = weight.abs().amax().float()
    ours = kernels.fp8_scale_sweep(weight, global_amax)
    reference = references.fp8_scale_sweep(weight, global_amax)
    same = torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))
    plain_ours = bench(lambda: kernels.fp8_scale_sweep(weight, global_amax))
    plain_reference = time_once(lambda: references.fp8_scale_sweep(weight, global_amax))

    rows = weight[:HESSIAN_REFERENCE_ROWS]
    weighted_ours = kernels.fp8_scale_sweep(rows, global_amax, hessian)
    weighted_reference = references.fp8_scale_sweep(rows, global_amax, hessian)
    weighted_same = torch.equal(weighted_ours.view(torch.uint8), weighted_reference.view(torch.uint8))
    hessian_ours = bench(lambda: kernels.fp8_scale_sweep(weight, global_amax, hessian))
    hessian_reference = time_once(lambda: references.fp8_scale_sweep(rows, global_amax, hessian))
    hessian_reference *= weight.shape[0] / HESSIAN_REFERENCE_ROWS

    plain_modelopt = hessian_modelopt = modelopt_sweeps
    if not isinstance(modelopt_sweeps, str):
        plain_sweep, hessian_sweep = modelopt_sweeps
        plain_modelopt = bench(lambda: plain_sweep(weight, global_amax))
        hessian_modelopt = bench(lambda: hessian_sweep(weight, global_amax, hessian))
    shape = f"{tuple(weight.shape)} {name}"
    return [
        Row(f"plain sweep {shape}", plain_ours, plain_reference, plain_modelopt,
            f"identical to reference: {same}"),
        Row(f"Hessian sweep {shape}", hessian_ours, hessian_reference, hessian_modelopt,
            f"identical on {HESSIAN_REFERENCE_ROWS} rows: {weighted_same}; reference scaled"),
    ]


def bench_block_hessian(x, bandwidth):
    hessian = torch.zeros(x.shape[-1] // 16, 16, 16, device="cuda")
    ours = bench(lambda: kernels.accumulate_block_hessian(x, hessian))
    reference = bench(lambda: hessian.add_(references.block_hessian(x)))
    achieved = x.numel() * x.element_size() / ours / 1e9
    note = f"{achieved:.2f} TB/s read = {achieved / bandwidth:.0%} of copy"
    return Row(f"block Hessian {tuple(x.shape)} bf16", ours, reference, "n/a", note)


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False),
        torch.nn.SiLU(),
        torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False),
    ).to(device="cuda", dtype=torch.bfloat16)


def observe_with_ops(model, weighted):
    """Forward pre-hooks that feed each linear's input to our ops alone: the kernels' own cost."""
    edges = references.histogram_bin_edges(512, -40.0, 40.0).cuda()

    def hook(state):
        def feed(module, args):
            kernels.collect_block_amax_histogram(args[0], state["counts"], state["amax"], edges)
            if weighted:
                kernels.accumulate_block_hessian(args[0], state["hessian"])

        return feed

    for module in model:
        if isinstance(module, torch.nn.Linear):
            state = {
                "counts": torch.zeros(512, dtype=torch.int64, device="cuda"),
                "amax": torch.zeros((), device="cuda"),
                "hessian": torch.zeros(module.in_features // 16, 16, 16, device="cuda"),
            }
            module.register_forward_pre_hook(hook(state))


def calibration_overhead(x):
    """Forward time of the MLP observed four ways, and its ratio to the unobserved MLP."""
    model = mlp()
    rows = []
    with torch.no_grad():
        plain = bench(lambda: model(x))
        for weight_scale in ("mse", "hessian_mse"):
            prepared = mlp()
            prepared.load_state_dict(model.state_dict())
            quantize_(
                prepared, NVFP4StaticActivationConfig(step="prepare", weight_scale=weight_scale), filter_fn=is_quantizable
            )
            prepared_ms = bench(lambda: prepared(x))
            rows.append((f"quantize_ prepare, weight_scale={weight_scale!r}", prepared_ms))
        for weighted in (False, True):
            hooked = mlp()
            hooked.load_state_dict(model.state_dict())
            observe_with_ops(hooked, weighted)
            what = "histogram + Hessian ops" if weighted else "histogram op"
            rows.append((f"pre-hooks calling our {what} only", bench(lambda: hooked(x))))
    return plain, rows


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}")
    bandwidth = copy_bandwidth()
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x *= torch.exp2(torch.randint(-6, 7, (HIDDEN,), device="cuda")).to(torch.bfloat16)
    amax_ms = bench(lambda: x.abs().amax())

    rows = [bench_histogram(x, modelopt_or_reason(load_modelopt_collect), bandwidth)]
    hessian = references.block_hessian(x)
    modelopt_sweeps = modelopt_or_reason(load_modelopt_sweeps)
    gaussian = torch.randn(WEIGHT_ROWS, WEIGHT_COLS, device="cuda", dtype=torch.bfloat16)
    rows += bench_sweeps(gaussian, hessian, modelopt_sweeps, "gaussian")
    gains = torch.exp2(torch.randint(-8, 1, (WEIGHT_ROWS, WEIGHT_COLS // 16, 1), device="cuda"))
    varied = (gaussian.view(WEIGHT_ROWS, -1, 16) * gains.to(torch.bfloat16)).view_as(gaussian)
    rows += bench_sweeps(varied, hessian, modelopt_sweeps, "block gains 2^-8..1")
    rows.append(bench_block_hessian(x, bandwidth))
    plain_forward, observed = calibration_overhead(x)

    print()
    print(f"baselines: copy {bandwidth:.2f} TB/s (read + write); x.abs().amax() on "
          f"{tuple(x.shape)} bf16: {amax_ms:.4f} ms")
    print_table(["what (ms)", "ours", "torch reference", "ModelOpt", "note"], [r.cells() for r in rows])
    print()
    print(f"MLP {HIDDEN} -> {INTERMEDIATE} -> {HIDDEN}, {TOKENS} tokens bf16: unprepared "
          f"{plain_forward:.3f} ms")
    for what, ms in observed:
        print(f"  {what}: {ms:.3f} ms = {ms / plain_forward:.3f}x")


if __name__ == "__main__":
    main()
