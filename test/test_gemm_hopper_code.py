"""The GEMM tables' kernels as ptxas builds them for Hopper (sm_90a), checked on any machine.

ptxas serializes every wgmma of a kernel (it says so in its note C7515) when a path through the
kernel defines accumulator registers while wgmmas may be in flight. The K loop of a split K has
dynamic bounds; if the compiler cannot rule out a split without K tiles, the loop's zero-trip
path zeroes the accumulator there, and every K tile then waits for its MMAs before the next
dequantization starts (``kernels.gemm`` tells the compiler that no split is empty). The wgmma
tiles, whose asynchronous MMAs keep more registers live, must not spill them to local memory
either (not checked for the mma.sync tiles of M <= 4: with Triton 3.9 the M <= 4 entry spills 4
bytes where its programs sum the K splits, with Triton 3.6 none). An 8-warp wgmma tile
must not fit twice on one SM: the wide 128 x 128 x 64 tiles with 8 warps and 3 or 4 stages (two
per SM by registers and shared memory) gave outputs that differed between launches, some with NaN,
exactly where two of their programs shared an SM (4096 x 14336 at M = 200 and 256: 224 programs;
never at 112 or 64 programs), and none with 6 stages (one per SM); 4-warp tiles two per SM gave
none (H100, Triton 3.6; cause not found). Each table entry (the dense GEMM's and the grouped
GEMM's) is built as its launcher would launch it on an H100 (132 SMs) and handed to the ptxas
that ships with Triton.
"""

import re
import subprocess
import warnings
from typing import NamedTuple
from unittest import mock

import pytest
import torch

from nvfp4_static.kernels import gemm, grouped_gemm
from nvfp4_static.kernels.gemm import GemmConfig, launch_nvfp4_gemm
from nvfp4_static.kernels.grouped_gemm import GROUPED_GEMM_CONFIGS, GroupedGemmConfig, launch_grouped_nvfp4_gemm
from nvfp4_static.kernels.launch import KernelCall, ceil_div

triton = pytest.importorskip("triton")
nvidia_compiler = pytest.importorskip("triton.backends.nvidia.compiler")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H100_SMS = 132
H100_REGISTERS_PER_SM = 65536
H100_SHARED_BYTES_PER_SM = 233472  # 228 KiB, of which each resident program reserves 1 KiB
N = K = 4096
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32"}
TABLE_GEMMS = gemm.triton_entries()


def recorded_gemm_launch(M: int, config: GemmConfig, sum_splits_in_gemm: bool, K: int = K) -> KernelCall:
    """The GEMM's ``KernelCall`` as ``launch_nvfp4_gemm`` makes it for ``M x K`` by ``N x K`` on
    an H100 (the split K sized for its SMs), without launching anything."""
    raw = config.activation_rows > 0
    a = torch.zeros(M, K, dtype=torch.bfloat16 if raw else torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    block_scales = torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn)
    scale = torch.ones(())
    out = torch.empty(M, N, dtype=torch.bfloat16)
    bias = torch.zeros(N, dtype=torch.bfloat16)
    calls = []
    with mock.patch.object(KernelCall, "launch", lambda call: calls.append(call)), mock.patch.object(
        gemm, "_multiprocessor_count", return_value=H100_SMS
    ):
        launch_nvfp4_gemm(a, qdata, block_scales, scale, scale, bias, out, config, raw, sum_splits_in_gemm)
    return calls[0]


def recorded_grouped_gemm_launch(config: GroupedGemmConfig, K: int = K) -> KernelCall:
    """The grouped GEMM's launch for 8 experts of ``N x K`` weights and 512 routed rows, as
    ``launch_grouped_nvfp4_gemm`` makes it, without launching anything."""
    experts, rows = 8, 512
    x = torch.zeros(rows, K, dtype=torch.bfloat16)
    offsets = torch.arange(0, rows + 1, rows // experts, dtype=torch.int32)
    qdata = torch.zeros(experts, N, K // 2, dtype=torch.uint8)
    block_scales = torch.zeros(experts, N, K // 16, dtype=torch.float8_e4m3fn)
    scales = torch.ones(experts)
    out = torch.empty(rows, N, dtype=torch.bfloat16)
    calls = []
    with mock.patch.object(grouped_gemm, "launch_prepared", lambda call, device: calls.append(call)):
        launch_grouped_nvfp4_gemm(x, offsets, qdata, block_scales, scales, scales, out, config)
    (call,) = [call for call in calls if call.kernel is grouped_gemm._grouped_nvfp4_gemm_kernel]
    return call


class HopperBuild(NamedTuple):
    """A kernel as compiled for sm_90a: its PTX, what ``ptxas -v`` says of it, its shared memory
    bytes per program and its warps."""

    ptx: str
    report: str
    shared_bytes: int
    num_warps: int


def ptxas_report_for_sm90(call: KernelCall, tmp_path) -> HopperBuild:
    """``call``'s kernel compiled for sm_90a (the FP8 dequantization a GPU runs, pointers 16-byte
    aligned as Triton specialises them) and handed to ptxas."""
    kernel = call.kernel
    values = dict(zip(kernel.arg_names, call.args))
    values.update((name, value) for name, value in call.meta.items() if name in kernel.arg_names)
    values["PTX"] = True  # the launch on CPU tensors asked for the interpreter's plain-Triton twin
    options = {name: value for name, value in call.meta.items() if name not in kernel.arg_names}
    return build_for_sm90(kernel, values, options, tmp_path)


def build_for_sm90(kernel, values: dict, options: dict, tmp_path, source_class=ASTSource) -> HopperBuild:
    """``kernel`` with its parameters' ``values`` compiled for sm_90a (tensors 16-byte aligned,
    integers plain ``i32``, other arguments as Triton specialises them) and handed to ptxas;
    ``source_class`` is Gluon's for a Gluon kernel."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[param.name] = "i32"
        else:
            signature[param.name] = native_specialize_impl(BaseBackend, value, False, True, True)[0]
    source = source_class(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    # FP fusion as the launches get it from Triton 3.6 on the GPU machines (its default there; later
    # Triton versions change the default).
    options = {"enable_fp_fusion": True, **options}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    ptx_path = tmp_path / "gemm.ptx"
    ptx_path.write_text(ptx)
    ptxas = nvidia_compiler.get_ptxas(90).path
    report = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", str(tmp_path / "gemm.cubin")],
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, f"ptxas exited with {report.returncode}:\n{report.stderr}"
    return HopperBuild(ptx, report.stdout + report.stderr, compiled.metadata.shared, compiled.metadata.num_warps)


def programs_per_h100_sm(build: HopperBuild) -> int:
    """How many programs of ``build`` an H100 SM holds at once, by registers (allocated per warp
    in steps of 8 per thread) and by shared memory."""
    registers = int(re.search(r"Used (\d+) registers", build.report).group(1))
    by_registers = H100_REGISTERS_PER_SM // (ceil_div(registers, 8) * 8 * 32 * build.num_warps)
    by_shared = H100_SHARED_BYTES_PER_SM // (build.shared_bytes + 1024)
    return min(by_registers, by_shared)


WIDE_TILE_NAMES = {
    gemm.TALL_TILE: "-tall",
    gemm.SQUARE_TILE: "-square",
    **{tile: "-split-square" for tile in gemm.SPLIT_SQUARE_TILES.values()},
    **{tile: "-split-tall" for tile in gemm.SPLIT_TALL_TILES.values()},
}


def table_cases():
    """Each table GEMM, with its K split's sum in the GEMM and after it where it splits K; the
    tall tile's split form only with the sum after it, as its Gluon kernel takes it (the table
    runs that tile in Triton only for an operand the Gluon kernel does not take, none of the routes'
    own, and there its in-GEMM sum spills)."""
    cases = []
    for max_m, config in TABLE_GEMMS:
        sums = (True, False) if config.programs_per_sm else (True,)
        for in_gemm in (False,) if config in gemm.SPLIT_TALL_TILES.values() else sums:
            wide = WIDE_TILE_NAMES.get(config, "")
            cases.append(pytest.param(max_m, config, in_gemm, id=f"m{max_m}{wide}-{'in-gemm' if in_gemm else 'epilogue'}"))
    return cases


def assert_safe_on_hopper(build: HopperBuild, entry: str) -> None:
    """No serialized wgmmas; where the kernel has wgmmas, no spilled registers and, with 8 warps,
    one program per SM."""
    assert "C7515" not in build.report, f"ptxas serializes the wgmmas of {entry}:\n{build.report}"
    if "wgmma.mma_async" in build.ptx:
        assert " 0 bytes spill stores" in build.report, f"{entry} spills registers:\n{build.report}"
        if build.num_warps == 8:
            assert programs_per_h100_sm(build) == 1, (
                f"two programs of {entry} fit on one H100 SM ({build.shared_bytes} bytes of shared "
                f"memory):\n{build.report}"
            )


@pytest.mark.parametrize("M,config,sum_splits_in_gemm", table_cases())
def test_table_gemm_wgmmas_are_not_serialized_on_hopper(M, config, sum_splits_in_gemm, tmp_path):
    """Also: where the entry's K split may grow to ``fill_programs_per_sm`` programs per SM, that
    many fit on one H100 SM at once, so the grown grid runs in one wave."""
    build = ptxas_report_for_sm90(recorded_gemm_launch(M, config, sum_splits_in_gemm), tmp_path)
    uses_wgmma = "wgmma.mma_async" in build.ptx
    assert uses_wgmma == (config.weight_as_mma_a or config.block_m >= 64), (M, config)
    assert_safe_on_hopper(build, f"the M <= {M} entry {config}")
    assert programs_per_h100_sm(build) >= config.fill_programs_per_sm, (M, config, build.report)


@pytest.mark.parametrize("config", [config for _, config in GROUPED_GEMM_CONFIGS], ids=str)
def test_grouped_gemm_wgmmas_are_not_serialized_on_hopper(config, tmp_path):
    build = ptxas_report_for_sm90(recorded_grouped_gemm_launch(config), tmp_path)
    assert ("wgmma.mma_async" in build.ptx) == (config.weight_as_mma_a or config.block_m >= 64), config
    assert_safe_on_hopper(build, f"the grouped GEMM entry {config}")


@pytest.mark.parametrize(
    "kernel,M,K",
    [("dense", 1, 4112), ("dense", 4, 4112), ("dense", 16, 4128), ("grouped", None, 4112)],
    ids=["quantizing-entry", "deinterleaved-operand", "mma-order-operand", "grouped"],
)
def test_kernels_with_partial_k_tiles_build_without_warnings(kernel, M, K, tmp_path, monkeypatch):
    """Where K is no whole number of K tiles the kernels mask their loads along K; Triton warns
    where a mask combines tensors with ``and`` / ``or`` (deprecated for tensors), so the kernels
    must build without a warning from our sources: the M = 1 entry quantizing its raw rows, the
    M <= 4 entry reading the block-deinterleaved operand (K = 16 x 257), the M <= 16 entry reading
    the MMA-ordered one (K = 32 x 129), and the grouped GEMM."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # built anew: warnings come from the front end
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kernel == "grouped":
            call = recorded_grouped_gemm_launch(GROUPED_GEMM_CONFIGS[0][1], K)
        else:
            call = recorded_gemm_launch(M, gemm.config_for_width(gemm.gemm_config(M), K), True, K)
        assert not call.meta["EVEN_K"]
        ptxas_report_for_sm90(call, tmp_path)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "nvfp4_static" in str(w.filename)]
    assert ours == []
