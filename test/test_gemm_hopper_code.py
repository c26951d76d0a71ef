"""The GEMM table's kernels as ptxas builds them for Hopper (sm_90a), checked on any machine.

ptxas serializes every wgmma of a kernel (it says so in its note C7515) when a path through the
kernel defines accumulator registers while wgmmas may be in flight. The K loop of a split K has
dynamic bounds; if the compiler cannot rule out a split without K tiles, the loop's zero-trip
path zeroes the accumulator there, and every K tile then waits for its MMAs before the next
dequantization starts (``kernels.gemm`` tells the compiler that no split is empty). Each table
entry is built as ``launch_nvfp4_gemm`` would launch it on an H100 (132 SMs) and handed to the
ptxas that ships with Triton.
"""

import subprocess
from unittest import mock

import pytest
import torch

from nvfp4_static.kernels import gemm
from nvfp4_static.kernels.gemm import GEMM_CONFIGS, GemmConfig, launch_nvfp4_gemm
from nvfp4_static.kernels.launch import KernelCall

triton = pytest.importorskip("triton")
nvidia_compiler = pytest.importorskip("triton.backends.nvidia.compiler")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H100_SMS = 132
N = K = 4096
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32"}
TABLE_GEMMS = [(max_m, config) for max_m, config in GEMM_CONFIGS if isinstance(config, GemmConfig)]


def recorded_gemm_launch(M: int, config: GemmConfig, sum_splits_in_gemm: bool) -> KernelCall:
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


def ptxas_report_for_sm90(call: KernelCall, tmp_path) -> tuple[str, str]:
    """The PTX of ``call``'s kernel compiled for sm_90a (the FP8 dequantization a GPU runs, pointers
    16-byte aligned as Triton specialises them) and what ``ptxas -v`` says of it."""
    kernel = call.kernel
    values = dict(zip(kernel.arg_names, call.args))
    values.update((name, value) for name, value in call.meta.items() if name in kernel.arg_names)
    values["PTX"] = True  # the launch on CPU tensors asked for the interpreter's plain-Triton twin
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "i32"
    options = {name: value for name, value in call.meta.items() if name not in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options).asm["ptx"]
    ptx_path = tmp_path / "gemm.ptx"
    ptx_path.write_text(ptx)
    ptxas = nvidia_compiler.get_ptxas(90).path
    report = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", str(tmp_path / "gemm.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    return ptx, report.stdout + report.stderr


def table_cases():
    cases = []
    for max_m, config in TABLE_GEMMS:
        for in_gemm in (True, False) if config.programs_per_sm else (True,):
            cases.append(pytest.param(max_m, config, in_gemm, id=f"m{max_m}-{'in-gemm' if in_gemm else 'epilogue'}"))
    return cases


@pytest.mark.parametrize("M,config,sum_splits_in_gemm", table_cases())
def test_table_gemm_wgmmas_are_not_serialized_on_hopper(M, config, sum_splits_in_gemm, tmp_path):
    call = recorded_gemm_launch(M, config, sum_splits_in_gemm)
    ptx, report = ptxas_report_for_sm90(call, tmp_path)
    uses_wgmma = "wgmma.mma_async" in ptx
    assert uses_wgmma == (config.weight_as_mma_a or config.block_m >= 64), (M, config)
    assert "C7515" not in report, f"ptxas serializes the wgmmas of the M <= {M} entry {config}:\n{report}"
