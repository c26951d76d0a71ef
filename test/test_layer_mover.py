"""Moving layers to the device and back in a worker thread (nvfp4_static.layer_mover).

On CPU the overlapping mover copies CPU to CPU, which runs its thread and bookkeeping; the CUDA
tests check the real moves (pinned staging, side stream)."""

import threading
import weakref

import pytest
import torch
from conftest import requires_cuda
from tiny_llama import converted_llama, logits
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from nvfp4_static import layer_mover
from nvfp4_static.layer_mover import LayerMover, _map_layer_tensors

CPU = torch.device("cpu")


class Tied(torch.nn.Module):
    """Two linears sharing one weight, and a buffer registered in two modules."""

    def __init__(self, dtype=torch.float32):  # a dtype here: module.to(dtype) unties buffers
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8, dtype=dtype), torch.nn.Linear(8, 8, dtype=dtype)
        self.b.weight = self.a.weight
        scale = torch.arange(8.0, dtype=dtype)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)


def mover_threads() -> int:
    return sum(t.name.startswith("nvfp4_static-layer-mover") for t in threading.enumerate())


def test_move_in_gives_the_same_parameters_new_storage_and_keeps_ties():
    layer = Tied()
    params, values = dict(layer.named_parameters()), {k: v.clone() for k, v in layer.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    with LayerMover(CPU, overlap=True) as mover:
        mover.prefetch(layer)
        mover.move_in(layer)
        assert dict(layer.named_parameters()) == params  # the same Parameter objects
        assert all(v.data_ptr() != storage[k] for k, v in layer.state_dict().items())
        assert all(torch.equal(v, values[k]) for k, v in layer.state_dict().items())
        assert layer.b.weight is layer.a.weight and layer.a.scale is layer.b.scale
        mover.move_back(layer, CPU)
    assert mover_threads() == 0


def test_a_failed_prefetch_raises_at_move_in_and_leaves_the_layer_as_it_was(monkeypatch):
    def fail(self, sources):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(LayerMover, "_stage", fail)
    layer = Tied()
    storage = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="copy failed"), LayerMover(CPU, overlap=True) as mover:
        mover.prefetch(layer)
        mover.move_in(layer)
    assert {k: v.data_ptr() for k, v in layer.state_dict().items()} == storage
    assert mover_threads() == 0


@pytest.mark.parametrize("leaving_with_error", [False, True], ids=["clean exit", "error leaving"])
def test_a_failed_move_back_raises_on_leaving_unless_another_error_is_leaving(monkeypatch, leaving_with_error):
    def fail(self, layer, home, ready):
        raise RuntimeError("move back failed")

    monkeypatch.setattr(LayerMover, "_move_home", fail)
    expected = "body failed" if leaving_with_error else "move back failed"
    with pytest.raises(RuntimeError, match=expected), LayerMover(CPU, overlap=True) as mover:
        mover.move_back(Tied(), CPU)
        if leaving_with_error:
            raise RuntimeError("body failed")
    assert mover_threads() == 0


def test_without_overlap_moves_are_plain_and_no_thread_starts(monkeypatch):
    monkeypatch.setattr(layer_mover, "ThreadPoolExecutor", None)  # would fail if used
    layer = Tied()
    storage = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    with LayerMover(CPU, overlap=False) as mover:
        mover.prefetch(layer)
        mover.move_in(layer)
        mover.move_back(layer, CPU)
    assert {k: v.data_ptr() for k, v in layer.state_dict().items()} == storage


@requires_cuda
def test_on_cuda_a_layer_moves_in_and_back_exactly():
    cuda = torch.device("cuda", torch.cuda.current_device())
    layer = Tied(torch.bfloat16)
    values = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(64, 8, device=cuda, dtype=torch.bfloat16)
    with LayerMover(cuda, overlap=True) as mover:
        mover.prefetch(layer)
        mover.move_in(layer)
        assert all(v.device == cuda for v in layer.state_dict().values())
        assert layer.b.weight is layer.a.weight and layer.a.scale is layer.b.scale
        expected = torch.nn.functional.linear(x, values["a.weight"].to(cuda), values["a.bias"].to(cuda))
        assert torch.equal(layer.a(x), expected)
        mover.move_back(layer, CPU)
        mover.wait_moved_back()
        assert all(v.device == CPU for v in layer.state_dict().values())
    assert all(torch.equal(v, values[k]) for k, v in layer.state_dict().items())


def inner_tensors(module: torch.nn.Module) -> dict:
    """Every plain tensor ``module`` holds, a tensor subclass's inner tensors included, by name."""
    found = {}

    def visit(name, tensor):
        if is_traceable_wrapper_subclass(tensor):
            for inner in tensor.__tensor_flatten__()[0]:
                visit(f"{name}.{inner}", getattr(tensor, inner))
        else:
            found[name] = tensor

    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        visit(name, tensor)
    return found


def test_mapping_a_converted_model_maps_each_inner_tensor_once_and_keeps_its_outputs():
    model = converted_llama()
    before = logits(model)
    tensors = {k: (t.data_ptr(), t.clone()) for k, t in inner_tensors(model).items()}
    seen = []
    _map_layer_tensors(model, lambda t: seen.append(t) or t.clone())
    assert len(seen) == len({id(t) for t in seen}) == len({ptr for ptr, _ in tensors.values()})
    after = inner_tensors(model)
    assert after.keys() == tensors.keys()
    assert all(after[k].data_ptr() != ptr and torch.equal(after[k], t) for k, (ptr, t) in tensors.items())
    assert torch.equal(logits(model), before)


def test_mapping_keeps_tied_parameters_and_buffers_tied():
    layer = Tied()
    _map_layer_tensors(layer, torch.clone)
    assert layer.b.weight is layer.a.weight and layer.a.scale is layer.b.scale


@requires_cuda
def test_on_cuda_a_converted_layer_goes_home_through_pinned_staging_into_pageable_memory():
    cuda = torch.device("cuda", torch.cuda.current_device())
    model = converted_llama()
    expected = logits(model)
    tensors = {k: t.clone() for k, t in inner_tensors(model).items()}
    model.to(cuda)
    with LayerMover(cuda, overlap=True) as mover:
        for layer in model.model.layers:
            mover.move_back(layer, CPU)
    model.to(CPU)  # what is not a decoder layer
    home = inner_tensors(model)
    assert all(t.device == CPU and not t.is_pinned() and torch.equal(t, tensors[k]) for k, t in home.items())
    assert torch.equal(logits(model), expected)


def test_a_moved_in_layer_s_host_tensors_are_freed_in_the_worker_not_the_caller(monkeypatch):
    freed_in = []
    stage = LayerMover._stage

    def stage_watching_sources(self, sources):
        for source in sources:
            weakref.finalize(source, lambda: freed_in.append(threading.current_thread().name))
        return stage(self, sources)

    monkeypatch.setattr(LayerMover, "_stage", stage_watching_sources)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with LayerMover(CPU, overlap=True) as mover:
        mover.prefetch(layer)
        mover.move_in(layer)
    assert len(freed_in) == 4 and all(name.startswith("nvfp4_static-layer-mover-in") for name in freed_in)
