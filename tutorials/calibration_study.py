"""The calibration study: how should a static NVFP4 activation global amax be chosen?

    python tutorials/calibration_study.py                        # full study, ~10 min on 2 idle CPU cores
    python tutorials/calibration_study.py --quick --out-dir /tmp/study   # reduced, under a minute

Writes ``calibration_study.md`` and its PNG plots into ``--out-dir`` (default:
``calibration_study_out/`` in the current directory; pass ``--out-dir tutorials`` to regenerate
the committed page). The committed page's run time, 1787 s, includes about 20 minutes during
which the process was paused to free the CPU for other work.
Every number in the page is measured by this script; the prose around the tables is generated
from the same numbers, so a rerun cannot leave a stale claim behind.

Three questions, each on synthetic data (where the truth is known) and, in the full study, on
the activations of SmolLM2-135M-Instruct (from ``examples/quantize_llm.py``'s loader):

1. Is max the right global amax? Max, block-amax percentiles (p99 ... p99.999), the MSE search
   on calibration data, the B_min-anchored recipe at several rho, and the oracle (the best
   global amax for the test data itself, found by a fine log-spaced search).
2. Does more calibration always help? A rare 1e6 spike (1e-7 of samples), log-normal
   activations (sigma = 3), and the real model against the number of calibration sequences.
3. What happens when inference brings outliers 4-16x beyond the calibration max?

Signal-to-noise ratios are in dB: ``10 log10(sum x^2 / sum (x - q(x))^2)``. The
"block-normalised" SNR weights every 16-element block equally,
``-10 log10(mean_b(noise_b / signal_b))``, so a block flushed to zero counts as much as one
holding an outlier.
"""

import argparse
import dataclasses
import math
import pathlib
import sys
import time
import warnings
from collections.abc import Callable

import torch

from nvfp4_static.diagnostics import snr_db
from nvfp4_static.numerics import BLOCK_SIZE, E4M3_DYNAMIC_RANGE
from nvfp4_static.observers import (
    MaxCalibrator,
    NVFP4ActMaxCalibrator,
    PercentileCalibrator,
    nvfp4_fake_quantize_with_amax,
)
from nvfp4_static.observers.anchored_mse import FirstBatchMseCalibrator
from nvfp4_static.observers.b_min import DEFAULT_B_MAX_PERCENTILE

try:  # plots need matplotlib (the "examples" extra); without it the page has tables only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

HERE = pathlib.Path(__file__).resolve().parent
ROW_WIDTH = 256  # elements per row of synthetic data: 16 blocks
PERCENTILES = (99.0, 99.9, 99.99, 99.999)
RHOS = (16.0, 256.0, 16384.0, 28000.0)
DEFAULT_RHO = 16384.0
B_MIN = f"B_min rho={DEFAULT_RHO:g}"  # the package's default recipe (B_max at DEFAULT_B_MAX_PERCENTILE)
B_MIN_VARIANTS = {"B_min, B_max=p99.99": 99.99, "B_min, B_max=max": 100.0}  # other b_max_percentile
OUTLIER_FACTORS = (1, 2, 4, 8, 16)
OUTLIER_BLOCK_FRACTION = 1e-3
SPIKE = 1e6
SPIKE_RATE = 1e-7


@dataclasses.dataclass
class Scale:
    """How much work each experiment does; ``--quick`` shrinks all of it."""

    n_calib: int  # elements of synthetic calibration data
    n_test: int  # elements of synthetic test data
    oracle_steps_per_octave: int  # resolution of the oracle / SNR-vs-amax curve
    mse_step: float  # step of the MSE search's multiplier grid
    stream_sizes: tuple  # cumulative calibration sizes for "more calibration"
    real_model: bool


FULL = Scale(2**20, 2**18, 16, 0.1, tuple(2**k for k in range(12, 25, 2)), True)
QUICK = Scale(2**16, 2**14, 2, 0.25, tuple(2**k for k in range(12, 19, 2)), False)


# ---------------------------------------------------------------- synthetic data


def gaussian(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=generator)


def laplace(n: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=generator).clamp_min(1e-12)
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return sign * -torch.log(u)


def lognormal(sigma: float) -> Callable[[int, torch.Generator], torch.Tensor]:
    def sample(n: int, generator: torch.Generator) -> torch.Tensor:
        sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
        return sign * torch.exp(sigma * torch.randn(n, generator=generator))

    return sample


def iid_stream(distribution, seed: int) -> Callable[[int], torch.Tensor]:
    """``draw(n)``: the next ``n`` independent samples of ``distribution``."""
    generator = torch.Generator().manual_seed(seed)
    return lambda n: distribution(n, generator)


def spiky_gaussian_stream(seed: int) -> Callable[[int], torch.Tensor]:
    """``draw(n)``: the next ``n`` samples of N(0, 1) in which 1e-7 of samples are +-1e6 spikes.

    Exactly one spike lands at a random place in each run of 1e7 samples. Independent draws at
    rate 1e-7 leave the count to the seed (one seed gave no spike in 1.7e7 samples); this way
    the first 1e7 samples always hold one.
    """
    generator = torch.Generator().manual_seed(seed)
    period = round(1 / SPIKE_RATE)
    drawn = 0

    def draw(n: int) -> torch.Tensor:
        nonlocal drawn
        x = torch.randn(n, generator=generator)
        for window in range(drawn // period, (drawn + n - 1) // period + 1):
            place = torch.Generator().manual_seed(seed + 1 + window)
            position = window * period + int(torch.randint(period, (1,), generator=place))
            if drawn <= position < drawn + n:
                x[position - drawn] = SPIKE if x[position - drawn] >= 0 else -SPIKE
        drawn += n
        return x

    return draw


DISTRIBUTIONS = {
    "gaussian": gaussian,
    "laplace": laplace,
    "log-normal s=1": lognormal(1.0),
    "log-normal s=3": lognormal(3.0),
}


def rows(x: torch.Tensor) -> torch.Tensor:
    """Synthetic samples as ``[n / 256, 256]``: NVFP4 blocks run along the last dim."""
    return x.reshape(-1, ROW_WIDTH)


def sample(distribution, n: int, seed: int) -> torch.Tensor:
    return rows(distribution(n, torch.Generator().manual_seed(seed)))


# ---------------------------------------------------------------- measuring


def quantize(x: torch.Tensor, g_amax: float) -> torch.Tensor:
    return nvfp4_fake_quantize_with_amax(x, torch.tensor(g_amax, dtype=torch.float32))


def block_normalised_snr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    blocks = x.double().reshape(-1, BLOCK_SIZE)
    noise = (blocks - xq.double().reshape(-1, BLOCK_SIZE)).pow(2).sum(-1)
    signal = blocks.pow(2).sum(-1)
    ratio = (noise[signal > 0] / signal[signal > 0]).mean()
    return math.inf if ratio == 0 else -10 * math.log10(float(ratio))


class Calibration:
    """The calibrators of every compared method, fed the same data.

    The percentiles and the B_min recipe read one shared block-amax histogram (their state is
    the same), so it is collected once. The MSE search is the package's one-pass
    ``act_calibration="mse"``: its grid is anchored at the first collected batch's max.
    """

    def __init__(self, mse_step: float = None):
        self.histogram = NVFP4ActMaxCalibrator(rho=DEFAULT_RHO)
        self.max = MaxCalibrator()
        self.mse = None if mse_step is None else FirstBatchMseCalibrator(step_size=mse_step)

    def collect(self, x: torch.Tensor) -> None:
        self.histogram.collect(x)
        self.max.collect(x)
        if self.mse is not None:
            self.mse.collect(x)

    def percentile(self, p: float) -> float:
        calibrator = PercentileCalibrator(p)
        calibrator.load_state_dict(self.histogram.state_dict())
        return float(calibrator.compute_amax())

    def b_min(self, rho: float, b_max_percentile: float = DEFAULT_B_MAX_PERCENTILE) -> float:
        calibrator = NVFP4ActMaxCalibrator(rho=rho, b_max_percentile=b_max_percentile)
        calibrator.load_state_dict(self.histogram.state_dict())
        return float(calibrator.compute_amax())

    def b_max_over_b_min(self) -> float:
        self.histogram.compute_amax()
        return self.histogram.stats["b_max_over_b_min"]

    def methods(self, percentiles=PERCENTILES, rhos=RHOS) -> dict[str, float]:
        """Global amax of every method compared, by name."""
        amaxes = {"max": float(self.max.compute_amax())}
        amaxes.update({f"p{p:g}": self.percentile(p) for p in percentiles})
        if self.mse is not None:
            amaxes["mse (calibration)"] = float(self.mse.compute_amax())
        amaxes.update({f"B_min rho={rho:g}": self.b_min(rho) for rho in rhos})
        amaxes.update({name: self.b_min(DEFAULT_RHO, p) for name, p in B_MIN_VARIANTS.items()})
        return amaxes


def calibrated(x: torch.Tensor, mse_step: float) -> Calibration:
    calibration = Calibration(mse_step)
    calibration.collect(x)
    return calibration


def amax_grid(reference_max: float, steps_per_octave: int) -> list[float]:
    """Global amaxes from ``max / 4`` up to ``28672 * max``, log-spaced.

    Below max/4 most of the data clips; above 28672x max every block scale is subnormal. The
    SNR is periodic in log2(g_amax) inside that window (FP8 rounding repeats every octave), so a
    few steps per octave over the whole window find the best phase.
    """
    low, high = math.log2(reference_max / 4), math.log2(reference_max * E4M3_DYNAMIC_RANGE)
    n = int((high - low) * steps_per_octave) + 1
    return [2 ** (low + i / steps_per_octave) for i in range(n)]


def snr_curve(x: torch.Tensor, amaxes: list[float]) -> list[float]:
    return [snr_db(x, quantize(x, g)) for g in amaxes]


def with_outliers(x: torch.Tensor, factor: float, calib_max: float, seed: int):
    """``x`` with one element in a fraction 1e-3 of blocks replaced by ``+-factor * calib_max``.

    Returns the data and the mask of blocks left untouched (the bulk).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks = x.clone().reshape(-1, BLOCK_SIZE)
    n_outliers = max(1, int(OUTLIER_BLOCK_FRACTION * blocks.shape[0]))
    chosen = torch.randperm(blocks.shape[0], generator=generator)[:n_outliers]
    position = torch.randint(BLOCK_SIZE, (n_outliers,), generator=generator)
    sign = torch.where(torch.rand(n_outliers, generator=generator) < 0.5, -1.0, 1.0)
    blocks[chosen, position] = sign * factor * calib_max
    bulk = torch.ones(blocks.shape[0], dtype=torch.bool)
    bulk[chosen] = False
    return blocks.reshape(x.shape), bulk


# ---------------------------------------------------------------- experiments


def choose_global_amax(scale: Scale) -> dict:
    """Q1: test SNR of every method, in distribution, next to the oracle's."""
    results = {}
    for i, (name, distribution) in enumerate(DISTRIBUTIONS.items()):
        calib = calibrated(sample(distribution, scale.n_calib, seed=10 + i), scale.mse_step)
        test = sample(distribution, scale.n_test, seed=100 + i)
        amaxes = calib.methods()
        grid = amax_grid(float(calib.max.compute_amax()), scale.oracle_steps_per_octave)
        curve = snr_curve(test, grid)
        best = max(range(len(grid)), key=curve.__getitem__)
        snrs = {method: snr_db(test, quantize(test, g)) for method, g in amaxes.items()}
        snrs["oracle (test)"] = curve[best]
        amaxes["oracle (test)"] = grid[best]
        results[name] = {
            "snr": snrs,
            "amax": amaxes,
            "max": float(calib.max.compute_amax()),
            "b_max_over_b_min": calib.b_max_over_b_min(),
            "grid": grid,
            "curve": curve,
        }
    return results


def more_calibration(scale: Scale) -> dict:
    """Q2 (synthetic): test SNR against the amount of calibration data, for a growing stream."""
    streams = {
        "1e6 spike in 1e-7 of samples": (spiky_gaussian_stream(300), gaussian),
        "log-normal s=3": (iid_stream(lognormal(3.0), 301), lognormal(3.0)),
    }
    results = {}
    for j, (name, (draw, test_distribution)) in enumerate(streams.items()):
        test = sample(test_distribution, scale.n_test, seed=200 + j)
        calib, seen, spikes = Calibration(scale.mse_step), 0, 0
        per_size = {}
        for size in scale.stream_sizes:
            chunk = rows(draw(size - seen))
            spikes += int((chunk.abs() >= SPIKE).sum())
            calib.collect(chunk)
            seen = size
            amaxes = calib.methods(percentiles=(99.99,), rhos=(DEFAULT_RHO,))
            per_size[size] = {
                "spikes": spikes,
                "snr": {m: snr_db(test, quantize(test, g)) for m, g in amaxes.items()},
                "block_snr": {
                    m: block_normalised_snr_db(test, quantize(test, g)) for m, g in amaxes.items()
                },
                "amax": amaxes,
            }
        results[name] = per_size
    return results


def unseen_outliers(scale: Scale) -> dict:
    """Q3: calibrate in distribution, then test on data with outliers beyond the calibration max."""
    results = {}
    for i, (name, distribution) in enumerate(
        (("gaussian", gaussian), ("log-normal s=1", lognormal(1.0)))
    ):
        calib = calibrated(sample(distribution, scale.n_calib, seed=400 + i), scale.mse_step)
        amaxes = calib.methods()
        calib_max = float(calib.max.compute_amax())
        clean = sample(distribution, scale.n_test, seed=500 + i)
        per_factor = {}
        for factor in OUTLIER_FACTORS:
            test, bulk = with_outliers(clean, factor, calib_max, seed=600 + factor)
            bulk_blocks = test.reshape(-1, BLOCK_SIZE)[bulk]
            snr, bulk_snr = {}, {}
            for method, g in amaxes.items():
                xq = quantize(test, g)
                snr[method] = snr_db(test, xq)
                bulk_snr[method] = snr_db(bulk_blocks, xq.reshape(-1, BLOCK_SIZE)[bulk])
            per_factor[factor] = {"snr": snr, "bulk_snr": bulk_snr}
        results[name] = per_factor
    return results


def real_model(n_calib_list=(1, 2, 4, 8, 16), n_eval: int = 4, seq_len: int = 256) -> dict:
    """Q2 on SmolLM2's linear-layer inputs: per-layer held-out SNR against calibration sequences.

    The model runs in float; each layer's input is quantized on its own (no error propagates),
    so the numbers isolate the global-amax choice. Layers: every linear but lm_head.
    """
    sys.path.insert(0, str(HERE.parent / "examples"))
    import quantize_llm  # the example's loader and text split, not a copy of them

    tokenizer, model = quantize_llm.load_model(torch.float32, "cpu")
    token_ids = tokenizer(quantize_llm.load_text(None), return_tensors="pt").input_ids[0]
    calib, held_out = quantize_llm.split_sequences(token_ids, seq_len, max(n_calib_list), n_eval)
    layers = {
        name: module for name, module in model.named_modules()
        if quantize_llm.all_but_lm_head(module, name)
    }
    methods = ("max", "p99.99", B_MIN, *B_MIN_VARIANTS)
    calibrations = {name: Calibration() for name in layers}

    def collect(module, args, name):
        calibrations[name].collect(args[0].detach().reshape(-1, args[0].shape[-1]))

    amaxes = {}  # (n, layer) -> {method: g_amax}
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: collect(m, a, n)) for n, m in layers.items()]
    with torch.no_grad():
        for i, ids in enumerate(calib, start=1):
            model(ids[None], use_cache=False)
            if i in n_calib_list:
                for name, c in calibrations.items():
                    amaxes[i, name] = c.methods(percentiles=(99.99,), rhos=(DEFAULT_RHO,))
    for handle in handles:
        handle.remove()

    sums = {}  # (n, layer, method) -> [signal, noise, clipped elements, elements]

    def measure(module, args, name):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        for n in n_calib_list:
            for method in methods:
                g = amaxes[n, name][method]
                xq = quantize(x.float(), g).double()
                entry = sums.setdefault((n, name, method), [0.0, 0.0, 0, 0])
                entry[0] += float(x.pow(2).sum())
                entry[1] += float((x - xq).pow(2).sum())
                entry[2] += int((x.abs() > g).sum())
                entry[3] += x.numel()

    handles = [m.register_forward_pre_hook(lambda m, a, n=n: measure(m, a, n)) for n, m in layers.items()]
    with torch.no_grad():
        model(held_out, use_cache=False)
    for handle in handles:
        handle.remove()

    results = {}
    for n in n_calib_list:
        for method in methods:
            per_layer = [
                10 * math.log10(sums[n, name, method][0] / sums[n, name, method][1])
                for name in layers
            ]
            results[n, method] = {
                "mean_snr": sum(per_layer) / len(per_layer),
                "min_snr": min(per_layer),
                "worst_layer": list(layers)[per_layer.index(min(per_layer))],
                "clipping_layers": [name for name in layers if sums[n, name, method][2] > 0],
                "clipped_fraction": sum(sums[n, name, method][2] for name in layers)
                / sum(sums[n, name, method][3] for name in layers),
            }
    return {"results": results, "n_calib": n_calib_list, "methods": methods, "n_layers": len(layers),
            "n_eval": n_eval, "seq_len": seq_len}


# ---------------------------------------------------------------- reporting


def markdown_table(header: list[str], body: list[list]) -> str:
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def image(caption: str, file_name: str) -> str:
    return f"![{caption}]({file_name})\n" if plt is not None else ""


def plot_snr_vs_amax(q1: dict, path: pathlib.Path) -> None:
    names = ["gaussian", "log-normal s=3"]
    figure, axes = plt.subplots(1, len(names), figsize=(11, 4))
    for ax, name in zip(axes, names):
        r = q1[name]
        ax.plot([g / r["max"] for g in r["grid"]], r["curve"], color="0.3", lw=1)
        for method, style in (("max", "C0"), ("p99.99", "C1"), ("mse (calibration)", "C2"),
                              (B_MIN, "C3"), ("oracle (test)", "k")):
            ax.axvline(r["amax"][method] / r["max"], color=style, ls="--", lw=1,
                       label=f"{method}: {r['snr'][method]:.2f} dB")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global amax / calibration max")
        ax.set_ylabel("test SNR (dB)")
        ax.set_title(name)
        ax.legend(fontsize=7, loc="lower center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_more_calibration(q2: dict, real: dict, path: pathlib.Path) -> None:
    panels = len(q2) + (real is not None)
    figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5 if real else 4))
    for ax, (name, per_size) in zip(axes, q2.items()):
        sizes = list(per_size)
        for method in per_size[sizes[0]]["snr"]:
            ax.plot(sizes, [per_size[s]["snr"][method] for s in sizes], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("calibration samples")
        ax.set_ylabel("test SNR (dB)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    if real is not None:
        ax = axes[-1]
        for i, method in enumerate(real["methods"]):
            ax.plot(real["n_calib"], [real["results"][n, method]["min_snr"] for n in real["n_calib"]],
                    marker="o", color=f"C{i}", label=f"{method} (worst layer)")
            ax.plot(real["n_calib"], [real["results"][n, method]["mean_snr"] for n in real["n_calib"]],
                    marker=".", ls=":", color=f"C{i}", label=f"{method} (mean of layers)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("calibration sequences (256 tokens)")
        ax.set_ylabel("held-out activation SNR (dB)")
        ax.set_title("SmolLM2-135M linear inputs")
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_outliers(q3: dict, path: pathlib.Path) -> None:
    figure, axes = plt.subplots(1, len(q3), figsize=(5.5 * len(q3), 4))
    for ax, (name, per_factor) in zip(axes, q3.items()):
        factors = list(per_factor)
        for method in per_factor[factors[0]]["snr"]:
            if method.startswith("p99.9") or method == "p99":
                continue  # the percentiles sit on or below max; the table has them
            ax.plot(factors, [per_factor[f]["snr"][method] for f in factors], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("outlier magnitude / calibration max")
        ax.set_ylabel("test SNR (dB)")
        ax.set_title(f"{name}, outliers in {OUTLIER_BLOCK_FRACTION:g} of blocks")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def q1_section(q1: dict) -> str:
    names = list(q1)
    methods = list(q1[names[0]]["snr"])
    snr_table = markdown_table(["method"] + names, [[m] + [q1[n]["snr"][m] for n in names] for m in methods])
    amax_table = markdown_table(
        ["method"] + names,
        [[m] + [f"{q1[n]['amax'][m] / q1[n]['max']:.4g}" for n in names] for m in methods],
    )
    b_min = B_MIN
    gaps = {n: q1[n]["snr"][b_min] - q1[n]["snr"]["mse (calibration)"] for n in names}
    oracle_gaps = {n: q1[n]["snr"][b_min] - q1[n]["snr"]["oracle (test)"] for n in names}
    within = [n for n in names if gaps[n] >= -0.1]
    ratio = ", ".join(f"{n}: {q1[n]['b_max_over_b_min']:.3g}" for n in names)
    percentile_gain, best_p, best_n = max(
        (q1[n]["snr"][f"p{p:g}"] - q1[n]["snr"]["max"], f"p{p:g}", n) for n in names for p in PERCENTILES
    )
    wide = [n for n in names if q1[n]["b_max_over_b_min"] > E4M3_DYNAMIC_RANGE]
    wide_note = "".join(
        f"\n\n{n} has B_max / B_min = {q1[n]['b_max_over_b_min']:.3g} > 28672: no global scale holds "
        f"both ends, the calibrator warns, and the recipe falls back to g_amax = margin * B_max = "
        f"{q1[n]['amax'][B_MIN] / q1[n]['max']:.3g} x max. Test SNR: default B_min "
        f"{q1[n]['snr'][B_MIN]:.2f} dB; "
        + "; ".join(f"{v} {q1[n]['snr'][v]:.2f} dB" for v in B_MIN_VARIANTS)
        + f"; max {q1[n]['snr']['max']:.2f} dB; MSE {q1[n]['snr']['mse (calibration)']:.2f} dB."
        for n in wide
    )
    return f"""## 1. Is max the right global amax?

Calibration and test sets are independent draws of the same distribution. Test SNR (dB) of
each method's global amax; percentiles are of per-block amaxes; the MSE search minimises the
fake-quantization error on the calibration data over `max * m`, m in [0.25, 4]; the oracle is the
best global amax for the test set itself over a log-spaced sweep from max/4 to 28672 x max.

{snr_table}

The global amax each method chose, as a multiple of the calibration max:

{amax_table}

{image("SNR against the global amax", "calibration_snr_vs_amax.png")}
What the curve shows: inside the window from the largest block amax up to about 28672 / (B_max /
B_min) times higher, the SNR is flat up to a ripple that repeats every octave (FP8 block scales
round the same way when the global scale doubles). Below max, blocks clip and the SNR drops
fast; far above, small blocks' scales turn subnormal. Percentiles below the max put the largest
blocks into saturation; the most any percentile gained over max here is {percentile_gain:+.2f} dB
({best_p}, {best_n}). B_max / B_min per distribution: {ratio}.{wide_note}

B_min (rho = {DEFAULT_RHO:g}) minus the MSE search, in dB: {', '.join(f'{n}: {gaps[n]:+.2f}' for n in names)}
(target: within 0.1 dB, met for {len(within)} of {len(names)}: {', '.join(within) or 'none'}).
B_min minus the test oracle: {', '.join(f'{n}: {oracle_gaps[n]:+.2f}' for n in names)}.
"""


def q2_section(q2: dict, real: dict) -> str:
    parts = ["## 2. Does more calibration always help?\n"]
    for name, per_size in q2.items():
        sizes = list(per_size)
        methods = list(per_size[sizes[0]]["snr"])
        body = [[f"{s:,}", per_size[s]["spikes"]]
                + [f"{per_size[s]['snr'][m]:.2f} / {per_size[s]['block_snr'][m]:.2f}" for m in methods]
                for s in sizes]
        table = markdown_table(["calibration samples", "samples >= 1e6"] + methods, body)
        first, last = per_size[sizes[0]]["snr"], per_size[sizes[-1]]["snr"]
        trend = ", ".join(f"{m} {first[m]:.2f} -> {last[m]:.2f} dB" for m in methods)
        parts.append(f"""### {name}

Test SNR / block-normalised SNR (dB) on a fresh test set{' without spikes' if 'spike' in name else ''},
after calibrating on a growing stream (each row adds to the one above). From the smallest to the
largest calibration set: {trend}.

{table}
""")
    if real is None:
        parts.append("The real-model part is skipped in `--quick` mode.\n")
    else:
        methods = real["methods"]
        body = [[n] + [f"{real['results'][n, m]['mean_snr']:.2f} / {real['results'][n, m]['min_snr']:.2f} / "
                       f"{len(real['results'][n, m]['clipping_layers'])}" for m in methods]
                for n in real["n_calib"]]
        table = markdown_table(["calibration sequences"] + list(methods), body)
        worst = {m: real["results"][real["n_calib"][0], m]["worst_layer"] for m in methods}
        most = real["n_calib"][-1]
        b_min_clipping = real["results"][most, B_MIN]["clipping_layers"]
        parts.append(f"""### SmolLM2-135M-Instruct, activations of its {real['n_layers']} linear layers

Calibration on the first N sequences of 256 tokens of `pydoc_data.topics`, test on the last
{real['n_eval']} (held out). Each layer's float input is quantized alone. Cells: mean over layers
of the held-out SNR / worst layer's SNR (dB) / number of layers where held-out activations exceed
the global amax (clip). Worst layer with one sequence: {', '.join(f'{m}: `{w}`' for m, w in worst.items())}.
Layers that clip under the default B_min recipe after {most} sequences:
{', '.join(f'`{name}`' for name in b_min_clipping) or 'none'}.

{table}
""")
    parts.append(image("SNR against calibration size", "calibration_more_data.png"))
    return "\n".join(parts)


def q3_section(q3: dict) -> str:
    parts = [f"""## 3. Outliers at inference beyond the calibration max

Calibrate on clean data, then test on fresh data where one element in a fraction
{OUTLIER_BLOCK_FRACTION:g} of the blocks is replaced by +-k x the calibration max. Cells: test
SNR over everything / SNR of the untouched blocks only (dB).
"""]
    b_min = B_MIN
    for name, per_factor in q3.items():
        factors = list(per_factor)
        methods = list(per_factor[factors[0]]["snr"])
        body = [[m] + [f"{per_factor[f]['snr'][m]:.2f} / {per_factor[f]['bulk_snr'][m]:.2f}" for f in factors]
                for m in methods]
        gains = {f: per_factor[f]["snr"][b_min] - per_factor[f]["snr"]["max"] for f in factors if f >= 4}
        parts.append(f"""### {name}

{markdown_table(["method"] + [f"k = {f}" for f in factors], body)}

B_min (rho = {DEFAULT_RHO:g}) minus max, overall SNR: {', '.join(f'k = {f}: {g:+.2f} dB' for f, g in gains.items())}
(target: >= 3 dB for k in 4..16: {'met' if min(gains.values()) >= 3 else 'NOT met'}).
""")
    parts.append(image("SNR with unseen outliers", "calibration_outliers.png"))
    return "\n".join(parts)


def summary(q1: dict, q2: dict, q3: dict, real: dict) -> str:
    """The answers, each a measured sentence; the sections below hold the tables."""
    names = list(q1)
    gaps = ", ".join(f"{n} {q1[n]['snr'][B_MIN] - q1[n]['snr']['mse (calibration)']:+.2f}" for n in names)
    lines = [f"- **In distribution**, B_min (rho = {DEFAULT_RHO:g}) minus the MSE search, dB: {gaps}."]
    for name, per_size in q2.items():
        sizes = list(per_size)
        first, last = per_size[sizes[0]], per_size[sizes[-1]]
        lines.append(
            f"- **More calibration, {name}** ({sizes[0]:,} -> {sizes[-1]:,} samples, "
            f"{last['spikes']} samples >= 1e6 seen): test SNR / block-normalised SNR, max "
            f"{first['snr']['max']:.2f} / {first['block_snr']['max']:.2f} -> "
            f"{last['snr']['max']:.2f} / {last['block_snr']['max']:.2f} dB; B_min "
            f"{first['snr'][B_MIN]:.2f} / {first['block_snr'][B_MIN]:.2f} -> "
            f"{last['snr'][B_MIN]:.2f} / {last['block_snr'][B_MIN]:.2f} dB."
        )
    if real is not None:
        one, most = real["n_calib"][0], real["n_calib"][-1]
        r = real["results"]
        cells = "; ".join(
            f"{m}: {len(r[one, m]['clipping_layers'])} -> {len(r[most, m]['clipping_layers'])} "
            f"layers clip, worst layer {r[one, m]['min_snr']:.2f} -> {r[most, m]['min_snr']:.2f} dB"
            for m in real["methods"]
        )
        lines.append(f"- **More calibration, SmolLM2 activations** ({one} -> {most} sequences): {cells}.")
    for name, per_factor in q3.items():
        gains = ", ".join(
            f"k = {f}: {per_factor[f]['snr'][B_MIN] - per_factor[f]['snr']['max']:+.2f}"
            for f in per_factor if f >= 4
        )
        lines.append(f"- **Unseen outliers, {name}**: B_min minus max, dB: {gains}.")
    return "\n".join(lines)


def write_report(out_dir: pathlib.Path, scale: Scale, q1, q2, q3, real, seconds: float) -> pathlib.Path:
    if plt is None:
        print("matplotlib is not installed: writing tables without plots")
    else:
        plot_snr_vs_amax(q1, out_dir / "calibration_snr_vs_amax.png")
        plot_more_calibration(q2, real, out_dir / "calibration_more_data.png")
        plot_outliers(q3, out_dir / "calibration_outliers.png")
    mode = "--quick" if scale is QUICK else "(full)"
    page = f"""# Calibration study: choosing the static NVFP4 activation global amax

Generated by `python tutorials/calibration_study.py {mode}` in {seconds:.0f} s (CPU, torch
{torch.__version__}). Every number below is measured by that script; rerun it to regenerate this
page and its plots.

NVFP4 quantizes each 16-element block with its own FP8 (E4M3) scale, under one FP32 global scale
per tensor: `block scale = fp8(block_amax / 6 / (g_amax / 2688))`. A static global amax `g_amax`
fixes that global scale before inference. Two things can go wrong: a block whose amax exceeds
`g_amax` saturates (FP8's largest scale is 448), and a block whose amax is below
`g_amax / 28672` gets a subnormal block scale, which torchao clamps to FP8's smallest normal, so
its small values round to zero. Between the two lies a window 28672 wide (FP8's normal range).
The B_min recipe (`g_amax = max(rho * B_min, margin * B_max)`, B_min / B_max the 1st / {DEFAULT_B_MAX_PERCENTILE:g}th
percentiles of block amaxes) places the smallest typical blocks just above the subnormal edge
and spends the rest of the window as headroom above what calibration saw.

Synthetic sets: {scale.n_calib:,} calibration and {scale.n_test:,} test samples, rows of
{ROW_WIDTH}.

## Summary (measured)

{summary(q1, q2, q3, real)}

{q1_section(q1)}
{q2_section(q2, real)}
{q3_section(q3)}"""
    path = out_dir / "calibration_study.md"
    path.write_text(page)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes, no real model (< 1 min)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("calibration_study_out"),
                        help="where calibration_study.md and the PNGs go (default: %(default)s)")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else FULL
    # Log-normal s=3 spans more than FP8's range by design; the tables report B_max / B_min.
    warnings.filterwarnings("ignore", message=".*B_max / B_min")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    torch.manual_seed(0)
    q1 = choose_global_amax(scale)
    print(f"[{time.perf_counter() - start:.0f} s] 1. global amax choice done", flush=True)
    q2 = more_calibration(scale)
    print(f"[{time.perf_counter() - start:.0f} s] 2. more calibration done", flush=True)
    q3 = unseen_outliers(scale)
    print(f"[{time.perf_counter() - start:.0f} s] 3. unseen outliers done", flush=True)
    real = real_model() if scale.real_model else None
    if real is not None:
        print(f"[{time.perf_counter() - start:.0f} s] real model done", flush=True)
    path = write_report(args.out_dir, scale, q1, q2, q3, real, time.perf_counter() - start)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
