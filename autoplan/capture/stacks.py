"""Repeated-block stacks: find them, keep a few representatives, truncate the rest.

A stack is a container (``nn.ModuleList``/``nn.Sequential``) with at least two
structurally identical children (:func:`find_stacks`).  Capture traces only the leading
representatives of each stack (:func:`_representatives`, :func:`_truncated`), so capture
time does not grow with depth, and maps every child of the full stack to the kept child
whose measurements it reuses (:func:`_map_full_to_rep`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Sequence

from torch import nn


@dataclass(frozen=True)
class Stack:
    """A container (``nn.ModuleList``/``nn.Sequential``) whose children are layers."""

    path: str
    names: tuple[str, ...]        # child names in order
    signatures: tuple[str, ...]   # structural signature of each child


def _signature(module: nn.Module) -> str:
    parts = [type(module).__qualname__]
    for name, sub in module.named_modules():
        parts.append(f"m:{name}:{type(sub).__qualname__}")
    for name, p in module.named_parameters(remove_duplicate=False):
        parts.append(f"p:{name}:{tuple(p.shape)}:{p.dtype}")
    for name, b in module.named_buffers(remove_duplicate=False):
        parts.append(f"b:{name}:{tuple(b.shape)}:{b.dtype}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def find_stacks(model: nn.Module) -> list[Stack]:
    """The outermost containers with at least two structurally identical children.

    Examples
    --------
    >>> from autoplan.models import GPT, GPTConfig
    >>> [s.path for s in find_stacks(GPT(GPTConfig(vocab_size=8, seq_len=4, hidden=8, heads=2, layers=3)))]
    ['blocks']
    """
    stacks: list[Stack] = []
    taken: list[str] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        names = tuple(mod._modules)
        sigs = tuple(_signature(mod._modules[n]) for n in names)
        counts: dict[str, int] = defaultdict(int)
        for s in sigs:
            counts[s] += 1
        if max(counts.values()) < 2:
            continue
        # a repeated child must carry parameters (ReLUs repeating is no stack), and be no
        # embedding table: a list of tables of one shape is features, not layers
        if not any(counts[s] >= 2 and any(True for _ in mod._modules[n].parameters())
                   and not isinstance(mod._modules[n], (nn.Embedding, nn.EmbeddingBag))
                   for n, s in zip(names, sigs)):
            continue
        stacks.append(Stack(path, names, sigs))
        taken.append(path)
    if not stacks:
        one = _single_block_stack(model)
        if one is not None:
            stacks.append(one)
    return stacks


#: The last path component of the block list in the model families autoplan knows
#: (Hugging Face ``model.layers``, ``transformer.h``, ``encoder.layer``, ``encoder.block``,
#: ``decoder.layers``; the package GPT's ``blocks``).
BLOCK_LIST_NAMES = ("layers", "h", "layer", "block", "blocks")


def _single_block_stack(model: nn.Module) -> Stack | None:
    """A model built with one block has no repeated child; its block list (an
    ``nn.ModuleList`` of one child carrying parameters, named as the known families name
    theirs, :data:`BLOCK_LIST_NAMES`) is its stack, so the block is a block as in the same
    model with more of them.  The outermost such list, when there is exactly one.

    >>> from autoplan.models import GPT, GPTConfig
    >>> [(s.path, s.names) for s in find_stacks(GPT(GPTConfig(vocab_size=8, seq_len=4, hidden=8, heads=2, layers=1)))]
    [('blocks', ('0',))]
    """
    found = []
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) != 1:
            continue
        if path.rpartition(".")[2] not in BLOCK_LIST_NAMES:
            continue
        if any(path.startswith(f + ".") for f, _ in found):
            continue
        child = next(iter(mod._modules.values()))
        if child is None or not any(True for _ in child.parameters()):
            continue
        found.append((path, child))
    if len(found) != 1:
        return None
    path, child = found[0]
    mod = model.get_submodule(path)
    names = tuple(mod._modules)
    return Stack(path, names, (_signature(child),))


def _representatives(stack: Stack) -> int:
    """How many leading children to keep: all distinct kinds, a middle one, and a last one."""
    seen: set[str] = set()
    prefix = 0
    for i, s in enumerate(stack.signatures):
        if s not in seen:
            seen.add(s)
            prefix = i + 1
    return min(len(stack.names), max(3, prefix + 2))


def _map_full_to_rep(stack: Stack, keep: int) -> list[int]:
    """For each child of the full stack, the kept child whose measurements it reuses.

    The first child maps to the first kept one (it may save tensors shared with
    later blocks), the last to the last kept one (its cut is followed by the
    post segment), and every other child to a kept middle child of the same
    structure (its cut is followed by another block).
    """
    n = len(stack.names)
    if keep >= n:
        return list(range(n))
    sigs = stack.signatures
    out = []
    for i in range(n):
        if i == 0:
            out.append(0)
            continue
        if i == n - 1 and sigs[keep - 1] == sigs[i]:
            out.append(keep - 1)
            continue
        middle = [j for j in range(1, keep - 1) if sigs[j] == sigs[i]]
        if not middle:
            middle = [j for j in range(keep) if sigs[j] == sigs[i]]
        out.append(middle[-1])
    return out


@contextlib.contextmanager
def _truncated(model: nn.Module, stacks: Sequence[Stack], keep: Sequence[int]):
    """Temporarily keep only the first ``keep[i]`` children of each stack."""
    saved = []
    try:
        for st, k in zip(stacks, keep):
            cont = model.get_submodule(st.path) if st.path else model
            saved.append((cont, cont._modules))
            cont._modules = OrderedDict(list(cont._modules.items())[:k])
        yield
    finally:
        for cont, mods in saved:
            cont._modules = mods
