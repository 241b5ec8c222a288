"""Expert parallelism: each MoE layer's experts split over ``ep`` ranks, tokens sent to them.

Hugging Face MoE families (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss, ...) keep
a layer's experts in one module holding 3-D parameter banks (``gate_up_proj
[E, 2I, H]``, ``down_proj [E, H, I]``, optionally biases ``[E, ...]``) whose
``forward(hidden_states, top_k_index, top_k_weights)`` returns, per token, the
routing-weighted sum of its ``k`` experts' outputs.  The router before it and
any shared expert beside it are dense and stay replicated.

:class:`ExpertParallel` replaces such a module (found from the capture's expert
roles, :attr:`~autoplan.graph.LinearRole.EXPERT_COLUMN`/``EXPERT_ROW``, never
from class names) by one holding ``E / ep`` consecutive experts per rank, as
GShard (Lepikhin et al. 2021, Sec. 2.2) and Switch Transformer (Fedus et al.
2022, Sec. 2.2) shard experts, and does per call:

1. **counts** -- every (token, slot) pair goes to the rank owning its expert;
   the ranks exchange how many rows each sends to each local expert
   (``all_to_all_single`` of ``E`` int64 counts);
2. **dispatch** -- ``all_to_all_single`` of the pairs' hidden states, with
   their routing weights as extra columns (``S x (H + 1)`` elements for
   ``S = tokens x k`` pairs; fp32 weights beside bf16 states travel as two bf16
   columns of their bytes, ``S x (H + 2)``: one collective, nothing rounded);
3. **experts** -- the family's own ``forward`` on the local slice of the
   banks, each received row as a token routed to one local expert with its
   weight (activation, biases, clamps, gate/up layout and the weighting stay
   the family's: no per-family code);
4. **combine** -- ``all_to_all_single`` of the weighted outputs back
   (``S x H``), summed per token.

Backward runs the same two all-to-alls in reverse.  Nothing overlaps: each
collective waits for its input and the next step waits for it.

**Gradients.**  Rank ``r`` of a ``dp x cp`` group of ``R`` ranks backpropagates its
loss ``L_r``; the data-parallel gradient is ``(1/R) sum_r dL_r``.  Dense
parameters get it by averaging over ``dp x cp``.  An expert shard held by the
``ep`` group ``g`` receives, through the all-to-all's backward, the gradients of
every loss in its group, ``sum_{r in g} dL_r``; averaging that over the
``edp = R / ep`` replicas of the shard gives ``(1/edp) sum_g sum_{r in g} dL_r =
(ep/R) sum_r dL_r``, ``ep`` times too much.  So the local banks enter the
expert computation through an identity whose backward multiplies by ``1/ep``
(exact for powers of two), and their data parallelism averages over ``edp``.

**Layout.**  Ranks of the flattened ``dp x cp`` index ``f`` with the same
``f // ep`` form an ep group (``autoplan.plan.MeshPlan.ep``); the banks are
:class:`~torch.distributed.tensor.DTensor` parameters ``Shard(0)`` on the ep
mesh dimension, under their original names and global shapes, so state dicts
and ``torch.distributed.checkpoint`` reshard them to any other layout.

Checks before any collective (:func:`check_ep`): the module holds per-expert
banks only (leading dimension ``E``, divisible by ``ep``), its forward takes
``(hidden_states, top_k_index, top_k_weights)``, a local copy with ``E / ep``
experts computes what the full module computes for them, and a token's
output is the sum of its slots' outputs; otherwise :class:`ConfigError` says
which of these the module broke.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..errors import ConfigError
from ..graph import LayerRecord, LinearRole

__all__ = ["ExpertBank", "ExpertParallel", "expert_bank", "expert_banks", "check_ep", "apply_ep"]

_EXPERT_ROLES = (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW)

#: Relative tolerance of the local-copy probe (:func:`check_ep`): the same kernels on the
#: same numbers, so only summation order may differ (fp32 rounding, ~1e-7).
_PROBE_RTOL = 1e-4


@dataclass(frozen=True)
class ExpertBank:
    """One MoE layer's experts module, as :func:`check_ep` understood it.

    ``path``: module path in the model; ``num_experts``: ``E``; ``hidden``: the
    token feature size (``in_features`` of the expert column linear);
    ``params``: its per-expert parameters (leading dimension ``E``);
    ``count_attrs``: its integer attributes holding ``E``, which the local copy
    sets to ``E / ep``; ``args``: the names of its forward's three inputs.
    """

    path: str
    num_experts: int
    hidden: int
    params: tuple[str, ...]
    count_attrs: tuple[str, ...]
    args: tuple[str, str, str]


# ---------------------------------------------------------------------- finding the banks
def expert_banks(layers: Iterable[tuple[LayerRecord, str]]) -> list[tuple[str, int, int]]:
    """``(module path, experts, hidden size)`` of the experts module of every layer among
    ``(record, layer path)`` that has expert linears: the common parent module of the
    parameters the capture gave expert roles."""
    out = []
    for layer, path in layers:
        lins = [l for l in layer.tp.linears if l.role in _EXPERT_ROLES]
        if not lins:
            continue
        parents = {l.name.rpartition(".")[0] for l in lins}
        if len(parents) != 1:
            raise ConfigError(f"layer {path!r}: its expert weights {[l.name for l in lins]} live "
                              f"in different modules {sorted(parents)}; expert parallelism "
                              "replaces one experts module per layer holding all of them")
        parent = parents.pop()
        column = next((l for l in lins if l.role is LinearRole.EXPERT_COLUMN), lins[0])
        out.append((f"{path}.{parent}" if parent else path, max(l.num_experts for l in lins),
                    column.in_features))
    return out


def _forward_args(module: nn.Module, where: str) -> tuple[str, str, str]:
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 3:
        raise ConfigError(f"{where} ({type(module).__name__}): its forward takes "
                          f"{[p.name for p in params]}; expert parallelism needs the experts "
                          "interface forward(hidden_states, top_k_index, top_k_weights)")
    return tuple(p.name for p in params[:3])  # type: ignore[return-value]


def _inspect(module: nn.Module, path: str, num_experts: int, hidden: int, ep: int) -> ExpertBank:
    where = f"experts module {path!r} ({type(module).__name__})"
    banks, other = [], []
    for name, p in module.named_parameters():
        if "." not in name and p.dim() >= 1 and p.shape[0] == num_experts:
            banks.append(name)
        else:
            other.append(f"{name} {tuple(p.shape)}")
    if other or not banks:
        raise ConfigError(f"{where}: expert parallelism splits parameters whose leading "
                          f"dimension is the {num_experts} experts; it does not understand "
                          f"{other or 'a module without any'} (shared across experts, or in a "
                          "submodule); use ep=1 for this model")
    if num_experts % ep:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ConfigError(f"{where}: ep={ep} does not divide its {num_experts} experts; "
                          f"ep in {fits} would")
    ints = [a for a, v in vars(module).items() if type(v) is int and v == num_experts]
    named = [a for a in ints if "expert" in a.lower()]
    return ExpertBank(path, num_experts, hidden, tuple(banks), tuple(named or ints),
                      _forward_args(module, where))


# ---------------------------------------------------------------------- the local copy
def _local_copy(module: nn.Module, bank: ExpertBank, num_local: int) -> nn.Module:
    """A shallow copy of ``module`` without parameters and with ``E / ep`` experts: its
    family ``forward`` runs on whatever local banks are set as plain attributes."""
    local = copy.copy(module)
    local.__dict__["_parameters"] = {}
    local.__dict__["_buffers"] = dict(module._buffers)
    local.__dict__["_modules"] = dict(module._modules)
    local.__dict__["_forward_hooks"] = {}
    local.__dict__["_forward_pre_hooks"] = {}
    for attr in bank.count_attrs:
        local.__dict__[attr] = num_local
    return local


def _run_local(local: nn.Module, bank: ExpertBank, tensors: dict[str, torch.Tensor],
               x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    local.__dict__.update(tensors)
    try:
        return type(local).forward(local, x, ids, w)
    finally:
        for name in tensors:
            local.__dict__.pop(name, None)


def _probe(module: nn.Module, bank: ExpertBank, ep: int) -> None:
    """Raise unless the local copy of the last expert shard computes what ``module`` does
    for those experts, and a token's output is the sum over its routing slots (no
    collective, no change to the RNG or to ``module``)."""
    where = f"experts module {bank.path!r} ({type(module).__name__})"
    num_local = bank.num_experts // ep
    first = (ep - 1) * num_local
    p0 = getattr(module, bank.params[0])
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = 2 * num_local
    x = torch.randn(rows, bank.hidden, generator=g).to(p0.device, p0.dtype)
    w = torch.rand(rows, 1, generator=g).to(p0.device, torch.float32) + 0.5
    local_ids = torch.arange(num_local, device=p0.device).repeat(2).unsqueeze(1)
    other = (torch.arange(rows, device=p0.device).unsqueeze(1) + 1) % bank.num_experts
    with torch.no_grad():
        try:
            full = module.forward(x, local_ids + first, w)
            local = _local_copy(module, bank, num_local)
            tensors = {n: getattr(module, n)[first:first + num_local] for n in bank.params}
            part = _run_local(local, bank, tensors, x, local_ids, w)
            pair = module.forward(x, torch.cat([local_ids + first, other], 1),
                                  torch.cat([w, 1.5 - w], 1))
            single = module.forward(x, other, 1.5 - w)
        except Exception as e:  # noqa: BLE001 - any failure means the module is not understood
            raise ConfigError(f"{where}: running it on a slice of {num_local} of its "
                              f"{bank.num_experts} experts (expert count attributes "
                              f"{list(bank.count_attrs)}) failed: {type(e).__name__}: {e}; "
                              "use ep=1 for this model") from e
    scale = float(full.abs().max()) + 1e-30
    if part.shape != full.shape or float((part - full).abs().max()) > _PROBE_RTOL * scale:
        raise ConfigError(f"{where}: a copy holding experts {first}..{bank.num_experts - 1} "
                          f"(the banks {list(bank.params)} sliced, expert count attributes "
                          f"{list(bank.count_attrs)} set to {num_local}) does not compute what "
                          "the module computes for them; expert parallelism cannot derive "
                          "its local experts: use ep=1 for this model")
    if float((pair - (full + single)).abs().max()) > _PROBE_RTOL * (float(pair.abs().max()) + 1e-30):
        raise ConfigError(f"{where}: a token routed to two experts does not get the sum of "
                          "its two experts' weighted outputs; expert parallelism combines "
                          "the outputs of remote experts by summing them: use ep=1")


def expert_bank(module: nn.Module, ep: int, *, path: str = "experts",
                num_experts: int | None = None, hidden: int | None = None) -> ExpertBank:
    """How ``module``, a MoE experts module, splits over ``ep`` ranks, checked by running
    it (no collective).  ``num_experts`` and ``hidden`` (the token feature size) come
    from the capture; without them, from the module's 3-D banks: their common leading
    dimension, and the one other dimension they all share.

    Raises
    ------
    ConfigError
        Naming what expert parallelism does not understand about the module.
    """
    where = f"experts module {path!r} ({type(module).__name__})"
    banks3 = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if num_experts is None:
        leading = {p.shape[0] for p in banks3}
        if len(leading) != 1:
            raise ConfigError(f"{where}: cannot tell its expert count from its 3-D parameters "
                              f"(leading dimensions {sorted(leading)})")
        num_experts = leading.pop()
    if hidden is None:
        shared = set.intersection(*[set(p.shape[1:]) for p in banks3]) if banks3 else set()
        if len(shared) != 1:
            raise ConfigError(f"{where}: cannot tell the token feature size from its banks' "
                              f"shapes {[tuple(p.shape) for p in banks3]}; pass hidden=")
        hidden = shared.pop()
    bank = _inspect(module, path, num_experts, hidden, ep)
    _probe(module, bank, ep)
    return bank


def check_ep(root: nn.Module, layers: Iterable[tuple[LayerRecord, str]], ep: int) -> list[ExpertBank]:
    """The experts modules of ``layers`` present in ``root``, checked to split over ``ep``
    ranks (no collective; raises :class:`ConfigError` naming what is not understood)."""
    out = []
    for path, num_experts, hidden in expert_banks(layers):
        try:
            module = root.get_submodule(path)
        except AttributeError:
            continue   # another pipeline stage's layer
        out.append(expert_bank(module, ep, path=path, num_experts=num_experts, hidden=hidden))
    return out


# ---------------------------------------------------------------------- collectives
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _pack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` with ``w`` (one number a row) appended as extra columns of ``x``'s
    dtype: the same value where the dtypes agree, else ``w``'s bytes reinterpreted
    (an fp32 weight is two bf16 columns), so nothing is rounded."""
    if w.dtype == x.dtype:
        return torch.cat([x, w.unsqueeze(1)], 1)
    return torch.cat([x, w.contiguous().view(x.dtype).view(w.shape[0], -1)], 1)


def _unpack(xw: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_pack`: ``(x, w)`` from packed rows."""
    x = xw[:, :width]
    if dtype == xw.dtype:
        return x, xw[:, width]
    return x, xw[:, width:].contiguous().view(dtype).view(-1)


class _DispatchWithWeights(torch.autograd.Function):
    """``all_to_all_single`` of token rows together with their routing weights, in one
    collective each way (the weights packed as extra columns by :func:`_pack`); the
    backward sends both gradients back the same way, again in one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, send: list[int], recv: list[int],
                group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.width, ctx.wdtype = x.shape[1], w.dtype
        packed = _pack(x, w)
        out = packed.new_empty((sum(recv), packed.shape[1]))
        dist.all_to_all_single(out, packed, recv, send, group=group)
        return _unpack(out, x.shape[1], w.dtype)

    @staticmethod
    def backward(ctx, gx: torch.Tensor, gw: torch.Tensor):
        packed = _pack(gx, gw.to(ctx.wdtype))
        out = packed.new_empty((sum(ctx.send), packed.shape[1]))
        dist.all_to_all_single(out, packed, ctx.send, ctx.recv, group=ctx.group)
        gx_back, gw_back = _unpack(out, ctx.width, ctx.wdtype)
        return gx_back, gw_back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


# ---------------------------------------------------------------------- the module
class ExpertParallel(nn.Module):
    """A MoE experts module holding ``E / ep`` experts of every bank on each ep rank.

    Parameters keep the original names and global shapes, as DTensors
    ``Shard(0)`` over ``ep_mesh``.  See the module docstring for what a call does.
    """

    def __init__(self, module: nn.Module, bank: ExpertBank, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        ep = ep_mesh.size()
        self.bank = bank
        self.ep = ep
        self.num_local = bank.num_experts // ep
        self.group = ep_mesh.get_group()
        lo = ep_mesh.get_local_rank() * self.num_local
        device = getattr(module, bank.params[0]).device
        for name in bank.params:
            full = getattr(module, name)
            local = full.detach()[lo:lo + self.num_local].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(dt, requires_grad=full.requires_grad))
        for name, buf in module.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
        # all_to_all_single orders its chunks by group rank, the experts are split by mesh
        # coordinate: a global expert's sort key is (owning group rank, local index)
        group_ranks = dist.get_process_group_ranks(self.group)
        owner = [group_ranks.index(r) for r in ep_mesh.mesh.flatten().tolist()]
        self.register_buffer("_key", torch.tensor(
            [owner[e // self.num_local] * self.num_local + e % self.num_local
             for e in range(bank.num_experts)], device=device), persistent=False)
        # not a submodule: it holds no state of its own, only the family's forward
        object.__setattr__(self, "_local", _local_copy(module, bank, self.num_local))

    def extra_repr(self) -> str:
        return (f"{self.bank.path}: {self.num_local} of {self.bank.num_experts} experts per rank, "
                f"ep={self.ep}")

    def _banks(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.bank.params:
            p = getattr(self, name)
            t = p.to_local() if isinstance(p, DTensor) else p
            out[name] = _ScaleGrad.apply(t, 1.0 / self.ep)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        names = self.bank.args
        vals = list(args[:3]) + [kwargs.pop(n) for n in names[len(args):] if n in kwargs]
        if len(vals) != 3 or kwargs:
            raise TypeError(f"{self.bank.path}: expected ({', '.join(names)}), got "
                            f"{len(args)} positional and {sorted(kwargs)} keyword arguments")
        hidden_states, top_k_index, top_k_weights = vals
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        k = top_k_index.shape[-1]
        idx = top_k_index.reshape(-1, k)
        wts = top_k_weights.reshape(-1, k)
        n_local, ep = self.num_local, self.ep

        # 1. counts: rows this rank sends to each (rank, local expert), in group-rank order
        key = self._key[idx.reshape(-1)]
        order = torch.argsort(key, stable=True)
        token = order // k
        counts = torch.bincount(key, minlength=ep * n_local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(ep, n_local).sum(1).tolist()
        recv = recv_counts.view(ep, n_local).sum(1).tolist()
        ids = torch.arange(n_local, device=h.device).repeat(ep).repeat_interleave(recv_counts)

        # 2. dispatch the pairs' hidden states with their routing weights: one all-to-all
        x = h[token]
        w = wts.reshape(-1)[order]
        x_recv, w_recv = _DispatchWithWeights.apply(x, w, send, recv, self.group)

        # 3. the family's experts on the local banks, one routing slot per row
        banks = self._banks()
        y = _run_local(self._local, self.bank, banks, x_recv, ids.unsqueeze(1),
                       w_recv.unsqueeze(1))
        # exactly zero, but ties every input and bank into the graph: a rank that received
        # no rows (or none for some bank) still runs the backward all-to-alls and gives its
        # banks a (zero) gradient, as the other ranks expect
        anchor = sum(t.narrow(0, 0, 0).sum() for t in (x_recv, w_recv, *banks.values()))
        y = y + anchor

        # 4. combine: outputs back to the tokens' ranks, summed over each token's slots
        y_back = _AllToAll.apply(y, recv, send, self.group)
        out = y_back.new_zeros((h.shape[0], y_back.shape[-1])).index_add(0, token, y_back)
        return out.to(hidden_states.dtype).reshape(shape)


def apply_ep(root: nn.Module, banks: Sequence[ExpertBank], ep_mesh: DeviceMesh) -> list[ExpertParallel]:
    """Replace every checked experts module of ``root`` by its :class:`ExpertParallel`."""
    out = []
    for bank in banks:
        module = root.get_submodule(bank.path)
        ep_module = ExpertParallel(module, bank, ep_mesh)
        parent, _, name = bank.path.rpartition(".")
        holder = root.get_submodule(parent) if parent else root
        if isinstance(holder, (nn.ModuleList, nn.ModuleDict)):
            holder[name if isinstance(holder, nn.ModuleDict) else int(name)] = ep_module
        else:
            setattr(holder, name, ep_module)
        out.append(ep_module)
    return out
