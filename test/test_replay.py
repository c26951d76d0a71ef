"""kernels/replay.py: which tensors a replay takes from each call, and which launches it refuses.

The launches here are stand-ins kept under Triton's interpreter setting (their arguments are
recorded, nothing is compiled): what a replayed kernel would be handed.
"""

import pytest
import torch
from test_triton_eager import Descriptor, SeenKernel

from nvfp4_static.kernels.launch import KernelCall
from nvfp4_static.kernels.replay import ReplayedLaunches, reproduces


def _call(kernel, *args):
    return KernelCall(kernel, (1,), args, {})


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_views_inside_a_given_tensor_are_taken_at_the_same_offset_of_each_calls_tensor():
    """The weighted sum reads the routed end inside the expert offsets: a view of a given
    tensor, 8 bytes in, of another shape, is handed as the same view of the new tensor."""
    offsets, rows, weight = torch.arange(5, dtype=torch.int64), torch.zeros(3, 4), torch.ones(4)
    kernel = SeenKernel("offsets", "end", "rows", "weight")
    launches = ReplayedLaunches.of((offsets, rows), (1,), [_call(kernel, offsets, offsets[1:2], rows, weight)], (weight,), "cpu", None)
    new_offsets, new_rows = torch.arange(10, 15, dtype=torch.int64), torch.zeros(3, 4)
    launches((new_offsets, new_rows), None)
    seen_offsets, seen_end, seen_rows, seen_weight = kernel.seen[0]
    assert seen_offsets is new_offsets and seen_rows is new_rows and seen_weight is weight
    assert seen_end.shape == (1,) and int(seen_end) == 11
    assert seen_end.untyped_storage().data_ptr() == new_offsets.untyped_storage().data_ptr()


def test_scratch_buffers_come_from_the_arena_in_the_recorded_layout():
    x, out, scratch = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(4, 3, dtype=torch.float16)
    first, second = SeenKernel("x", "scratch"), SeenKernel("scratch", "out")
    launches = ReplayedLaunches.of((x, out), (1,), [_call(first, x, scratch), _call(second, scratch, out)], (), "cpu", None)
    launches((torch.ones(2, 8), torch.ones(2, 8)), None)
    written, read = first.seen[0][1], second.seen[0][0]
    assert written is read and written.data_ptr() != scratch.data_ptr()
    assert (written.shape, written.dtype) == (scratch.shape, scratch.dtype)


def test_launches_a_replay_cannot_redo_are_refused():
    """No launch; an output no launch takes; a strided scratch buffer; one scratch buffer under
    two shapes; a descriptor of a given tensor or of a view inside one."""
    x, out, weight = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8, dtype=torch.uint8)
    scratch = torch.zeros(4, 8)
    kernel = SeenKernel("a", "b", "c")
    refused = [
        [],
        [_call(kernel, x, weight, scratch)],
        [_call(kernel, x, scratch.t(), out)],
        [_call(kernel, x, scratch, out), _call(kernel, scratch.view(8, 4), out, weight)],
        [_call(kernel, Descriptor(x), weight, out)],
        [_call(kernel, x, weight, Descriptor(out[1:], (8,)))],
    ]
    for calls in refused:
        assert ReplayedLaunches.of((x, out), (1,), calls, (weight,), "cpu", None) is None, calls
    assert ReplayedLaunches.of((x, out), (1,), [_call(kernel, x, weight, out)], (weight,), "cpu", None) is not None


def test_poisoning_fills_the_replays_scratch_with_0xff_bytes_and_leaves_the_given_tensors():
    x, out, scratch = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(4, 3, dtype=torch.float16)
    first, second = SeenKernel("x", "scratch"), SeenKernel("scratch", "out")
    launches = ReplayedLaunches.of((x, out), (1,), [_call(first, x, scratch), _call(second, scratch, out)], (), "cpu", None)
    new_x, new_out = torch.ones(2, 8), torch.ones(2, 8)
    launches.poison_scratch()
    launches((new_x, new_out), None)
    arena_buffer = first.seen[0][1]
    assert arena_buffer.isnan().all()
    assert torch.equal(arena_buffer.view(torch.uint8), torch.full((4, 6), 0xFF, dtype=torch.uint8))
    assert torch.equal(new_x, torch.ones(2, 8)) and torch.equal(new_out, torch.ones(2, 8))


def test_reproduces_asks_for_the_same_bits():
    """NaNs with the same bits agree; each of a sign of zero, a NaN's payload, one bit of one
    value, a dtype, a shape and an index disagrees."""
    values = torch.tensor([1.5, float("nan"), 0.0, -2.25], dtype=torch.bfloat16)
    assert reproduces((values, torch.arange(3)), (values.clone(), torch.arange(3)))
    other_nan = values.clone()
    other_nan.view(torch.int16)[1] += 1  # still a NaN, another payload
    assert other_nan[1].isnan()
    one_bit = values.clone()
    one_bit.view(torch.int16)[3] += 1
    negative_zero = values.clone()
    negative_zero[2] = -0.0
    disagreeing = [
        ((negative_zero,), (values,)),
        ((other_nan,), (values,)),
        ((one_bit,), (values,)),
        ((values.float(),), (values,)),
        ((values[:3],), (values[:3].reshape(3, 1),)),
        ((values, torch.tensor([0, 1, 3])), (values, torch.arange(3))),
    ]
    for replayed, own in disagreeing:
        assert not reproduces(replayed, own), (replayed, own)
