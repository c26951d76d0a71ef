"""Run Triton kernel launchers under ``TRITON_INTERPRET=1`` in a child process (CPU-only CI).

Triton chooses between compiling and interpreting a kernel when ``@triton.jit`` runs, i.e. when
its module is imported, so interpreted kernels need a process that had the variable set from the
start; setting it in the test process instead would flip every other test's kernels too. A test
file gathers its launches, runs them all with ``run_interpreted`` (from a module-scoped fixture),
and asserts on what comes back.

Every file's launches run in the same child, started when this module is imported (at
collection) and kept until the test process exits: its imports of torch and nvfp4_static take
seconds, once per session instead of once per file, beside the tests that run before the first
launch. In the child, ``_patch_language_once_per_launch`` spares the interpreter repeated work.
"""

import atexit
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Any, NamedTuple, Optional

import numpy
import pytest
import torch
import triton


class Launched(NamedTuple):
    """One launch, after it ran: its arguments as the launcher left them (outputs written in
    place) and what it returned."""

    args: tuple
    returned: Any


def interpreter_unusable_reason() -> Optional[str]:
    """Why Triton's interpreter cannot run our kernels here, or None: before Triton 3.9 it turns
    a kernel's scalar arguments into 1-element arrays and converts them with ``int()``, which
    NumPy 2.5 refuses (seen with Triton 3.6, the version torch 2.11 pins). CI runs Triton 3.9."""
    triton_version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    if triton_version < (3, 9) and numpy_version >= (2, 5):
        return (
            f"Triton {triton.__version__}'s interpreter fails on loop bounds under NumPy "
            f"{numpy.__version__}; run the interpreter tests with 'numpy<2.5' (or Triton >= 3.9)"
        )
    return None


def skip_if_interpreter_unusable() -> None:
    reason = interpreter_unusable_reason()
    if reason:
        pytest.skip(reason)


class _InterpreterChild:
    """The child process: it reads one request per line (the launches' file and the results'
    file, as JSON) and answers ``ok`` or ``failed`` on its stdout, with its stderr (and
    anything the launchers print) in ``log_path``."""

    def __init__(self):
        self.log_dir = tempfile.TemporaryDirectory()
        self.log_path = os.path.join(self.log_dir.name, "child.log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__],
                env=dict(os.environ, TRITON_INTERPRET="1"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def run(self, launches_path: str, results_path: str) -> None:
        logged_before = os.path.getsize(self.log_path)
        try:
            self.process.stdin.write(json.dumps([launches_path, results_path]) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if reply != "ok\n":
            if not reply:  # no answer: the child is gone
                self.process.wait()
            with open(self.log_path) as log:
                log.seek(logged_before)
                logged = log.read()[-4000:]
            exited = "" if reply else f" (the child exited with {self.process.returncode})"
            raise RuntimeError(f"interpreted Triton launches failed{exited}:\n{logged}")

    def stop(self) -> None:
        """Kill it: it keeps nothing between requests, and may still be importing."""
        self.process.kill()
        self.process.wait()
        with contextlib.suppress(BrokenPipeError):  # what a request left unsent when the child died
            self.process.stdin.close()
        self.process.stdout.close()
        self.log_dir.cleanup()


_child: Optional[_InterpreterChild] = None


def _running_child() -> _InterpreterChild:
    """The session's child, started anew if there is none or the last one died."""
    global _child
    if _child is None or _child.process.poll() is not None:
        _stop_child()
        _child = _InterpreterChild()
    return _child


@atexit.register
def _stop_child() -> None:
    if _child is not None:
        _child.stop()


def run_interpreted(launches: dict[str, tuple[str, tuple]]) -> dict[str, Launched]:
    """Run each ``name: ("package.module:launcher", args)``, in order, in the interpreted child
    process; return each name's ``Launched``.

    The launches travel in one ``torch.save``, so a tensor passed to several of them is one
    tensor in the child too: a later launch sees what an earlier one wrote into it.
    """
    skip_if_interpreter_unusable()
    with tempfile.TemporaryDirectory() as tmp:
        launches_path = os.path.join(tmp, "launches.pt")
        results_path = os.path.join(tmp, "results.pt")
        torch.save(launches, launches_path)
        _running_child().run(launches_path, results_path)
        return {name: Launched(*result) for name, result in torch.load(results_path, weights_only=False).items()}


def _run_launches(launches_path: str, results_path: str) -> None:
    results = {}
    for name, (target, args) in torch.load(launches_path, weights_only=False).items():
        module_name, function_name = target.split(":")
        returned = getattr(importlib.import_module(module_name), function_name)(*args)
        results[name] = (args, returned)
    torch.save(results, results_path)


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` when a launch starts, and again at every
    call of a ``@triton.jit`` function inside it (Triton 3.9): the same stateless patches, over
    ``inspect.getmembers`` of each module, thousands of times per launch: a third to most of the
    time of kernels that call helpers in loops. Inside a launch, a callee whose language modules
    the launch has patched is not patched again; the kernels run as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "GridExecutor")):
        return  # another Triton's interpreter: left as it is
    patch_language = interpreter._patch_lang
    run_launch = interpreter.GridExecutor.__call__

    class Launch:
        running = False
        patched: Optional[set] = None  # the language modules patched since the launch started

    class NothingPatched:
        def restore(self) -> None:
            pass

    def language_modules(fn) -> set:
        return {value for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_unless_patched(fn):
        """In full outside a launch, for its own call, and for callees of other modules."""
        if Launch.running:
            modules = language_modules(fn)
            if Launch.patched is not None and modules <= Launch.patched:
                return NothingPatched()
            Launch.patched = modules | (Launch.patched or set())
        return patch_language(fn)

    def launch(self, *args, **kwargs):
        Launch.running, Launch.patched = True, None
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            Launch.running, Launch.patched = False, None

    interpreter._patch_lang = patch_unless_patched
    interpreter.GridExecutor.__call__ = launch


def _serve() -> None:
    """Answer requests until stdin closes; launchers' prints go to the log, not the replies."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _patch_language_once_per_launch()
    for request in sys.stdin:
        try:
            _run_launches(*json.loads(request))
            reply = "ok"
        except Exception:
            traceback.print_exc()
            reply = "failed"
        sys.stderr.flush()
        replies.write(reply + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
elif os.environ.get("TRITON_INTERPRET") != "1" and interpreter_unusable_reason() is None:
    _running_child()  # not in the child itself, which imports this module with some launchers
