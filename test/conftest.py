"""What several test files share: the GPU mark (and ``--gpu-only``, which runs only the tests
needing a GPU), the activation dtypes, error measures and bounds, numeric edges, the operands of
a quantized linear, and the calibrate-then-convert flow on the small models of ``models.py``."""

import contextlib
import warnings
from typing import NamedTuple, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchao.quantization import quantize_

from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable, references
from nvfp4_static.numerics import (
    E4M3_MIN_NORMAL,
    per_tensor_amax_to_scale,
    quantize_nvfp4,
    scale_reciprocal_overflows,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A test that needs a GPU says so in a skipif reason holding one of these words.
GPU_REASON_WORDS = ("CUDA", "GPU", "accelerator")


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-only",
        action="store_true",
        help="run only the tests that need a GPU (a skipif whose reason names CUDA, a GPU or an "
        "accelerator): on a GPU machine, what CPU-only CI cannot run",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-only"):
        return
    kept, dropped = [], []
    for item in items:
        reasons = [str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")]
        (kept if any(word in reason for reason in reasons for word in GPU_REASON_WORDS) else dropped).append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)


def device_waits(fn) -> list[str]:
    """Where ``fn()`` made the host wait for the GPU, as ``file:line`` of the Python call: what
    ``torch.cuda.set_sync_debug_mode`` warns about (a read of a GPU value, a blocking copy to
    the GPU, a stream synchronize; not an event synchronize)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)]

# The activation dtypes the kernels take, and their test ids.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# Width of the models in models.py and of the activations the flow tests calibrate them on.
DIM = 64


def captured_twice_then_replayed_backwards(call, stream) -> tuple[list, int]:
    """``call()`` (which returns its output) captured into two CUDA graphs one after the other on
    ``stream``, then, once every tile counter buffer kept for a capture holds 7s (what a graph
    pool's memory may hold) and the outputs NaN, replayed in the other order. Returns the two
    outputs in capture order and how many counter buffers the captures kept (each zeroed again
    after)."""
    from nvfp4_static.kernels import gemm

    graphs, outs, kept = [], [], []
    for _ in range(2):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1], stream=stream):
            outs.append(call())
        kept += [counts for key, counts in gemm._TILE_COUNTS.items() if key[2] is not None]
    try:
        for tensor in kept + outs:
            tensor.fill_(7 if tensor.dtype == torch.int32 else float("nan"))
        for graph in reversed(graphs):
            graph.replay()
        torch.cuda.synchronize()
    finally:
        for counts in kept:
            counts.zero_()
    return outs, len(kept)


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count set to ``threads`` while the block runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_refused(monkeypatch, name: str) -> None:
    """Make ``references.<name>`` fail, so that an op on CPU tensors that returns took its C
    kernel (``backends``) and not the torch reference."""

    def refuse(*args):
        raise AssertionError(f"took the torch reference {name}")

    monkeypatch.setattr(references, name, refuse)


def gpu_tolerance(K: int, dtype: torch.dtype) -> float:
    """Products of dequantized operands are exact; summing K of them in fp32 in any order errs by
    at most about K * 2^-24 relative; add one rounding of the output to ``dtype``, and allow 2x."""
    return 2 * (K * 2.0**-24 + UNIT_ROUNDOFF[dtype])


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``|out - reference| / |reference|`` (Frobenius, float64). A float64 reference is exact;
    any other must have ``out``'s dtype. A NaN in ``out`` (an element left unwritten) fails."""
    assert out.shape == reference.shape
    assert reference.dtype in (torch.float64, out.dtype)
    assert not out.isnan().any(), "NaN in the output (an element left unwritten?)"
    return ((out.double() - reference.double()).norm() / reference.double().norm()).item()


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    reference, approximation = reference.double(), approximation.double()
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approximation).pow(2).sum()))


def smallest_accepted_per_tensor_scale() -> torch.Tensor:
    """The smallest float32 per-tensor scale whose reciprocal divided by FP8's smallest normal
    (2^-6, the clamped scale of a zero block) is still finite: the edge below which the tensor
    refuses a global scale. Found by stepping up from the real-number bound."""
    scale = torch.tensor(1 / E4M3_MIN_NORMAL / torch.finfo(torch.float32).max)
    while scale_reciprocal_overflows(scale):
        scale = torch.nextafter(scale, torch.tensor(1.0))
    return scale


class LinearOperands(NamedTuple):
    x: torch.Tensor
    weight: torch.Tensor
    weight_qdata: torch.Tensor
    weight_block_scales: torch.Tensor
    act_scale: torch.Tensor
    weight_scale: torch.Tensor
    bias: Optional[torch.Tensor]


def linear_operands(M: int, N: int, K: int, seed: int, device: str = "cpu", block_gains: bool = False):
    """A float32 activation ``[M, K]``, a weight ``[N, K]`` (Gaussian rows of different
    magnitudes) packed to NVFP4, both global scales (each tensor's amax) and a bias ``[N]``, all
    from one generator seeded with ``seed``. ``block_gains`` multiplies each 16-block of the
    activation by its own power of two in 2^-8 .. 2^4, so that its block scales differ."""
    generator = torch.Generator(device).manual_seed(seed)
    if block_gains:
        gains = torch.exp2(torch.randint(-8, 5, (M, K // 16, 1), generator=generator, device=device).float())
        x = (torch.randn(M, K // 16, 16, generator=generator, device=device) * gains).reshape(M, K)
    else:
        x = torch.randn(M, K, generator=generator, device=device)
    weight = torch.randn(N, K, generator=generator, device=device) * torch.rand(N, 1, generator=generator, device=device)
    act_scale = per_tensor_amax_to_scale(x.abs().max())
    weight_scale = per_tensor_amax_to_scale(weight.abs().max())
    weight_qdata, weight_block_scales = quantize_nvfp4(weight, weight_scale)
    bias = torch.randn(N, generator=generator, device=device)
    return LinearOperands(x, weight, weight_qdata, weight_block_scales, act_scale, weight_scale, bias)


def calibration_batches(n=4, seed=0, dtype=torch.float32, scale=1.0):
    """``n`` seeded ``[2, 16, DIM]`` Gaussian batches times ``scale``."""
    generator = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(2, 16, DIM, generator=generator)).to(dtype) for _ in range(n)]


def make(model_cls, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return model_cls().to(dtype)


def all_but_lm_head(module, fqn):
    """The filter LLM flows use: every linear but the output projection."""
    return is_quantizable(module, fqn) and fqn != "lm_head"


def prepare(model, filter_fn=is_quantizable, **config):
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", **config), filter_fn=filter_fn)
    return model


def convert(model, filter_fn=is_quantizable, **config):
    quantize_(model, NVFP4StaticActivationConfig(step="convert", **config), filter_fn=filter_fn)
    return model


def quantized(model, dtype=torch.float32, batches=None, **config):
    """Prepare ``model`` with ``config``, calibrate it on ``batches`` (default: four
    ``calibration_batches`` of ``dtype``) and convert it, in place; return it."""
    prepare(model, **config)
    with torch.no_grad():
        for batch in calibration_batches(dtype=dtype) if batches is None else batches:
            model(batch)
    return convert(model, **config)


class PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op as it is: under it, launches are not eager (as under
    functionalization and fake tensors, which is how a traced graph runs them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
