"""Sibling linears as one GEMM under ``torch.compile``: a dynamo backend that merges them.

Eagerly, a fused group's members (``fuse_sibling_linears``) share one GEMM by keeping its output
between their calls, which needs to know that the shared input was not changed in place in
between; a traced call cannot ask (dynamo reads a tensor's version counter as an unknown). The
graph dynamo hands its backend shows the whole layer instead. ``sibling_gemm_backend`` rewrites
a copy of it before compiling:

- where every member of a group is a ``linear`` of one input node, and no node between the first
  and the last of them can write a tensor, the members' linears become one linear on the group's
  weight and a column slice of its output per member;
- every NVFP4 weight the graph takes as an input (a weight subclass) is held by the graph
  instead, as its inner tensors (the same memory) rebuilt by a node of the graph, and left out
  of the compiled graph's inputs: a compiled region unwraps each subclass input on the host at
  every call, what torchao's ``unwrap_tensor_subclass`` otherwise avoids.

Then Inductor compiles the copy, with the ``mode`` and ``options`` ``torch.compile`` would take,
or another backend does. The graph reads the weights' memory (the group's, which its members'
weights are rows of), so a checkpoint loaded into the model reaches it; a change of a weight's
global scales changes its metadata, on which dynamo guards (it recompiles). Each call checks that
the members' weights and biases and the weights held are still the objects the graph was
compiled from and that no group was dissolved; otherwise the groups are dissolved and that call
and the later ones run dynamo's graph, compiled then, as it was. Works on weight subclasses and
on weights unwrapped by torchao (then only the merge applies). Move the model before compiling:
afterwards ``model.to()`` fails, as torch refuses to swap a parameter that the compiled graph's
tracing state still weakly references (a plain ``torch.compile`` releases that state).
"""

import copy
import operator
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx

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
    """A ``torch.compile`` backend that runs each fused group's members as one GEMM and holds the
    NVFP4 weights in the graph rather than taking them as inputs.

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
        """Rewrite a copy, then compile; ``mode`` and ``options`` are those given to ``torch.compile``."""
        compiler = compile_graph
        if mode is not None or options:
            compiler = _graph_compiler(
                backend, _one_mode(given_mode, mode), {**(given_options or {}), **(options or {})}
            )
        # Rewritten on a copy: dynamo calls the compiled graph with the inputs of its own graph.
        rewritten = _copy_of(gm, example_values=True)
        merges = merge_sibling_linears(rewritten, example_inputs)
        held = hold_weights_as_constants(rewritten, example_inputs)
        if not merges and not held:
            return compiler(gm, example_inputs)
        dropped = {position for position, _ in held}
        kept = [position for position in range(len(example_inputs)) if position not in dropped]
        compiled = compiler(rewritten, [example_inputs[position] for position in kept])
        _drop_example_values(rewritten)
        return _RewrittenGraph(compiled, merges, held, kept, _copy_of(gm, example_values=False), compiler)

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
    """A group merged in a graph: its ``SiblingGemm``, the group weight the graph reads, and the
    inputs (position, object) the members' weights and biases were compiled from."""

    gemm: SiblingGemm
    weight: NVFP4StaticTensor
    inputs: tuple[tuple[int, Any], ...]


class _RewrittenGraph:
    """The compiled rewritten graph, called with the inputs it kept while every merged group
    holds (not dissolved, each member's weight and bias the object compiled from) and each weight
    it holds is the object it was compiled from; from the first call where one does not, the
    groups are dissolved and dynamo's graph, compiled as it was, runs. The
    check reads all inputs at once (C-level ``itemgetter`` and ``map``) rather than looping in
    Python: a 32-layer model has 64 groups and 224 weights, checked at every call."""

    def __init__(
        self,
        compiled: Callable,
        groups: list[MergedGroup],
        held: list[tuple[int, Any]],
        kept: list[int],
        unmerged: fx.GraphModule,
        compile_graph: Callable,
    ):
        self._compiled = compiled
        self._groups = groups
        self._unmerged = unmerged
        self._compile_graph = compile_graph
        checked = [entry for group in groups for entry in group.inputs] + held
        self._inputs = _getter([position for position, _ in checked])
        self._compiled_from = tuple(value for _, value in checked)
        self._kept = _getter(kept)
        self._gemms = tuple(group.gemm for group in groups)
        self._weights = tuple(group.weight for group in groups)

    def _holds(self, args: tuple) -> bool:
        return all(map(operator.is_, self._inputs(args), self._compiled_from)) and all(
            map(operator.is_, map(_weight_of, self._gemms), self._weights)
        )

    def __call__(self, *args):
        if self._compiled is not None:
            if self._holds(args):
                return self._compiled(*self._kept(args))
            for group in self._groups:
                group.gemm.dissolve()
            self._compiled = None
            self._unmerged = self._compile_graph(self._unmerged, list(args))
        return self._unmerged(*args)


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[p] for p in positions)``, in C."""
    if len(positions) == 1:
        return lambda args: (args[positions[0]],)
    return operator.itemgetter(*positions) if positions else lambda args: ()


_weight_of = operator.attrgetter("weight")


def _copy_of(gm: fx.GraphModule, example_values: bool) -> fx.GraphModule:
    """A copy of dynamo's graph, to rewrite (with the nodes' example values) or to compile later
    (without them: they hold the fake-tensor mode that weakly references each parameter, and a
    weakly referenced parameter cannot be swapped, which ``model.to()`` does). Each input keeps
    what AOTAutograd asks of a dynamo graph's inputs (its source, whether it is static) and none
    keeps dynamo's record of its real value."""
    graph = copy.deepcopy(gm.graph)
    for original, copied in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            copied._dynamo_source = original._dynamo_source
    for node in graph.nodes:
        node.meta.pop("grapharg", None)
        if not example_values:
            static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
            node.meta = {} if static is None else {"tensor_dict": {"_dynamo_static_input_type": static}}
    copied_gm = fx.GraphModule(gm, graph)
    copied_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied_gm._param_name_to_source = dict(gm._param_name_to_source)
    return copied_gm


def _drop_example_values(gm: fx.GraphModule) -> None:
    """Drop the nodes' example values, as dynamo drops those of its own graph once compiled:
    they hold the fake-tensor mode, which weakly references each parameter, and a weakly
    referenced parameter cannot be swapped (``model.to()`` swaps a subclass parameter)."""
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)


def _erase(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and its record of values (the graph keeps erased nodes by name)."""
    node.meta.clear()
    graph.erase_node(node)


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
        merged.append(MergedGroup(gemm, gemm.weight, inputs_checked))
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


def hold_weights_as_constants(gm: fx.GraphModule, example_inputs: list) -> list[tuple[int, Any]]:
    """Take each NVFP4 weight subclass out of ``gm``'s inputs: a used one becomes its inner
    tensors, held as buffers of the graph (the same memory), rebuilt by a node of the graph;
    an unused one (a merged member's) is dropped. Returns the inputs taken, as (position,
    object). A compiled region unwraps each subclass input at every call (AOTAutograd reads its
    size, stride and attributes through Python), which under CUDA graphs can be most of a decode
    step's host time; buffers of plain tensors it passes as they are."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    first_computation = next((node for node in gm.graph.nodes if node.op != "placeholder"), None)
    taken = []
    for position, node in enumerate(placeholders):
        value = example_inputs[position]
        if not isinstance(value, NVFP4StaticTensor):
            continue
        if node.users:
            names, metadata = value.__tensor_flatten__()
            prefix = f"_nvfp4_weight_{len(taken)}"
            attributes = [_add_constant(gm, f"{prefix}_{name}", getattr(value, name)) for name in names]
            with gm.graph.inserting_before(first_computation):
                inner = tuple(gm.graph.get_attr(attribute) for attribute in attributes)
                rebuilt = gm.graph.call_function(_rebuilding(type(value), names, metadata), inner)
            node.replace_all_uses_with(rebuilt)
        _erase(gm.graph, node)
        taken.append((position, value))
    if taken:
        gm.graph.lint()
        gm.recompile()
    return taken


def _rebuilding(weight_class: type, names: list[str], metadata: Any) -> Callable:
    """A function of a weight's inner tensors (``names``, in order) that rebuilds the weight."""

    def rebuild(*inner: torch.Tensor) -> NVFP4StaticTensor:
        return weight_class.__tensor_unflatten__(dict(zip(names, inner)), metadata, None, None)

    return rebuild


def _linear_operands(node: fx.Node) -> Optional[tuple]:
    """``(input, weight, bias)`` of a ``linear`` node (bias None where absent), else None."""
    if node.op != "call_function" or node.target is not F.linear:
        return None
    positional = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = (node.kwargs.get(name, value) for name, value in zip(("input", "weight", "bias"), positional))
    return (x, weight, bias) if isinstance(x, fx.Node) and isinstance(weight, fx.Node) else None


def _members_by_weight_address() -> dict[int, tuple[SiblingGemm, int]]:
    """Each live group's members by the address of their packed weight rows."""
    members = {}
    for gemm in live_sibling_gemms():
        start = 0
        for index, size in enumerate(gemm.sizes):
            members[gemm.weight.qdata[start : start + size].data_ptr()] = (gemm, index)
            start += size
    return members


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
    expected_bias = None if gemm.bias is None else _rows(gemm, index, gemm.bias)
    if (bias is None) != (expected_bias is None):
        return None
    compiled_from = [inputs[node] for node in weight_inputs]
    if bias is not None:
        if bias not in inputs or not _same_memory(inputs[bias][1], expected_bias):
            return None
        compiled_from.append(inputs[bias])
    return gemm, index, tuple(compiled_from)


def _rows(gemm: SiblingGemm, index: int, tensor: torch.Tensor) -> torch.Tensor:
    start = sum(gemm.sizes[:index])
    return tensor[start : start + gemm.sizes[index]]


def _holds_its_slice(gemm: SiblingGemm, index: int, tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` (a member weight's inner tensors, in any order) are the group's inner
    tensors, the row-indexed ones (packed weight, block scales) as the member's rows."""
    names, _ = gemm.weight.__tensor_flatten__()
    group = [getattr(gemm.weight, name) for name in names]
    expected = [_rows(gemm, index, t) if t.dim() > 0 and t.shape[0] == gemm.weight.shape[0] else t for t in group]
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

    with graph.inserting_before(first):
        inner = tuple(graph.get_attr(attribute) for attribute in attributes)
        weight = graph.call_function(_rebuilding(weight_class, names, metadata), inner)
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
        _erase(graph, node)
        if weight_node.op == "call_function" and not weight_node.users:
            _erase(graph, weight_node)


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
