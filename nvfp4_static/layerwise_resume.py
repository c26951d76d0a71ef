"""A folder of finished layers, so that layer-by-layer calibration can resume after a crash.

``calibrate_layer_by_layer(..., resume_dir=folder)`` saves each decoder layer as soon as it is
converted (``layer_00003.pt``: the layer's ``state_dict`` and its calibration stats) and then
records it in ``progress.json``, which holds what the run was made from:

- the run: the model's class and layer count, the config (less ``step``), whether quantized
  outputs were propagated, a hash of each rank's calibration batches, and the ``forward``'s
  name and a hash of its code (values it reads from outside its code are not compared);
- per finished layer: its name, which linears ``filter_fn`` selected, and the shape, dtype and a
  hash of a strided sample of every float parameter and buffer (a sample: hashing all of an 8B
  model's weights would cost more than calibrating a layer).

A rerun with the same folder checks all of that before touching the model, raises naming the
first thing that differs, and otherwise loads the finished layers instead of calibrating them:
it runs each one forward to rebuild the next layer's inputs (the float layer, or the converted
one with propagation), as the interrupted run did, so the resumed layers and every later one are
bit for bit those of a run that never stopped.
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils import _pytree as pytree

from nvfp4_static.checkpoint import load_quantized
from nvfp4_static.config import NVFP4StaticActivationConfig
from nvfp4_static.fingerprints import SAMPLED_ELEMENTS, first_difference, tensor_digest
from nvfp4_static.linear import NVFP4StaticLinear

__all__ = ["FinishedLayers", "layer_fingerprint", "run_fingerprint"]

PROGRESS_FILE = "progress.json"
FORMAT = 1

def _batches_digest(batches: Sequence[Any]) -> str:
    """sha256 over every batch's tensors (dtype, shape, bytes) and other values (repr)."""
    digest = hashlib.sha256()
    for batch in batches:
        for leaf in pytree.tree_leaves(batch):
            if isinstance(leaf, torch.Tensor):
                digest.update(f"{leaf.dtype}{tuple(leaf.shape)}{tensor_digest(leaf)}".encode())
            else:
                digest.update(repr(leaf).encode())
    return digest.hexdigest()


def _code_digest(code: types.CodeType, digest) -> None:
    """Feed ``digest`` what ``code`` does: its bytecode, names and constants (nested functions'
    code included), not where it sits in its file."""
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _code_digest(constant, digest)
        else:
            digest.update(repr(constant).encode())


def _forward_fingerprint(forward: Callable) -> dict:
    """The forward's qualified name and a hash of its code, the same in every process."""
    function = inspect.unwrap(forward.func if isinstance(forward, functools.partial) else forward)
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: its class's __call__
        function = type(function).__call__
        code = getattr(function, "__code__", None)
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', repr(function))}"
    if code is None:
        return {"name": name}
    digest = hashlib.sha256()
    _code_digest(code, digest)
    return {"name": name, "code sha256": digest.hexdigest()}


def run_fingerprint(
    model: torch.nn.Module,
    layer_count: int,
    config: NVFP4StaticActivationConfig,
    propagate_quantized: bool,
    smooth_alpha: Optional[float],
    batches: Sequence[Any],
    forward: Callable,
    gather: Callable[[str], list],
) -> dict:
    """What a resumed run must share with the saved one. ``gather`` turns this rank's batches
    hash into every rank's (``lambda h: [h]`` in one process)."""
    recipe = {k: v for k, v in dataclasses.asdict(config).items() if k != "step"}
    return _as_json({
        "format": FORMAT,
        "model": type(model).__name__,
        "layers": layer_count,
        "config": recipe,
        "propagate_quantized": propagate_quantized,
        "smooth_alpha": smooth_alpha,
        "batches of each rank": gather(_batches_digest(batches)),
        "forward": _forward_fingerprint(forward),
    })


def layer_fingerprint(layer: torch.nn.Module, name: str, selected: Callable) -> dict:
    """What identifies a float decoder layer: its name, the linears ``selected(module, fqn)``
    picks, and each parameter's and buffer's shape, dtype and sampled hash."""
    tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    return _as_json({
        "name": name,
        "selected": [fqn for fqn, m in layer.named_modules()
                     if fqn and isinstance(m, torch.nn.Linear) and selected(m, fqn)],
        "tensors": {key: {"shape": list(t.shape), "dtype": str(t.dtype),
                          "sampled sha256": tensor_digest(t, SAMPLED_ELEMENTS)}
                    for key, t in sorted(tensors.items())},
    })


def _as_json(value):
    """``value`` as JSON gives it back (tuples become lists), so a fresh fingerprint compares
    equal to a saved one."""
    return json.loads(json.dumps(value))


class FinishedLayers:
    """The layers a resume folder holds: ``done`` of them, checked against the model at hand.

    Args:
        folder: the resume folder (created if missing).
        run: this run's ``run_fingerprint``.
        fingerprints: the current ``layer_fingerprint`` of layer ``i``, called for each
            layer the folder holds.
        writes: whether this process saves (one rank of a data-parallel run).
    """

    def __init__(self, folder: Union[str, os.PathLike], run: dict,
                 fingerprints: Callable[[int], dict], writes: bool = True):
        self.folder = Path(folder)
        self.run = run
        self.writes = writes
        self.layers: list[dict] = []
        progress = self.folder / PROGRESS_FILE
        if progress.exists():
            self.layers = self._checked(progress, fingerprints)
        elif writes:
            self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def done(self) -> int:
        return len(self.layers)

    def _refuse(self, what: str) -> ValueError:
        return ValueError(
            f"nvfp4_static: the resume folder '{self.folder}' holds layers of another run: "
            f"{what}. Resume with the same model, calibration data, config and forward, or pass "
            f"an empty folder to start over (nothing was changed)"
        )

    def _checked(self, progress: Path, fingerprints: Callable[[int], dict]) -> list:
        try:
            saved = json.loads(progress.read_text())
            saved_run, saved_layers = saved["run"], list(saved["layers"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            unreadable = f"its {PROGRESS_FILE} cannot be read ({type(error).__name__}: {error})"
            raise self._refuse(unreadable) from error
        if saved_run != self.run:
            where, theirs, ours = first_difference(saved_run, self.run)
            raise self._refuse(f"'{where}' is {theirs!r} there and {ours!r} now")
        for index, layer in enumerate(saved_layers):
            current = fingerprints(index)
            if layer != current:
                where, theirs, ours = first_difference(layer, current)
                raise self._refuse(
                    f"layer {index} ({current['name']}) differs at '{where}': {theirs!r} there, "
                    f"{ours!r} now"
                )
            if not self._layer_file(index).exists():
                missing = self._layer_file(index).name
                raise self._refuse(f"{missing}, which {PROGRESS_FILE} lists, is missing")
        return saved_layers

    def _layer_file(self, index: int) -> Path:
        return self.folder / f"layer_{index:05d}.pt"

    def save(self, index: int, layer: torch.nn.Module, fingerprint: dict) -> None:
        """Record converted layer ``index`` (``fingerprint`` taken before it was converted).
        Each file is written whole, then renamed, so a crash never leaves a half-written one."""
        if index != self.done:
            raise RuntimeError(
                f"nvfp4_static: layer {index} saved after {self.done} finished layers"
            )
        self.layers.append(fingerprint)
        if not self.writes:
            return
        stats = {fqn: m.calibration_stats for fqn, m in layer.named_modules()
                 if isinstance(m, NVFP4StaticLinear)}
        _write(self._layer_file(index), lambda path: torch.save(
            {"state_dict": layer.state_dict(), "stats": stats}, path))
        text = json.dumps({"run": self.run, "layers": self.layers}, indent=1)
        _write(self.folder / PROGRESS_FILE, lambda path: path.write_text(text))

    def load(self, index: int, layer: torch.nn.Module, name: str, backend=None) -> None:
        """Make float layer ``index`` the converted layer the folder holds."""
        device = next(layer.parameters()).device
        saved = torch.load(self._layer_file(index), map_location=device, weights_only=True)
        load_quantized(layer, saved["state_dict"], backend=backend)
        for fqn, module in layer.named_modules():
            if isinstance(module, NVFP4StaticLinear):
                module.layer_name = f"{name}.{fqn}"
                module.calibration_stats = saved["stats"].get(fqn, {})


def _write(path: Path, write: Callable[[Path], None]) -> None:
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)
