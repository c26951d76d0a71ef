"""The CPU's own kernels: the static NVFP4 linear (``cpu_kernel.c``) and, in the same library,
the FP8 weight-scale sweep (``cpu_sweep.c``, called by ``backends.cpu_sweep``), GPTQ's block
search (``cpu_gptq.c``, called by ``backends.cpu_gptq``) and the weight's quantize at convert
(``cpu_quantize.c``, called by ``backends.cpu_quantize``).

Torch ops on a CPU dequantize the weight into float32 before multiplying it, 11-19x float
``F.linear``'s time at one token (``examples/benchmarks/RESULTS.md``). The C kernel quantizes the
rows and multiplies them by the packed weight as small integers, without a float32 copy of it.
It is compiled with the machine's C compiler (``$CC``, else ``cc``) at its first use in a
process, for this CPU (``-march=native``, or without it where the compiler refuses that), and
cached, keyed by its source, the command and the CPU, in ``$NVFP4_STATIC_CACHE_DIR`` (default
``~/.cache/nvfp4_static``). Without a compiler it is not built: a warning says so once, and the
linears take the torch ops. ``NVFP4_STATIC_CPU_KERNEL=0`` turns it off. Built with AVX2 it takes
every row count; without, the calls of up to 16 rows (``Kernel.most_rows``).

Its numerics (``cpu_kernel.c``): the activation quantized as ``numerics`` quantizes it, each
16-block's product exact, the blocks summed in float32 in K order.
"""

import concurrent.futures
import ctypes
import hashlib
import math
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from nvfp4_static.messages import warn
from nvfp4_static.numerics import BLOCK_SIZE

SWITCH_ENV_VAR = "NVFP4_STATIC_CPU_KERNEL"
CACHE_ENV_VAR = "NVFP4_STATIC_CACHE_DIR"
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernel.c", "cpu_sweep.c", "cpu_gptq.c", "cpu_quantize.c"))
HEADERS = (Path(__file__).with_name("cpu_float.h"),)
# No -ffast-math, and no fused multiply-adds: every operation rounds as torch's does.
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-pthread")
NATIVE_FLAGS = ("-march=native",)

# Row-weight products per thread: a call splits its outputs across up to torch's thread count
# from twice this many products of its work, then one thread per eighth of it (the kernel's
# threads_for).
_PRODUCTS_PER_THREAD = 1 << 21

_lock = threading.Lock()
_library = None
_tried = False


def enabled() -> bool:
    """Whether ``$NVFP4_STATIC_CPU_KERNEL`` leaves the kernel on (unset, or anything but 0)."""
    return os.environ.get(SWITCH_ENV_VAR, "1").strip() != "0"


class Kernel(ctypes.CDLL):
    """The built library, with ``most_rows``: the rows one call takes (its ``nvfp4_most_rows``)."""

    most_rows: int


def library() -> Optional[Kernel]:
    """The built kernel, built at the first call; None where it is switched off or could not be
    built (then a warning said why, once)."""
    global _library, _tried
    if not enabled():
        return None
    if _tried:  # every eager call on a CPU asks: no lock once built
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _load(_build())
            except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
                detail = getattr(error, "stderr", None) or str(error)
                warn(
                    f"nvfp4_static: the CPU kernel ({', '.join(s.name for s in SOURCES)}) could not be "
                    f"built, so static NVFP4 linears, the weight-scale sweep, GPTQ's block search and "
                    f"the weights' quantize at convert on a CPU run torch ops, several times slower: "
                    f"{str(detail).strip()[-600:]}. Install a C compiler or point $CC at one; "
                    f"${SWITCH_ENV_VAR}=0 silences this.",
                    RuntimeWarning,
                )
            _tried = True  # after _library: the check outside the lock reads them in this order
        return _library


def in_row_pieces(rows: int, piece_rows: int, call: Callable[[int, int], None]) -> None:
    """``call(first, count)`` for pieces of ``piece_rows`` rows of ``rows``, on up to torch's
    thread count: each call a kernel call through ctypes, which releases the GIL."""
    firsts = range(0, rows, piece_rows)
    threads = min(torch.get_num_threads(), len(firsts))
    if threads <= 1:
        for first in firsts:
            call(first, min(piece_rows, rows - first))
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda first: call(first, min(piece_rows, rows - first)), firsts))


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _build() -> Path:
    """The kernel's shared library in the cache, for this CPU where the compiler can, else
    without ``-march=native``; compiled unless already there."""
    try:
        return _build_with([*_compiler(), *FLAGS, *NATIVE_FLAGS])
    except subprocess.CalledProcessError:
        return _build_with([*_compiler(), *FLAGS])


def _build_with(command: list[str]) -> Path:
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join(command).encode())
    key.update(_cpu_description().encode())
    directory = _cache_directory()
    built = directory / f"cpu_kernel-{key.hexdigest()[:20]}.so"
    if built.exists():
        return built
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / built.name
        subprocess.run(
            [*command, *map(str, SOURCES), "-o", str(partial), "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )
        os.replace(partial, built)  # atomic: another process may be building the same file
    return built


def _cpu_description() -> str:
    """What ``-march=native`` builds for: the machine and, on Linux, the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_directory() -> Path:
    """``$NVFP4_STATIC_CACHE_DIR``, else ``nvfp4_static`` in the user's cache; a fresh temporary
    directory where that cannot be written."""
    base = os.environ.get(CACHE_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nvfp4_static"
    )
    directory = Path(base)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="nvfp4_static_"))


def _load(path: Path) -> Kernel:
    lib = Kernel(str(path))
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.nvfp4_most_rows.restype = i32
    lib.nvfp4_quantize_rows.argtypes = [pointer, i32, i64, i64, pointer, pointer, pointer]
    lib.nvfp4_quantize_rows.restype = None
    lib.nvfp4_linear.argtypes = [
        pointer, i32, i64, i64, pointer, pointer, pointer, pointer, i64, pointer, pointer, i32, pointer, i32, i32, i64,
    ]
    lib.nvfp4_linear.restype = i32
    lib.nvfp4_fp8_scale_sweep.argtypes = [pointer, i32, i64, i64, i64, pointer, pointer, pointer, pointer]
    lib.nvfp4_fp8_scale_sweep.restype = None
    lib.nvfp4_gptq_block.argtypes = [pointer, i64, i64, pointer, pointer, pointer, i64, pointer, pointer, pointer]
    lib.nvfp4_gptq_block.restype = None
    lib.nvfp4_quantize_weight.argtypes = [pointer, i32, i64, i64, i64, pointer, pointer, pointer, pointer]
    lib.nvfp4_quantize_weight.restype = i64
    lib.most_rows = lib.nvfp4_most_rows()
    return lib


def static_nvfp4_linear_rows(
    lib: Kernel,
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale_values: torch.Tensor,
) -> torch.Tensor:
    """``backends.cpu.static_nvfp4_linear`` of ``x [..., K]`` (at most ``lib.most_rows`` rows, on
    a CPU) through the kernel; ``scale_values`` is ``numerics.e4m3_values_by_code``'s table."""
    check_operands(x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias)
    k, n = x.shape[-1], weight_qdata.shape[0]
    rows = math.prod(x.shape[:-1])
    act_scale = act_per_tensor_scale.to(torch.float32).contiguous()
    weight_scale = weight_per_tensor_scale.to(torch.float32).contiguous()
    x_rows = _as_kernel_rows(x)
    weight, weight_scales = weight_qdata.contiguous(), weight_block_scales.contiguous()
    if bias is not None:
        bias = bias.contiguous() if bias.dtype in (torch.bfloat16, torch.float32) else bias.to(torch.float32)
    bf16 = x.dtype == torch.bfloat16
    out = torch.empty((rows, n), dtype=torch.bfloat16 if bf16 else torch.float32, device="cpu")
    addresses = WeightAddresses(
        act_scale.data_ptr(), weight.data_ptr(), weight_scales.data_ptr(), scale_values.data_ptr(),
        weight_scale.data_ptr(),
    )
    call_kernel(lib, x_rows, rows, k, n, addresses, bias, out)
    out = out.reshape(*x.shape[:-1], n)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class WeightAddresses(NamedTuple):
    """The addresses of what the kernel reads besides the rows and the bias: the float32 global
    scales, the packed weight, its FP8 block scale codes and the table decoding them."""

    act_scale: int
    weight: int
    weight_scales: int
    scale_values: int
    weight_scale: int


def call_kernel(
    lib: Kernel,
    x_rows: torch.Tensor,
    rows: int,
    k: int,
    n: int,
    addresses: WeightAddresses,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
) -> None:
    """Write ``out`` (``rows x n``, bfloat16 where ``x_rows`` is, else float32) from the contiguous
    ``x_rows`` (``rows x k``, float32 or bfloat16), checked operands and ``bias`` (None, or a
    contiguous ``[n]`` in bfloat16 or float32); raise ``MemoryError`` where the kernel could not
    allocate its workspace, ``ValueError`` for more rows than it takes."""
    status = lib.nvfp4_linear(
        x_rows.data_ptr(), x_rows.dtype == torch.bfloat16, rows, k, addresses.act_scale, addresses.weight,
        addresses.weight_scales, addresses.scale_values, n, addresses.weight_scale,
        None if bias is None else bias.data_ptr(), bias is not None and bias.dtype == torch.bfloat16,
        out.data_ptr(), out.dtype == torch.bfloat16, torch.get_num_threads(), _PRODUCTS_PER_THREAD,
    )
    if status != 0:
        shapes = f"{rows} rows of {k} (a [{rows}, {k}] activation times a [{n}, {k}] weight)"
        if status == -1:
            raise MemoryError(f"nvfp4_static: the CPU kernel could not allocate its workspace for {shapes}")
        raise ValueError(f"nvfp4_static: the CPU kernel takes at most {lib.most_rows} rows, got {shapes}")


def reads_as_they_are(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can read ``tensors`` (a weight's packed codes, block scales and global
    scales, stacked or not) where they lie: plain, contiguous CPU tensors, the global scales (the
    last two) float32. Elsewhere ``static_nvfp4_linear_rows`` makes copies it can read."""
    return all(type(t) is torch.Tensor and t.is_cpu and t.is_contiguous() for t in tensors) and all(
        t.dtype == torch.float32 for t in tensors[-2:]
    )


def quantize_rows(lib: Kernel, rows: torch.Tensor, act_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantization of ``rows [M, K]`` (float32, bfloat16 or float16, on a CPU)
    under the float32 global scale ``act_scale``: twice the E2M1 values (int8 ``[M, K]``) and
    the block scales (float32 ``[M, K / 16]``), the values ``numerics.quantize_nvfp4_unpacked``
    gives."""
    rows = _as_kernel_rows(rows)
    m, k = rows.shape
    # One allocation: the int8 values, then the float32 scales (m * k is a multiple of 16, so
    # they start aligned).
    workspace = torch.empty(m * k + 4 * m * (k // BLOCK_SIZE), dtype=torch.uint8, device="cpu")
    twice_e2m1, scales = workspace[: m * k].view(torch.int8), workspace[m * k :].view(torch.float32)
    lib.nvfp4_quantize_rows(
        rows.data_ptr(), rows.dtype == torch.bfloat16, m, k, act_scale.data_ptr(), twice_e2m1.data_ptr(),
        scales.data_ptr(),
    )
    return twice_e2m1.view(m, k), scales.view(m, k // BLOCK_SIZE)


def _as_kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous in a dtype the kernel reads, float32 or bfloat16 (float16 to float32: exact)."""
    return (x.to(torch.float32) if x.dtype == torch.float16 else x).contiguous()


def check_operands(x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias):
    """Refuse operands the kernel would read out of bounds or misread, naming them: it reads raw
    memory, where torch ops would have raised."""
    k = x.shape[-1]
    n = weight_qdata.shape[0] if weight_qdata.dim() == 2 else -1
    problems = []
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        problems.append(f"activation dtype {x.dtype} (float32, bfloat16 or float16)")
    if k % BLOCK_SIZE:
        problems.append(f"activation's last dim {k} (a multiple of {BLOCK_SIZE})")
    if weight_qdata.dtype != torch.uint8 or tuple(weight_qdata.shape) != (n, k // 2):
        problems.append(f"packed weight {weight_qdata.dtype} {tuple(weight_qdata.shape)} (uint8 [N, {k // 2}])")
    if weight_block_scales.dtype != torch.float8_e4m3fn or tuple(weight_block_scales.shape) != (n, k // BLOCK_SIZE):
        problems.append(
            f"block scales {weight_block_scales.dtype} {tuple(weight_block_scales.shape)} "
            f"(float8_e4m3fn [{n}, {k // BLOCK_SIZE}])"
        )
    for name, scale in (("weight", weight_per_tensor_scale), ("activation", act_per_tensor_scale)):
        if scale.numel() != 1:
            problems.append(f"{name} global scale of shape {tuple(scale.shape)} (one value)")
    if bias is not None and tuple(bias.shape) != (n,):
        problems.append(f"bias of shape {tuple(bias.shape)} ([{n}])")
    devices = {t.device.type for t in (x, weight_qdata, weight_block_scales, weight_per_tensor_scale,
                                       act_per_tensor_scale, bias) if t is not None}
    if devices != {"cpu"}:
        problems.append(f"operands on {sorted(devices)} (all on the CPU)")
    if problems:
        raise ValueError(
            f"nvfp4_static: static NVFP4 linear of an activation {tuple(x.shape)}: " + "; ".join(problems)
        )
