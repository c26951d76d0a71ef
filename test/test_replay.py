"""kernels/replay.py: which tensors a replay takes from each call, and which launches it refuses.

The launches here are stand-ins kept under Triton's interpreter setting (their arguments are
recorded, nothing is compiled): what a replayed kernel would be handed.
"""

import pytest
import torch
from test_triton_eager import Descriptor, SeenKernel

from nvfp4_static.kernels.launch import KernelCall
from nvfp4_static.kernels.replay import ReplayedLaunches


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
