"""A ``torch.compile`` guard filter that leaves out dynamo's guards on converted NVFP4 weights.

On every call of a compiled model, dynamo checks its guards before running the graph, and a
converted weight carries many: its type, its metadata (a Python call into the weight's
``__tensor_flatten__``), its shape, dtype and device, and the same for each of its four inner
tensors. At decode under CUDA graphs the host's work can be more than the GPU's: on an H200,
4 Llama-8B-shaped layers (28 weights) compiled with ``mode="reduce-overhead"`` took 0.791 ms per
call for 0.407 ms of GPU work, and 0.423 with this filter (``examples/benchmarks/RESULTS.md``,
where the host's time varies from run to run). Pass the filter with CUDA graphs through ``options``
(``torch.compile`` takes a mode or options, not both)::

    model = torch.compile(
        model,
        fullgraph=True,
        options={"triton.cudagraphs": True, "guard_filter_fn": skip_nvfp4_weight_guards},
    )

Every other guard stays: the inputs' shapes, dtypes and devices (a model moved to another device
or dtype takes inputs there, which recompiles), the modules' types and attributes, other
parameters. The graph still reads each weight's tensors from its module on every call, global
scales included (a traced weight holds no number of its own), so values loaded into the weights
in place (``load_state_dict``) reach it, whatever their global scales. What goes unchecked is a
converted weight replaced after compiling by one of another shape, dtype, device or backend:
compile again after that (``torch._dynamo.reset()``).
"""

from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["skip_nvfp4_weight_guards"]


def skip_nvfp4_weight_guards(guard_entries) -> list[bool]:
    """For each of dynamo's ``GuardFilterEntry``s, whether to keep it: every guard but those on
    an ``NVFP4StaticTensor`` and on what is reached from it (its inner tensors, its flatten)."""
    weights = {entry.name for entry in guard_entries if isinstance(entry.value, NVFP4StaticTensor)}
    return [not _reached_from(entry.name, weights) for entry in guard_entries]


def _reached_from(name: str, sources: set) -> bool:
    """Whether the guard source ``name`` is one of ``sources`` or an attribute, item or call
    result under one (its name continues one with ``.`` or ``[``)."""
    if name in sources:
        return True
    return any(character in ".[" and name[:index] in sources for index, character in enumerate(name))
