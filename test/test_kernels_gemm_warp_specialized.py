"""The warp-specialized Hopper tile (``kernels.gemm_warp_specialized``, Gluon).

Gluon kernels do not run in Triton's interpreter: on any machine the kernel is built for sm_90a
and its build checked; on a Hopper GPU its output is compared with the Triton kernel's for the
same tile (``gemm.TALL_TILE_IN_TRITON``, itself tested against the torch reference on the CPU
through the interpreter), bit for bit, and with a float64 reference.
"""

import contextlib
import gc
import re
import weakref
from dataclasses import replace

import pytest
import torch
from conftest import PassThrough, gpu_tolerance, relative_error, requires_cuda
from test_kernels_gemm import gemm_operands, reference_gemm

from nvfp4_static.kernels import gemm, gemm_decode_warp_specialized, gemm_warp_specialized, launch, nvfp4_gemm, ops
from nvfp4_static.kernels.gemm import (
    DECODE_TILE,
    DECODE_TILE_IN_TRITON,
    SQUARE_TILE,
    SQUARE_TILE_IN_TRITON,
    TALL_TILE,
    TALL_TILE_IN_TRITON,
    config_for_width,
    launch_nvfp4_gemm,
)

H100_SHARED_BYTES_PER_BLOCK = 232448  # 227 KiB


def test_only_the_kernels_own_tiles_may_ask_for_it():
    """The wide tiles as they are or with their K split for one program per SM (over any number
    of row tiles); nothing else, nor the decode tile split otherwise than it is."""
    for tile in (TALL_TILE_IN_TRITON, SQUARE_TILE_IN_TRITON):
        for other in (
            replace(tile, block_m=64),
            replace(tile, block_m=512),
            replace(tile, block_n=64),
            replace(tile, block_k=64),
            replace(tile, num_warps=4),
            replace(tile, mma_order=False),
            replace(tile, weight_as_mma_a=False),
            replace(tile, programs_per_sm=2),
            replace(tile, programs_per_sm=2, row_tiles_for_split=2),
            replace(tile, programs_per_sm=1, fill_programs_per_sm=2),
            replace(tile, programs_per_sm=1, block_n=64),
            replace(tile, activation_rows=16),
        ):
            with pytest.raises(ValueError, match="warp_specialized runs gemm_warp_specialized's kernel"):
                replace(other, warp_specialized=True)
        for split in (replace(tile, programs_per_sm=1), replace(tile, programs_per_sm=1, row_tiles_for_split=4)):
            assert replace(split, warp_specialized=True).warp_specialized
    for other in (replace(DECODE_TILE_IN_TRITON, programs_per_sm=1), replace(DECODE_TILE_IN_TRITON, programs_per_sm=2)):
        with pytest.raises(ValueError, match="warp_specialized runs gemm_warp_specialized's kernel"):
            replace(other, warp_specialized=True)
    assert replace(TALL_TILE_IN_TRITON, warp_specialized=True) == TALL_TILE
    assert replace(SQUARE_TILE_IN_TRITON, warp_specialized=True) == SQUARE_TILE
    assert (TALL_TILE.block_m, SQUARE_TILE.block_m) == gemm_warp_specialized.TOKENS_PER_TILE


@pytest.mark.parametrize("tile", [TALL_TILE, SQUARE_TILE], ids=["tall", "square"])
def test_a_width_without_the_mma_order_runs_the_triton_tile(tile):
    assert config_for_width(tile, 4096).warp_specialized
    assert config_for_width(tile, 4112) == replace(tile, mma_order=False, warp_specialized=False)


def test_not_available_off_hopper_gpus(monkeypatch):
    assert not gemm_warp_specialized.available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter cannot run a Gluon kernel
    assert not gemm_warp_specialized.available(torch.device("cuda"))


def test_takes_only_what_tma_can_read():
    """The operand fp16, contiguous, 16-byte aligned, K a multiple of 32 (the packed weight's rows
    16-byte aligned), the weight contiguous and aligned, the output's rows contiguous."""
    M, N, K = 8, 64, 64
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert gemm_warp_specialized.takes(a, qdata, out)
    unaligned = torch.zeros(M * K + 4, dtype=torch.float16)[4:].view(M, K)
    unaligned_weight = torch.zeros(N * K // 2 + 8, dtype=torch.uint8)[8:].view(N, K // 2)
    narrow = torch.zeros(M, K + 16, dtype=torch.float16)
    for refused in (
        (a.bfloat16(), qdata, out),
        (a.float(), qdata, out),
        (torch.zeros(K, M, dtype=torch.float16).t(), qdata, out),
        (unaligned, qdata, out),
        (narrow[:, 16:], qdata, out),
        (torch.zeros(M, 48, dtype=torch.float16), torch.zeros(N, 24, dtype=torch.uint8), out),
        (a, torch.zeros(K // 2, N, dtype=torch.uint8).t(), out),
        (a, unaligned_weight, out),
        (a, qdata, torch.empty(N, M, dtype=torch.bfloat16).t()),
    ):
        assert not gemm_warp_specialized.takes(*refused)


needs_gluon_hopper = pytest.mark.skipif(
    not gemm_warp_specialized.HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API"
)


@needs_gluon_hopper
@pytest.mark.parametrize(
    "M,tile,tokens,wgmma_tokens,split_k",
    [
        (512, 256, 256, [256], 1),
        (384, 256, 192, [64, 128], 1),
        (512, 128, 128, [128], 1),
        (128, 128, 128, [128], 4),
        (384, 256, 192, [64, 128], 2),
        (129, 256, 144, [16, 128], 1),
        (288, 256, 144, [16, 128], 2),
        (72, 128, 80, [16, 64], 4),
    ],
    ids=["tall", "short-tall", "square", "split-square", "split-short-tall", "shortest-tall", "split-shortest-tall",
         "split-short-square"],
)
def test_sm90a_build_keeps_three_warpgroups_without_spills(M, tile, tokens, wgmma_tokens, split_k, tmp_path):
    """What the GPU tests cannot show on a machine without one: ptxas builds the kernel for
    sm_90a with a producer and two consumer warpgroups (setmaxnreg to the consumers' registers),
    the weight as the wgmma's register operand (m64 by the program's activation rows, one wgmma
    per power of 2 in them: 192 as 128 + 64, 144 as 128 + 16, 80 as 64 + 16), nothing spilled
    to local memory, and its stages within one SM's shared memory; also where it writes a K
    split's partial products."""
    from test_gemm_hopper_code import build_for_sm90
    from triton.experimental.gluon._runtime import GluonASTSource

    N, K = 4096, 4096
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    scale = torch.ones(1)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    bias = torch.zeros(N, dtype=torch.bfloat16)
    partials = torch.empty(split_k, M, N) if split_k > 1 else None
    grid, args, meta = gemm_warp_specialized.kernel_arguments(a, qdata, qdata, scale, scale, bias, out, tile, partials)
    assert meta["BLOCK_M"] == tokens and grid[0] == -(-M // tokens) * (N // gemm_warp_specialized.WEIGHT_ROWS_PER_TILE)
    assert grid[1] == split_k and meta["WRITE_PARTIALS"] == (split_k > 1)
    kernel = gemm_warp_specialized._warp_specialized_gemm_kernel
    values = dict(zip(kernel.arg_names, args), **{k: v for k, v in meta.items() if k in kernel.arg_names})
    options = {k: v for k, v in meta.items() if k not in kernel.arg_names}
    build = build_for_sm90(kernel, values, options, tmp_path, GluonASTSource)
    ptx, report = build.ptx, build.report
    assert build.num_warps == 12
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{gemm_warp_specialized.CONSUMER_REGISTERS};" in ptx
    # Register A operand: a brace list of registers before the descriptor of B.
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.f16\.f16 (\S)", ptx)
    assert sorted({int(n) for n, _ in wgmmas}) == wgmma_tokens and {a for _, a in wgmmas} == {"{"}
    assert "C7515" not in report, report
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "spill" not in report or re.search(r" 0 bytes spill stores", report), report
    block_k = gemm_warp_specialized.BLOCK_K
    stage_bytes = tokens * block_k * 2 + gemm_warp_specialized.WEIGHT_ROWS_PER_TILE * block_k // 2  # fp16, packed
    assert gemm_warp_specialized.STAGES[tokens] * stage_bytes <= build.shared_bytes <= H100_SHARED_BYTES_PER_BLOCK


@pytest.mark.parametrize(
    "M,tile,tokens",
    [(1, 256, 144), (144, 256, 144), (145, 256, 192), (192, 256, 192), (193, 256, 256), (256, 256, 256),
     (257, 256, 144), (288, 256, 144), (289, 256, 192), (384, 256, 192), (385, 256, 256), (512, 256, 256),
     (513, 256, 192), (700, 256, 256), (1, 128, 80), (80, 128, 80), (81, 128, 128), (160, 128, 80),
     (161, 128, 128), (300, 128, 128), (512, 128, 128)],
)
def test_programs_take_the_fewest_rows_that_hold_their_share(M, tile, tokens):
    """As many programs as the tile's; each takes the fewest rows holding its share of M: 144,
    192 or 256 in the tall tile (M = 513 in three programs of 171 rows: 192), 80 or 128 in the
    square one."""
    assert gemm_warp_specialized.tokens_per_program(M, tile) == tokens


def test_every_program_size_is_one_or_two_wgmmas_with_its_stages():
    """The kernel takes a program's rows as a wgmma of the largest power of 2 in them and one of
    the rest, which must be a power of 2 as well (Gluon's shapes); each size has its stages, and
    each tile's largest is the tile's rows."""
    for tile, sizes in gemm_warp_specialized.PROGRAM_TOKENS.items():
        assert sizes == tuple(sorted(sizes)) and sizes[-1] == tile
        for tokens in sizes:
            lead = 1 << (tokens.bit_length() - 1)
            rest = tokens - lead
            assert rest & (rest - 1) == 0 and rest % 16 == 0, tokens
            assert tokens in gemm_warp_specialized.STAGES, tokens


@needs_gluon_hopper
@pytest.mark.parametrize("tokens", [0, 16, 64, 192, 512])
def test_kernel_arguments_refuse_tiles_the_kernel_lacks(tokens):
    M, N, K = 8, 64, 64
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    scale = torch.ones(1)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"tiles of \(256, 128\) activation rows, got {tokens}"):
        gemm_warp_specialized.kernel_arguments(a, qdata, qdata, scale, scale, None, out, tokens)


def hopper_with_gluon() -> bool:
    return torch.cuda.is_available() and gemm_warp_specialized.available(torch.device("cuda"))


requires_hopper = pytest.mark.skipif(not hopper_with_gluon(), reason="needs a Hopper GPU and Gluon")


class CountingLaunches:
    """Counts a Gluon kernel's launches through its launcher ``module.name`` (patched in for a
    test), by default the warp-specialized wide tiles'."""

    def __init__(self, monkeypatch, module=gemm_warp_specialized, name="launch_warp_specialized_gemm"):
        self.count = 0
        launch = getattr(module, name)

        def counted(*args):
            self.count += 1
            launch(*args)

        monkeypatch.setattr(module, name, counted)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K",
    [(512, 8192, 8192), (300, 14336, 4096), (257, 4160, 4128), (1, 96, 32), (700, 200, 14336), (384, 8192, 4096),
     (150, 2048, 1024), (129, 4096, 2048), (72, 4096, 2048)],
    ids=str,
)
@pytest.mark.parametrize(
    "tile",
    [
        TALL_TILE,
        SQUARE_TILE,
        gemm.SPLIT_SQUARE_TILES[128],
        gemm.SPLIT_TALL_TILES[512],
    ],
    ids=["tall", "square", "split-square", "split-tall"],
)
def test_gpu_warp_specialized_equals_the_triton_tile_bit_for_bit(tile, dtype, with_bias, M, N, K, monkeypatch):
    """Row, column and K edges (M, N and K not multiples of the tile; one row; fewer weight rows
    than one tile's, so one consumer's rows are partly outside the weight), the tall tile's
    programs of 144 and 192 rows (M = 1, 129, 150, 257, 300, 384) and the square tile's of 80
    (M = 1, 72, 150: both of their wgmmas' tokens full, partly or wholly past M), and K split
    for one program per SM (the split sized for the GPU: on 132 SMs 2 to 56 splits on three to
    five of these weights, the last one shorter at K = 4128): the same output as the Triton
    kernel of the same tile and split, bit for bit, within the fp64 reference's bound."""
    operand, *weight = gemm_operands(M, N, K, seed=M, device="cuda", config=tile)
    weight[-1] = weight[-1] if with_bias else None
    launches = CountingLaunches(monkeypatch)
    ours = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, *weight, ours, tile)
    assert launches.count == 1
    triton_tile = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, *weight, triton_tile, replace(tile, warp_specialized=False))
    assert launches.count == 1
    assert torch.equal(ours, triton_tile)
    plain = gemm_operands(M, N, K, seed=M, device="cuda")[0]
    assert relative_error(ours, reference_gemm(plain, *weight)) <= gpu_tolerance(K, dtype)


@requires_cuda
@requires_hopper
def test_gpu_unaligned_operand_runs_the_triton_tile(monkeypatch):
    """TMA needs 16-byte aligned rows: an operand starting 8 bytes into its buffer takes the
    Triton kernel, with the same output."""
    M, N, K = 300, 8192, 4096
    operand, *weight = gemm_operands(M, N, K, seed=3, device="cuda", config=TALL_TILE)
    buffer = torch.empty(M * K + 4, dtype=torch.float16, device="cuda")
    unaligned = buffer[4:].view(M, K)
    unaligned.copy_(operand)
    launches = CountingLaunches(monkeypatch)
    out = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_gemm(unaligned, *weight, out, TALL_TILE)
    assert launches.count == 0
    expected = torch.empty_like(out)
    launch_nvfp4_gemm(operand, *weight, expected, TALL_TILE)
    assert launches.count == 1
    assert torch.equal(out, expected)


@requires_cuda
@requires_hopper
def test_gpu_prepared_launches_keep_no_tensor_alive(monkeypatch):
    """The kernel's launches are prepared once per specialisation and kept; what is kept holds
    none of the first call's tensors (its TMA descriptors would): a weight launched with is
    freed once the caller drops it."""
    monkeypatch.setattr(launch, "_PREPARED", {})
    M, N, K = 300, 4096, 4096
    operand, qdata, *rest = gemm_operands(M, N, K, seed=7, device="cuda", config=TALL_TILE)
    launches = CountingLaunches(monkeypatch)
    out = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_gemm(operand, qdata, *rest, out, TALL_TILE)
    assert launches.count == 1 and len(launch._PREPARED) == 1
    weight_alive = weakref.ref(qdata)
    operand_alive = weakref.ref(operand)
    del qdata, operand
    gc.collect()
    assert weight_alive() is None and operand_alive() is None


def counting_launches(monkeypatch, tile) -> CountingLaunches:
    """Counts the launches of the Gluon kernel that runs ``tile``."""
    if gemm.is_decode_tile(tile):
        return CountingLaunches(monkeypatch, gemm_decode_warp_specialized, "launch_decode_gemm")
    return CountingLaunches(monkeypatch)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize(
    "M,N,K,tile",
    [
        (512, 8192, 8192, TALL_TILE),
        (128, 8192, 8192, gemm.SPLIT_SQUARE_TILES[128]),
        (256, 8192, 8192, gemm.SPLIT_TALL_TILES[256]),
        (16, 28672, 8192, DECODE_TILE),
        (1024, 4096, 4096, TALL_TILE),
    ],
    ids=["tall", "split-square", "split-tall", "decode", "tall-over-cublas"],
)
def test_gpu_compiled_op_reaches_the_warp_specialized_kernel(M, N, K, tile, monkeypatch):
    """Traced, a warp-specialized tile is an opaque op (Inductor cannot trace a Gluon kernel): a
    fullgraph compile of the GEMM op where the table takes the tile (a split one handed its split)
    launches its kernel and gives eager's output."""
    assert gemm.table_config(M, None, N, K, torch.device("cuda")) == tile
    operand, qdata, scales, act_scale, weight_scale, bias = gemm_operands(M, N, K, seed=5, device="cuda", config=tile)
    launches = counting_launches(monkeypatch, tile)

    def linear(a):
        return nvfp4_gemm(a, qdata, scales, act_scale, weight_scale, bias, torch.bfloat16)

    eager = linear(operand)
    assert launches.count == 1
    compiled = torch.compile(linear, fullgraph=True)(operand)
    assert launches.count == 2
    assert torch.equal(compiled, eager)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize(
    "tile,N,launching", [(TALL_TILE, 14336, (300, 700)), (DECODE_TILE, 28672, (16, 3))], ids=["tall", "decode"]
)
def test_gpu_dynamic_shape_graph_branches_into_the_warp_specialized_kernel(tile, N, launching, monkeypatch):
    """A graph compiled for a dynamic token count holds every bucket's GEMM behind a cond; the
    warp-specialized tiles' are the opaque op. On a wide weight the tall tile's kernel launches at
    300 rows and at 700 (in cuBLAS's place, whose operand is another), not at 2100 (cuBLAS); on a
    wider one, unsplit with 16 K tiles (eager and compiled alike take the decode tile there), the
    decode tile's at 16 and 3 (the M <= 4 bucket too, whose entry takes another operand); at
    every token count tried the compiled linear gives the eager one's output."""
    from nvfp4_static.backends.triton_route import static_nvfp4_linear

    K = 4096
    _, qdata, scales, act_scale, weight_scale, bias = gemm_operands(1, N, K, seed=11, device="cuda")
    launches = counting_launches(monkeypatch, tile)

    def linear(x):
        return static_nvfp4_linear(x, qdata, scales, weight_scale, act_scale, bias)

    compiled = torch.compile(linear, dynamic=True, fullgraph=True)
    for M in (16, 300, 3, 17, 700, 2100):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        before = launches.count
        eager = linear(x)
        assert launches.count == before + (M in launching)
        assert torch.equal(compiled(x), eager)
        assert launches.count == before + 2 * (M in launching)


def test_the_op_refuses_cpu_tensors():
    """The op's fake (meta tensors, tracing) gives the output's shape; real tensors off CUDA are
    refused, naming the op and the device."""
    device = "cpu"
    M, N, K = 4, 64, 32
    a = torch.zeros(M, K, dtype=torch.float16, device=device)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones(1, device=device)
    op = torch.ops.nvfp4_static.warp_specialized_nvfp4_gemm.default
    for tokens in (256, 128):
        with pytest.raises(ValueError, match="warp_specialized_nvfp4_gemm runs on CUDA tensors, got cpu"):
            op(a, qdata, scales, scale, scale, None, torch.bfloat16, tokens)
        for split in ((), (2,)):
            fake = op(*(t.to("meta") for t in (a, qdata, scales, scale, scale)), None, torch.bfloat16, tokens, *split)
            assert fake.shape == (M, N) and fake.dtype == torch.bfloat16


@pytest.mark.parametrize("tokens", [0, 16, 64, 192, 512])
def test_the_op_refuses_tiles_the_kernel_lacks(tokens, monkeypatch):
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    M, N, K = 4, 64, 32
    operand, *weight = gemm_operands(M, N, K, seed=1, config=TALL_TILE)
    op = torch.ops.nvfp4_static.warp_specialized_nvfp4_gemm.default
    with pytest.raises(ValueError, match=rf"tiles of \[128, 256\] activation rows, got tokens_per_tile = {tokens}"):
        op(operand, *weight, torch.bfloat16, tokens)


@pytest.mark.parametrize("modes", [0, 1, 2], ids=["eager", "one-mode", "two-modes"])
@pytest.mark.parametrize("tile", [TALL_TILE, SQUARE_TILE], ids=["tall", "square"])
def test_launch_reaches_the_kernel_once_eagerly_or_through_the_op(tile, modes, monkeypatch):
    """The tile's launch, eager or not (under dispatch modes, as in tracing), reaches the kernel's
    launcher exactly once: not eager, it calls the op, whose body launches again, each mode
    handing the body one mode fewer. Stood in on the CPU: the kernel's launcher, availability
    and the op's device check are patched."""
    calls = []
    stand_in_for_the_kernel(monkeypatch, lambda *args: calls.append((args[6].fill_(1.0), args[7])))
    M, N, K = 4, 64, 32
    operand, *weight = gemm_operands(M, N, K, seed=1, config=tile)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    launch_under_dispatch_modes(modes, operand, weight, out, tile)
    assert [tokens for _, tokens in calls] == [tile.block_m]
    assert torch.equal(out, torch.ones_like(out))


def stand_in_for_the_kernel(monkeypatch, launcher) -> None:
    """On the CPU: the wide tiles' kernel available, taking every call, launched by ``launcher``;
    the op's device check off."""
    monkeypatch.setattr(gemm_warp_specialized, "available", lambda device: True)
    monkeypatch.setattr(gemm_warp_specialized, "takes", lambda a, weight_qdata, out: True)
    monkeypatch.setattr(gemm_warp_specialized, "launch_warp_specialized_gemm", launcher)
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)


def launch_under_dispatch_modes(modes: int, operand, weight: list, out, tile) -> None:
    """``tile``'s launch inside ``modes`` pass-through dispatch modes (as under tracing)."""
    with contextlib.ExitStack() as stack:
        for _ in range(modes):
            stack.enter_context(PassThrough())
        launch_nvfp4_gemm(operand, *weight, out, tile)


@pytest.mark.parametrize("modes", [0, 1, 2], ids=["eager", "one-mode", "two-modes"])
@pytest.mark.parametrize(
    "tile,tokens", [(gemm.SPLIT_SQUARE_TILES[128], 128), (gemm.SPLIT_TALL_TILES[256], 256)], ids=["square", "tall"]
)
def test_split_wide_tiles_reach_the_kernel_with_their_split_then_the_split_sum(tile, tokens, modes, monkeypatch):
    """The wide tiles with their K split, eager or through the op (which is handed the split the
    table sized): one launch of the kernel writing ``[split_k, M, N]`` partial products (8 K
    tiles of a 256 x 1024 weight in 4 splits of 2 on 132 SMs), then one of the epilogue kernel
    that sums them into the output. Stood in on the CPU, as above."""
    kernel_calls, epilogue_calls = [], []

    def kernel(a, weight_qdata, scale_codes, act_scale, weight_scale, bias, out, tokens, partials):
        kernel_calls.append((tokens, tuple(partials.shape)))

    def epilogue(partials, act_scale, weight_scale, bias, out):
        epilogue_calls.append(tuple(partials.shape))
        out.fill_(2.0)

    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    stand_in_for_the_kernel(monkeypatch, kernel)
    monkeypatch.setattr(gemm, "launch_epilogue", epilogue)
    M, N, K = 4, 256, 1024
    assert gemm.split_k_for(tile, N, K, torch.device("cuda")) == 4
    operand, *weight = gemm_operands(M, N, K, seed=1, config=tile)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    launch_under_dispatch_modes(modes, operand, weight, out, tile)
    assert kernel_calls == [(tokens, (4, M, N))] and epilogue_calls == [(4, M, N)]
    assert torch.equal(out, torch.full_like(out, 2.0))


@pytest.mark.parametrize("split_k", [0, -1, 5, 8, 9])
def test_the_op_refuses_a_split_that_leaves_a_part_without_k_tiles(split_k, monkeypatch):
    """K = 1024 holds 8 K tiles of 128: 5 splits of 2 leave the last empty, 8 splits of 1 do not,
    but the op takes 1 to 4 and 8; 0, a negative count and 9 are refused too, naming the op,
    K and the split."""
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    M, N, K = 4, 64, 1024
    operand, *weight = gemm_operands(M, N, K, seed=1, config=SQUARE_TILE)
    op = torch.ops.nvfp4_static.warp_specialized_nvfp4_gemm.default
    if split_k == 8:
        monkeypatch.setattr(gemm, "launch_nvfp4_gemm", lambda *args, **kwargs: None)
        monkeypatch.setattr(ops, "launch_nvfp4_gemm", lambda *args, **kwargs: None)
        assert op(operand, *weight, torch.bfloat16, 128, split_k).shape == (M, N)
        return
    with pytest.raises(ValueError, match=rf"splits K = 1024 \(8 K tiles\) into parts .* got split_k = {split_k}"):
        op(operand, *weight, torch.bfloat16, 128, split_k)


@needs_gluon_hopper
def test_kernel_arguments_refuse_partial_products_it_cannot_fill():
    """The partial products' buffer: ``[split_k, M, N]`` fp32, every split given K tiles (K =
    1024: 8 tiles); a wrong shape, dtype or split count is refused, naming the shapes."""
    M, N, K = 8, 64, 1024
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    scale = torch.ones(1)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    grid, args, meta = gemm_warp_specialized.kernel_arguments(
        a, qdata, qdata, scale, scale, None, out, 128, torch.empty(4, M, N)
    )
    assert grid[1] == 4 and meta["WRITE_PARTIALS"] and args[-1] == 4
    for partials in (
        torch.empty(4, M + 1, N),
        torch.empty(4, M, N - 1),
        torch.empty(M, N),
        torch.empty(4, M, N, dtype=torch.bfloat16),
        torch.empty(5, M, N),
        torch.empty(0, M, N),
        torch.empty(9, M, N),
    ):
        with pytest.raises(ValueError, match=r"partial products for M = 8, N = 64, K = 1024 are \[split_k, 8, 64\]"):
            gemm_warp_specialized.kernel_arguments(a, qdata, qdata, scale, scale, None, out, 128, partials)
