"""The sparse optimizer: the update of the embedding rows a step touched, where they live.

:class:`SparseUpdate` applies one step of :class:`~.plan.SparseOptimizer` to a block of
rows given the ids of the rows a step touched and their summed gradients: on a GPU shard's
owner, on a parameter server, or on a data-parallel replica.  It is exactly the update
the single-process references make:

========================  ==========================================================
sparse optimizer          single-process reference (dense or sparse gradient)
========================  ==========================================================
``sgd``                   ``torch.optim.SGD(lr)`` (untouched rows get a zero gradient)
``rowwise_adagrad``       :class:`RowWiseAdagrad` below (likewise)
``adam``                  ``torch.optim.SparseAdam(lr, betas, eps)`` on a
                          ``sparse=True`` table (lazy: only the touched rows move)
========================  ==========================================================

Row-wise Adagrad keeps one accumulator per row, ``s += mean(g^2)`` over the row's columns
(fbgemm's ``EXACT_ROWWISE_ADAGRAD``, the optimizer of MLPerf's DLRM-DCNv2): a table split
by columns sums its blocks' squares across their owners before the update
(:meth:`SparseUpdate.apply`'s ``row_square_sum``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ..records import Record
from .plan import SparseOptimizer

__all__ = ["SparseOptimizerConfig", "SparseUpdate", "RowWiseAdagrad", "reference_optimizer"]


@dataclass(frozen=True)
class SparseOptimizerConfig(Record):
    """The embedding rows' optimizer and its hyper-parameters."""

    kind: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SparseOptimizer(self.kind))
        if not (self.lr > 0 and self.eps > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"bad sparse optimizer hyper-parameters: lr={self.lr}, eps={self.eps}, "
                              f"betas=({self.beta1}, {self.beta2})")


class SparseUpdate:
    """The optimizer state of one block of rows (``rows x cols``) and its update.

    Parameters
    ----------
    config : SparseOptimizerConfig
    rows, cols : int
        The block's shape (state is kept for every row: a row's state starts at zero).
    device : torch.device
        Where the block's rows (and so its state) live.
    """

    def __init__(self, config: SparseOptimizerConfig, rows: int, cols: int,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.step = 0
        kind = config.kind
        if kind is SparseOptimizer.ROWWISE_ADAGRAD:
            self.state = {"sum": torch.zeros(rows, dtype=torch.float32, device=device)}
        elif kind is SparseOptimizer.ADAM:
            self.state = {"m": torch.zeros(rows, cols, dtype=torch.float32, device=device),
                          "v": torch.zeros(rows, cols, dtype=torch.float32, device=device)}
        else:
            self.state = {}

    @property
    def needs_row_squares(self) -> bool:
        """Whether the update reads each row's mean squared gradient over all its columns."""
        return self.config.kind is SparseOptimizer.ROWWISE_ADAGRAD

    @torch.no_grad()
    def apply(self, weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor,
              row_square_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
              total_cols: int | None = None) -> None:
        """Update ``weight[ids]`` (``ids`` distinct, local to the block) with ``grad``.

        ``row_square_sum(s)`` turns this block's per-row sums of squares into the whole
        row's (an all-reduce over the column blocks' owners); ``total_cols`` is the row's
        width when the block holds part of it.
        """
        self.step += 1
        cfg = self.config
        g = grad.to(torch.float32)
        if cfg.kind is SparseOptimizer.SGD:
            weight.index_add_(0, ids, (-cfg.lr * g).to(weight.dtype))
            return
        if cfg.kind is SparseOptimizer.ROWWISE_ADAGRAD:
            squares = (g * g).sum(dim=1)
            if row_square_sum is not None:
                squares = row_square_sum(squares)
            acc = self.state["sum"]
            acc.index_add_(0, ids, squares / (total_cols or g.shape[1]))
            scale = cfg.lr / (acc[ids].sqrt() + cfg.eps)
            weight.index_add_(0, ids, (-scale[:, None] * g).to(weight.dtype))
            return
        # lazy Adam, as torch.optim.SparseAdam computes it
        m, v = self.state["m"], self.state["v"]
        m_rows = m[ids].mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v_rows = v[ids].mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        m[ids], v[ids] = m_rows, v_rows
        bias1 = 1 - cfg.beta1 ** self.step
        bias2 = 1 - cfg.beta2 ** self.step
        step_size = cfg.lr * bias2 ** 0.5 / bias1
        update = -step_size * m_rows / (v_rows.sqrt() + cfg.eps)
        weight.index_add_(0, ids, update.to(weight.dtype))


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for whole (dense-gradient) tables: the single-process reference.

    Each row keeps ``s``; a step adds the mean of the row's squared gradient and moves the
    row by ``-lr g / (sqrt(s) + eps)``.  A row whose gradient is zero does not move, so
    this equals the sparse update of the rows a step touched.
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                state["sum"] += (g.float() * g.float()).mean(dim=1)
                p -= (group["lr"] * g.float() / (state["sum"].sqrt() + group["eps"])[:, None]).to(p.dtype)


def reference_optimizer(config: SparseOptimizerConfig, params) -> torch.optim.Optimizer:
    """The single-process optimizer the sparse update equals (see the module docstring);
    ``adam`` needs tables built with ``sparse=True``."""
    if config.kind is SparseOptimizer.SGD:
        return torch.optim.SGD(params, lr=config.lr)
    if config.kind is SparseOptimizer.ROWWISE_ADAGRAD:
        return RowWiseAdagrad(params, lr=config.lr, eps=config.eps)
    return torch.optim.SparseAdam(params, lr=config.lr, betas=(config.beta1, config.beta2),
                                  eps=config.eps)
