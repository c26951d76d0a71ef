"""Sibling linears run as one GEMM: a layer's q/k/v projections, its MLP's gate and up.

A decoder layer calls its attention projections one after another on the same hidden states, and
its gated MLP's gate and up projections likewise. Converted, each is a GEMM launch of its own,
and at decode those GEMMs are short: each pays a fixed cost (Python and a launch on the host, a
ramp-up on the GPU) that one GEMM over the members' concatenated weight rows pays once.

``fuse_sibling_linears(model)`` gives each converted, tied fusion group (``tie_fused_layers``
before convert) one weight holding the members' rows; each member's weight (and bias) becomes
its row slice, the same memory, so a checkpoint loaded into the members updates the group.
The members also share the group's two global-scale tensors: a checkpoint that gives a member
other global scales (or a ``copy_`` of such a weight into a member's) dissolves the group before
it is copied, and each member takes its own (``fuse_sibling_linears`` again fuses them where the
loaded scales are tied).
Eagerly, the first member called on an input runs the group's GEMM and keeps the other members'
parts of its output; each of them, called next on that same input (the same tensor, not changed
in place since), takes its part instead of running; a call on another input, or a member's
second call, runs the group's GEMM again. A member's output from the group is a column slice
of the group's output: a strided view, as ``Tensor.split`` gives. Calls on inference tensors
(``torch.inference_mode``: they keep no count of changes in place), calls of members whose
weight torchao's ``unwrap_tensor_subclass`` holds as plain tensors, and calls under
``torch.compile`` run the member alone; ``sibling_gemm_backend`` merges the group in a compiled
graph instead. Moving the model (``.to()``, ``.cuda()``), replacing a member's weight or bias,
or loading one with ``assign=True`` dissolves the group: the members run alone from then on,
each with global-scale tensors of its own. A copy of the model (``copy.deepcopy``, or saved
whole and loaded) holds its members' weights as rows of the copy's group weight, and so keeps
working groups.
"""

import weakref
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch.nn.utils import parametrize

from nvfp4_static.backends.cpu_eager import EagerCpuKernelCalls, eager_linear
from nvfp4_static.backends.triton_eager import EagerTritonLaunches
from nvfp4_static.fused_layers import STANDARD_FUSION_GROUPS, find_fusion_groups
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.tensor import BEFORE_COPY, NVFP4StaticTensor

__all__ = ["SiblingGemm", "fuse_sibling_linears", "live_sibling_gemms"]

_GEMMS: "weakref.WeakSet[SiblingGemm]" = weakref.WeakSet()


class SiblingGemm:
    """One fusion group's GEMM: the members (in order), their concatenated weight and bias, and
    the parts of the last output not yet taken by their members."""

    # A group pickled without prepared CPU calls runs its CPU GEMM through the general route.
    _cpu_calls: Optional[EagerCpuKernelCalls] = None

    def __init__(self, members: list[NVFP4StaticLinear], weight: NVFP4StaticTensor, bias: Optional[torch.Tensor]):
        self.members = members
        self.weight = weight
        self.bias = bias
        self.sizes = [member.out_features for member in members]
        self._parameters = [(member.weight, member.bias) for member in members]
        self._addresses = self._rows_addresses()
        self._launches = EagerTritonLaunches()
        self._cpu_calls = EagerCpuKernelCalls()
        self._pending = None  # (input, its version, {member index: output part})
        self._merged_graphs = weakref.WeakSet()  # compiled graphs holding the group's weight
        _GEMMS.add(self)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_merged_graphs"]  # a copy is merged in no graph
        return state

    def __setstate__(self, state: dict) -> None:
        """A copied or unpickled group is live too (``live_sibling_gemms``), and intact where the
        copy kept its members' weights as rows of its weight (``copy.deepcopy`` of a model does)."""
        self.__dict__.update(state)
        self._merged_graphs = weakref.WeakSet()
        if self.weight is not None:
            self._addresses = self._rows_addresses()
        _GEMMS.add(self)

    def merged_into(self, graph) -> None:
        """Note a compiled graph that runs this group as one GEMM (``sibling_gemm_backend``):
        dissolving the group calls its ``release()``, which drops what it holds of the group."""
        self._merged_graphs.add(graph)

    def output(self, index: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Member ``index``'s output for ``x``: kept from the group's last GEMM on this ``x``, or
        from a new one; None where the member must run alone (an inference tensor, or the group
        dissolved)."""
        if x.is_inference():  # no version counter: a change in place could not be seen
            return None
        pending = self._pending
        if pending is not None:
            pending_x, version, parts = pending
            if pending_x is x and version == x._version and index in parts:
                out = parts.pop(index)
                if not parts:
                    self._pending = None
                return out
            self._pending = None
        if not self._intact():
            if not self._unwrapped():
                self.dissolve()
            return None
        out = eager_linear(self._cpu_calls, self._launches, x, self.weight, self.bias)
        parts = dict(enumerate(out.split(self.sizes, dim=-1)))
        own = parts.pop(index)
        self._pending = (x, x._version, parts) if parts else None
        return own

    def dissolve(self) -> None:
        """Let every member run alone from now on, and drop the group's own references and those
        of the compiled graphs that merged it."""
        for member in self.members:
            if member.sibling_gemm is self:
                member.sibling_gemm = None
        self._give_members_their_own_global_scales()
        self.weight = self.bias = self._pending = None
        for graph in list(self._merged_graphs):
            graph.release()
        self._merged_graphs.clear()

    def before_member_copy(self, weight: NVFP4StaticTensor) -> None:
        """Before ``weight`` is copied into a member (``load_state_dict``, or ``copy_`` on the
        member's weight): the members share the group's two global-scale tensors, so a weight
        with other global scales first dissolves the group, and each member then takes its own
        (a checkpoint's other members may differ; fuse again after the load where they do not)."""
        if not _same_global_scales(weight, self.weight):
            self.dissolve()

    def _give_members_their_own_global_scales(self) -> None:
        """Fused, the members hold the group's global-scale tensors; apart, each holds a copy of
        its own, so that a checkpoint loaded later can give them different values."""
        if self.weight is None:
            return
        group = (self.weight.per_tensor_scale.data_ptr(), self.weight.act_per_tensor_scale.data_ptr())
        for member in self.members:
            weight = member._parameters.get("weight")
            if not isinstance(weight, NVFP4StaticTensor):
                continue
            if (weight.per_tensor_scale.data_ptr(), weight.act_per_tensor_scale.data_ptr()) == group:
                weight.per_tensor_scale = weight.per_tensor_scale.clone()
                weight.act_per_tensor_scale = weight.act_per_tensor_scale.clone()

    def _intact(self) -> bool:
        """Whether each member still holds the row slices it was given (the same parameters),
        at their rows of the group's weight and bias."""
        for member, (weight, bias) in zip(self.members, self._parameters):
            parameters = member._parameters
            if parameters.get("weight") is not weight or parameters.get("bias") is not bias:
                return False
        return _addresses(self._parameters) == self._addresses

    def rows(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s rows of ``tensor``, one of the group's (packed weight, block scales,
        bias)."""
        start = sum(self.sizes[:index])
        return tensor[start : start + self.sizes[index]]

    def _rows_addresses(self) -> list[tuple]:
        """Where each member's weight and bias keep their data while the group is intact: at
        their rows of the group's weight and bias (as ``_addresses`` lists them)."""
        return [
            (
                self.rows(index, self.weight.qdata).data_ptr(),
                self.rows(index, self.weight.scale).data_ptr(),
                None if self.bias is None else self.rows(index, self.bias).data_ptr(),
            )
            for index in range(len(self.members))
        ]

    def _unwrapped(self) -> bool:
        """Whether a member holds its weight as plain tensors (torchao's
        ``unwrap_tensor_subclass``): it runs alone eagerly, rebuilding its weight, while a
        compiled graph can still merge the group (``sibling_gemm_backend``)."""
        return any(parametrize.is_parametrized(member, "weight") for member in self.members)


def _before_copy_into_a_member(destination: NVFP4StaticTensor, source: NVFP4StaticTensor) -> None:
    """``tensor.BEFORE_COPY``'s check for fused groups: a copy into a member's weight goes
    through its group's ``before_member_copy``."""
    for gemm in live_sibling_gemms():
        if any(member._parameters.get("weight") is destination for member in gemm.members):
            gemm.before_member_copy(source)


BEFORE_COPY.append(_before_copy_into_a_member)


def live_sibling_gemms() -> Iterator[SiblingGemm]:
    """Every group not dissolved, of every model in this process (what a compiler backend
    matches a graph's weights against)."""
    return (gemm for gemm in list(_GEMMS) if gemm.weight is not None)


def _same_global_scales(a: NVFP4StaticTensor, b: NVFP4StaticTensor) -> bool:
    """Whether two weights have the same activation and weight global scales (compared on the
    CPU: a checkpoint's may be elsewhere than the model's)."""
    pairs = [(a.act_per_tensor_scale, b.act_per_tensor_scale), (a.per_tensor_scale, b.per_tensor_scale)]
    if any(t.is_meta for pair in pairs for t in pair):
        return True  # no values to compare (the copy refuses what it cannot take)
    return all(torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in pairs)


def _addresses(parameters: list[tuple]) -> list[tuple]:
    """Where each member's weight and bias (``(weight, bias)`` pairs) keep their data; read from
    the parameters themselves, not through ``Module.__getattr__`` (a few microseconds a name,
    paid at every group GEMM)."""
    return [
        (weight.qdata.data_ptr(), weight.scale.data_ptr(), None if bias is None else bias.data_ptr())
        for weight, bias in parameters
    ]


def fuse_sibling_linears(
    model: torch.nn.Module, groups: Sequence[Sequence[str]] = STANDARD_FUSION_GROUPS
) -> list[tuple[str, ...]]:
    """Run each converted fusion group of ``model`` as one GEMM (see the module docstring).

    Call it on a converted (or loaded) model whose groups were tied before convert
    (``tie_fused_layers``). Groups with a member that is not converted, or is an empty
    placeholder, are left as they are; groups already fused are kept, unless a member no longer
    holds its rows of the group's memory (then the group is fused anew). The outputs equal the
    members' own up to the order of fp32 sums.

    Returns:
        The fused groups, as fully qualified layer names.

    Raises:
        ValueError: a group's members differ in what one GEMM must share (activation or weight
            global scale, input width, dtype, device, backend, having a bias), or a member's
            weight was unwrapped (torchao's ``unwrap_tensor_subclass``) before fusing; nothing
            is changed then.
    """
    fused, to_fuse = [], []
    for names in find_fusion_groups(model, groups):
        members = [model.get_submodule(name) for name in names]
        if not all(isinstance(m, NVFP4StaticLinear) and m.loaded for m in members):
            continue
        gemm = members[0].sibling_gemm
        kept = gemm is not None and gemm.members == members and all(m.sibling_gemm is gemm for m in members)
        if not (kept and (gemm._intact() or gemm._unwrapped())):
            _check_fusable(names, members)
            to_fuse.append(members)
        fused.append(names)
    for members in to_fuse:
        _fuse(members)
    return fused


def _check_fusable(names: tuple[str, ...], members: list[NVFP4StaticLinear]) -> None:
    unwrapped = [name for name, m in zip(names, members) if parametrize.is_parametrized(m, "weight")]
    if unwrapped:
        raise ValueError(
            f"nvfp4_static: cannot fuse {list(names)} into one GEMM: {unwrapped} hold their weight as plain "
            f"tensors (torchao's unwrap_tensor_subclass); call fuse_sibling_linears(model) before unwrapping"
        )
    first = members[0].weight
    checks = {
        "activation global scale": lambda w, b: bool(torch.equal(w.act_per_tensor_scale, first.act_per_tensor_scale)),
        "weight global scale": lambda w, b: bool(torch.equal(w.per_tensor_scale, first.per_tensor_scale)),
        "input width": lambda w, b: w.shape[1] == first.shape[1],
        "dtype": lambda w, b: w.orig_dtype == first.orig_dtype,
        "device": lambda w, b: w.qdata.device == first.qdata.device,
        "backend": lambda w, b: w.linear_backend == first.linear_backend,
        "bias": lambda w, b: (b is None) == (members[0].bias is None),
    }
    for what, same in checks.items():
        different = [name for name, m in zip(names, members) if not same(m.weight, m.bias)]
        if different:
            raise ValueError(
                f"nvfp4_static: cannot fuse {list(names)} into one GEMM: {different} differ from "
                f"'{names[0]}' in {what}. One GEMM shares it; tie the group with "
                f"tie_fused_layers(model) after calibration and before convert"
            )


def _fuse(members: list[NVFP4StaticLinear]) -> None:
    first = members[0].weight
    weight = NVFP4StaticTensor(
        torch.cat([m.weight.qdata for m in members]),
        torch.cat([m.weight.scale for m in members]),
        first.block_size,
        first.orig_dtype,
        first.per_tensor_scale,
        first.act_per_tensor_scale,
        backend_override=first.backend_override,
        output_scale=first.output_scale,
    )
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    start = 0
    for member in members:
        end = start + member.out_features
        member.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            member.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    gemm = SiblingGemm(members, weight, bias)
    for index, member in enumerate(members):
        member.sibling_gemm, member.sibling_index = gemm, index
