"""Sibling linears as one GEMM under ``torch.compile``: a dynamo backend that merges them.

Eagerly, a fused group's members (``fuse_sibling_linears``) share one GEMM by keeping its output
between their calls, which needs to know that the shared input was not changed in place in
between; a traced call cannot ask (dynamo reads a tensor's version counter as an unknown). The
graph dynamo hands its backend shows the whole layer instead. ``sibling_gemm_backend`` rewrites
it before compiling: where every member of a group is a ``linear`` of one input node, and no
node between the first and the last of them can write a tensor, the members' linears become one
linear on the group's weight (rebuilt in the graph from its inner tensors) and a column slice of
its output per member. Then Inductor compiles the graph, with the ``mode`` and ``options``
``torch.compile`` would take, or another backend does.

The graph reads the group's memory, which the members' weights are row slices of: a checkpoint
loaded into the members reaches it (one with other global scales dissolves the groups, and the
graph compiled without the merge runs). Works on the subclass weights and on weights that torchao's
``unwrap_tensor_subclass`` holds as plain tensors. Each call checks that the members' weights
and biases are still the objects the graph was compiled with (a member's weight replaced
fails it); otherwise the group is dissolved and the call runs, from then on, the graph compiled
without the merge. Dissolving a group (moving the model does) also drops the merged graph and
what it holds of the model's weights, and the calls after it run unmerged, so a model moved after compiling
leaves no copy behind; the compiled model then recompiles for the moved weights, unmerged
(``fuse_sibling_linears`` again and a new compile merge them again). Layers compiled one by one
share one graph, which holds the first layer's groups: another layer's call runs the graph
without the merge from then on, with a warning.
"""

import copy
import operator
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx

from nvfp4_static.messages import warn
from nvfp4_static.sibling_linears import SiblingGemm, live_sibling_gemms
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["sibling_gemm_backend"]

_WRITING_OPERATORS = frozenset(
    {
        operator.setitem,
        operator.delitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.imatmul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
    }
)


def sibling_gemm_backend(
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
    backend: Union[str, Callable] = "inductor",
) -> Callable:
    """A ``torch.compile`` backend that runs each fused group's members as one GEMM.

    ``torch.compile(model, backend=sibling_gemm_backend("reduce-overhead"), fullgraph=True)``
    on a model after ``fuse_sibling_linears`` (see the module docstring). A mode or options given
    to ``torch.compile`` itself (as transformers' ``CompileConfig`` does) apply as well.

    Args:
        mode: Inductor's mode, as ``torch.compile(mode=...)`` takes it ("reduce-overhead" for
            CUDA graphs).
        options: Inductor's options, as ``torch.compile(options=...)`` takes them.
        backend: the backend that compiles the merged graph: "inductor", or another dynamo
            backend's name or callable (then without ``mode`` and ``options``).

    Raises:
        ValueError: an unknown mode or option, or a mode or options given for another backend
            (when compiling, for those given to ``torch.compile``: then also two different modes).
    """
    compile_graph = _graph_compiler(backend, mode, options)
    given_mode, given_options = mode, options

    def merging_backend(
        gm: fx.GraphModule, example_inputs: list, mode: Optional[str] = None, options: Optional[dict] = None
    ) -> Callable:
        """Merge, then compile; ``mode`` and ``options`` are those given to ``torch.compile``."""
        compiler = compile_graph
        if mode is not None or options:
            compiler = _graph_compiler(
                backend, _one_mode(given_mode, mode), {**(given_options or {}), **(options or {})}
            )
        unmerged = _copy_of(gm)
        merges = merge_sibling_linears(gm, example_inputs)
        if not merges:
            return compiler(gm, example_inputs)
        reduced, kept = without_unused_member_inputs(gm, merges)
        merged = compiler(reduced, [example_inputs[position] for position in kept])
        return _CheckedMerge(merged, merges, kept, unmerged, compiler)

    return merging_backend


def _one_mode(given: Optional[str], compiling: Optional[str]) -> Optional[str]:
    """The mode of ``sibling_gemm_backend(given)`` under ``torch.compile(mode=compiling)``."""
    if given is not None and compiling is not None and given != compiling:
        raise ValueError(
            f"nvfp4_static: sibling_gemm_backend({given!r}) compiled with torch.compile(mode={compiling!r}); "
            f"give the mode once"
        )
    return compiling if compiling is not None else given


def _graph_compiler(backend: Union[str, Callable], mode: Optional[str], options: Optional[dict]) -> Callable:
    """``(gm, example_inputs) -> compiled``: Inductor with ``mode`` and ``options``, or ``backend``."""
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(f"nvfp4_static: backend must be a dynamo backend's name or a callable; got {backend!r}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"nvfp4_static: options must map Inductor option names to values; got {options!r}")
    if backend != "inductor":
        if mode is not None or options:
            raise ValueError(f"nvfp4_static: mode and options are Inductor's; backend {backend!r} takes neither")
        return torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    from torch._inductor import config, list_mode_options
    from torch._inductor.compile_fx import compile_fx

    modes = list_mode_options()
    if mode is not None and mode not in modes:
        raise ValueError(f"nvfp4_static: unknown Inductor mode {mode!r}; the modes are {sorted(modes)}")
    unknown = sorted(set(options or {}) - set(config.get_config_copy()))
    if unknown:
        raise ValueError(f"nvfp4_static: unknown Inductor options {unknown}")
    patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}

    def compile_graph(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=patches)

    return compile_graph


class MergedGroup(NamedTuple):
    """A group merged in a graph: its ``SiblingGemm`` and the inputs (position, object) the
    members' weights and biases were compiled from."""

    gemm: SiblingGemm
    inputs: tuple[tuple[int, Any], ...]


class _CheckedMerge:
    """The compiled merged graph, called while each member's weight and bias are the objects
    compiled with; from the first call where one is not, or once a group is dissolved (moving the
    model does: the group calls ``release``), the groups are dissolved, the merged graph and what
    it holds of the model are dropped, and the graph compiled without the merge runs. The check
    reads all groups' inputs at once (C-level ``itemgetter`` and ``map``) rather than looping over
    them in Python: a 32-layer model has 64 groups, checked at every call. The merged graph is
    given the inputs it still takes (``kept``, positions in dynamo's inputs)."""

    # No instance dict: dynamo wraps the compiled callable with functools.wraps, which copies an
    # instance dict into the wrapper, where release() could not drop what it holds.
    __slots__ = (
        "_merged", "_kept", "_unmerged", "_compile_graph", "_unmerged_compiled", "_inputs", "_compiled_from",
        "_gemms", "__weakref__",
    )

    def __init__(
        self,
        merged: Callable,
        groups: list[MergedGroup],
        kept: tuple[int, ...],
        unmerged: fx.GraphModule,
        compile_graph: Callable,
    ):
        self._merged = merged
        self._kept = _items_at(kept)
        self._unmerged = unmerged
        self._compile_graph = compile_graph
        self._unmerged_compiled: Optional[Callable] = None
        # Each group has two or more members, so at least two positions: itemgetter gives a tuple.
        self._inputs = operator.itemgetter(*(position for group in groups for position, _ in group.inputs))
        self._compiled_from = tuple(value for group in groups for _, value in group.inputs)
        self._gemms = tuple(group.gemm for group in groups)
        for gemm in self._gemms:
            gemm.merged_into(self)

    def _holds(self, args: tuple) -> bool:
        return all(map(operator.is_, self._inputs(args), self._compiled_from))

    def _members_unchanged(self) -> bool:
        """Whether the members still hold every tensor the merged graph was compiled from: then a
        call that fails ``_holds`` came for other members (one graph that several layers share),
        not from a change to this model."""
        held = {id(tensor) for gemm in self._gemms for member in gemm.members for tensor in member.parameters()}
        return all(id(value) in held for value in self._compiled_from)

    def release(self) -> None:
        """Drop the merged graph, which holds the groups' weights, and the references kept to
        check its inputs; dissolve its other groups. Calls from now on run without the merge."""
        if self._merged is None:
            return
        self._merged = None
        gemms = self._gemms
        self._compiled_from, self._gemms = (), ()
        for gemm in gemms:
            gemm.dissolve()

    def __call__(self, *args):
        if self._merged is not None:
            if self._holds(args):
                return self._merged(*self._kept(args))
            if self._members_unchanged():
                warn(
                    "nvfp4_static: a graph that sibling_gemm_backend merged for one layer's fused groups "
                    "was called with another layer's members (layers compiled one by one share one "
                    "graph): it runs without the merge from now on, for every layer, and the first "
                    "layer's groups are dissolved. Compile the whole model through "
                    "sibling_gemm_backend to run each layer's groups as one GEMM."
                )
            self.release()
        if self._unmerged_compiled is None:
            self._unmerged_compiled = self._compile_graph(self._unmerged, list(args))
        return self._unmerged_compiled(*args)



def _items_at(positions: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[p] for p in positions)`` in C (``itemgetter`` of one position gives
    the item itself, not a tuple of it)."""
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(*positions)


def without_unused_member_inputs(
    gm: fx.GraphModule, groups: list[MergedGroup]
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """The merged ``gm`` without the inputs of merged members that no node reads any more
    (their weights, which the group's linear replaced), and the positions, in dynamo's inputs,
    of those it keeps. A copy: dynamo calls the compiled graph with the inputs of its own.

    Each input costs host time at every call of the compiled graph; a subclass weight the most:
    under torch 2.11 AOTAutograd's runtime wrapper unwraps it in Python (about 10 us per weight on
    an H200's host), though the merged graph no longer reads it. The call still checks the
    removed inputs' identity (``_CheckedMerge``)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    checked = {position for group in groups for position, _ in group.inputs}
    dropped = {position for position in checked if not placeholders[position].users}
    if not dropped:
        return gm, tuple(range(len(placeholders)))
    reduced = _copy_of(gm)
    for position, node in enumerate(list(reduced.graph.find_nodes(op="placeholder"))):
        if position in dropped:
            reduced.graph.erase_node(node)
    reduced.graph.lint()
    reduced.recompile()
    return reduced, tuple(position for position in range(len(placeholders)) if position not in dropped)


def _copy_of(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of dynamo's graph to compile later: each input keeps the source AOTAutograd asks
    of a dynamo graph's inputs, and none keeps its example value (dynamo drops those after
    compiling; a kept one would hold a reference to the model's parameters)."""
    graph = copy.deepcopy(gm.graph)
    for original, copied in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            copied._dynamo_source = original._dynamo_source
        copied.meta.pop("grapharg", None)
    copied_gm = fx.GraphModule(gm, graph)
    copied_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied_gm._param_name_to_source = dict(gm._param_name_to_source)
    return copied_gm


def merge_sibling_linears(gm: fx.GraphModule, example_inputs: list) -> list[MergedGroup]:
    """Rewrite ``gm`` (a dynamo graph, ``example_inputs`` its placeholders' values) so that each
    fused group whose members are linears of one input node, with no node between them that
    could write a tensor, runs one linear; returns the groups merged."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    inputs = {node: (position, value) for position, (node, value) in enumerate(zip(placeholders, example_inputs))}
    member_of = _members_by_weight_address()
    calls: dict[tuple[fx.Node, SiblingGemm], dict[int, list[tuple[fx.Node, tuple]]]] = {}
    for node in gm.graph.nodes:
        operands = _linear_operands(node)
        if operands is None:
            continue
        x, weight, bias = operands
        member = _member_called(weight, bias, inputs, member_of)
        if member is not None:
            gemm, index, compiled_from = member
            calls.setdefault((x, gemm), {}).setdefault(index, []).append((node, compiled_from))
    order = {node: position for position, node in enumerate(gm.graph.nodes)}
    mergeable = []
    for (x, gemm), by_index in calls.items():
        if sorted(by_index) != list(range(len(gemm.members))) or any(len(c) > 1 for c in by_index.values()):
            continue
        members = [by_index[index][0] for index in range(len(gemm.members))]
        if not _writes_between(gm.graph, [node for node, _ in members], order):
            mergeable.append((x, gemm, members))
    merged = []
    for x, gemm, members in mergeable:
        nodes = [node for node, _ in members]
        _merge(gm, x, gemm, nodes, min(nodes, key=order.__getitem__), len(merged))
        inputs_checked = tuple(entry for _, compiled_from in members for entry in compiled_from)
        merged.append(MergedGroup(gemm, inputs_checked))
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


def _linear_operands(node: fx.Node) -> Optional[tuple]:
    """``(input, weight, bias)`` of a ``linear`` node (bias None where absent), else None."""
    if node.op != "call_function" or node.target is not F.linear:
        return None
    positional = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = (node.kwargs.get(name, value) for name, value in zip(("input", "weight", "bias"), positional))
    return (x, weight, bias) if isinstance(x, fx.Node) and isinstance(weight, fx.Node) else None


def _members_by_weight_address() -> dict[int, tuple[SiblingGemm, int]]:
    """Each live group's members by the address of their packed weight rows."""
    return {
        gemm.rows(index, gemm.weight.qdata).data_ptr(): (gemm, index)
        for gemm in live_sibling_gemms()
        for index in range(len(gemm.members))
    }


def _member_called(weight: fx.Node, bias: Optional[fx.Node], inputs: dict, member_of: dict) -> Optional[tuple]:
    """``(group, member index, inputs compiled from)`` where the linear's weight is a group
    member's (a subclass input, or rebuilt in the graph from plain inputs) holding its row slice
    of the group's memory and its bias is the member's; else None."""
    if weight in inputs:
        weight_inputs = [weight]
        _, value = inputs[weight]
        if not isinstance(value, NVFP4StaticTensor):
            return None
        names, _ = value.__tensor_flatten__()
        inner = [getattr(value, name) for name in names]
    elif weight.op == "call_function" and weight.target is NVFP4StaticTensor:
        weight_inputs = list(weight.all_input_nodes)
        if not all(node in inputs for node in weight_inputs):
            return None
        inner = [inputs[node][1] for node in weight_inputs]
    else:
        return None
    tensors = [t for t in inner if isinstance(t, torch.Tensor)]
    found = [member_of[t.data_ptr()] for t in tensors if t.data_ptr() in member_of]
    if len({id(gemm) for gemm, _ in found}) != 1:
        return None
    gemm, index = found[0]
    if not _holds_its_slice(gemm, index, tensors):
        return None
    expected_bias = None if gemm.bias is None else gemm.rows(index, gemm.bias)
    if (bias is None) != (expected_bias is None):
        return None
    compiled_from = [inputs[node] for node in weight_inputs]
    if bias is not None:
        if bias not in inputs or not _same_memory(inputs[bias][1], expected_bias):
            return None
        compiled_from.append(inputs[bias])
    return gemm, index, tuple(compiled_from)


def _holds_its_slice(gemm: SiblingGemm, index: int, tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` (a member weight's inner tensors, in any order) are the group's inner
    tensors, the row-indexed ones (packed weight, block scales) as the member's rows."""
    names, _ = gemm.weight.__tensor_flatten__()
    group = [getattr(gemm.weight, name) for name in names]
    expected = [gemm.rows(index, t) if t.dim() > 0 and t.shape[0] == gemm.weight.shape[0] else t for t in group]
    unmatched = list(tensors)
    for want in expected:
        match = next((t for t in unmatched if _same_memory(t, want)), None)
        if match is None:
            return False
        unmatched.remove(match)
    return not unmatched


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _writes_between(graph: fx.Graph, nodes: list[fx.Node], order: dict) -> bool:
    """Whether any node after the first of ``nodes`` and before the last may write a tensor in
    place (an in-place method or operator, ``out=``, ``inplace=True``, a submodule or a
    higher-order operator, whose effects are not visible here)."""
    first, last = min(order[n] for n in nodes), max(order[n] for n in nodes)
    members = set(nodes)
    for node in graph.nodes:
        if first < order[node] < last and node not in members and _may_write(node):
            return True
    return False


def _may_write(node: fx.Node) -> bool:
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    target = node.target
    if node.op == "call_method":
        return target.endswith("_")
    if target in _WRITING_OPERATORS or isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        schemas = [target._schema] if isinstance(target, torch._ops.OpOverload) else [
            getattr(target, name)._schema for name in target.overloads()
        ]
        return any(schema.is_mutable for schema in schemas)
    return getattr(target, "__name__", "").endswith("_")


def _merge(
    gm: fx.GraphModule, x: fx.Node, gemm: SiblingGemm, members: list[fx.Node], first: fx.Node, number: int
) -> None:
    """Replace the member linears ``members`` (in member order; ``first`` of them in the graph)
    by one linear on the group's weight and a column slice of its output per member."""
    names, metadata = gemm.weight.__tensor_flatten__()
    weight_class = type(gemm.weight)
    graph = gm.graph
    attributes = [
        _add_constant(gm, f"_nvfp4_sibling_gemm_{number}_{name}", getattr(gemm.weight, name)) for name in names
    ]

    def group_weight(*inner: torch.Tensor) -> NVFP4StaticTensor:
        return weight_class.__tensor_unflatten__(dict(zip(names, inner)), metadata, None, None)

    with graph.inserting_before(first):
        inner = [graph.get_attr(attribute) for attribute in attributes]
        weight = graph.call_function(group_weight, tuple(inner))
        bias = None
        if gemm.bias is not None:
            bias = graph.get_attr(_add_constant(gm, f"_nvfp4_sibling_gemm_{number}_bias", gemm.bias))
        out = graph.call_function(F.linear, (x, weight, bias))
        start = 0
        parts = []
        for size in gemm.sizes:
            parts.append(graph.call_function(torch.narrow, (out, -1, start, size)))
            start += size
    for node, part in zip(members, parts):
        weight_node = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        if weight_node.op == "call_function" and not weight_node.users:
            graph.erase_node(weight_node)


def _add_constant(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> str:
    """Hold ``tensor`` (its memory, not a copy) as the buffer ``name`` of ``gm``, which
    AOTAutograd lifts to an input; a dynamo graph names a source for each such input
    (AOTAutograd uses it to tell duplicated inputs apart), here a name of its own."""
    from torch._dynamo.source import ConstantSource

    gm.register_buffer(name, tensor.detach(), persistent=False)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = ConstantSource(name)
    return name
