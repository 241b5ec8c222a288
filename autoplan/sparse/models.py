"""Embedding-heavy models: DLRM (dot or DCNv2 interaction) and a two-tower retrieval model.

Both are plain ``nn.Module`` s built from ``nn.EmbeddingBag`` / ``nn.Embedding`` tables
and ``nn.Linear`` layers; they take several inputs (dense features and ids), each with
one row per sample, so that the capture, the planner and the runtime see them as a
user's model would be seen.  The zoo (``autoplan.zoo``) builds them at the published
shapes (``zoo:dlrm-dcnv2``, ``zoo:dlrm-criteo``, ``zoo:two-tower``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["DLRM", "TwoTower", "LowRankCross", "MLPERF_DCNV2_ROWS", "MLPERF_DCNV2_HOT",
           "CRITEO_1TB_ROWS"]

#: Rows of the 26 tables of MLPerf Training's DLRM-DCNv2 (Criteo 1TB, categories capped at
#: 40M): ``--num_embeddings_per_feature`` of mlcommons/training recommendation_v2 and
#: facebookresearch/dlrm ``torchrec_dlrm/scripts/materialize_synthetic_multihot_dataset.py``.
MLPERF_DCNV2_ROWS: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
#: Ids per sample of each table in the synthetic multi-hot dataset (``--multi_hot_sizes``,
#: same sources): 214 ids per sample.
MLPERF_DCNV2_HOT: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
#: Rows of the 26 tables of Criteo 1TB without a cap (one id per table and sample), as the
#: TorchRec DLRM example trains it (facebookresearch/dlrm ``torchrec_dlrm/README.MD``).
CRITEO_1TB_ROWS: tuple[int, ...] = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35)


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class LowRankCross(nn.Module):
    """One DCNv2 cross layer with a low-rank weight: ``x0 * (U (V x) + b) + x``
    (Wang et al. 2021, "DCN V2", Eq. 1 with ``W = U V``; TorchRec ``LowRankCrossNet``)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.v = nn.Linear(dim, rank, bias=False)
        self.u = nn.Linear(rank, dim)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.u(self.v(x)) + x


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019) with a dot or a DCNv2 interaction.

    ``forward(dense, ids)``: ``dense`` is ``(batch, dense_features)`` floats, ``ids`` is
    ``(batch, sum(hot))`` integer ids, the ``hot[t]`` ids of table ``t`` side by side
    (a fixed number of ids per sample and table, as the MLPerf multi-hot dataset has).
    Returns one logit per sample, ``(batch,)``.

    Parameters
    ----------
    rows : sequence of int
        Rows of each embedding table.
    dim : int
        Embedding dimension (the bottom MLP ends at it).
    hot : sequence of int, optional
        Ids per sample of each table (default: one each).
    dense_features : int
    bottom, top : sequence of int
        Hidden sizes of the bottom MLP (its last is ``dim``) and of the top MLP (its last,
        1, is the logit).
    interaction : {"dot", "dcn"}
        Pairwise dot products of the 1 + T vectors (DLRM) or a DCNv2 cross network over
        their concatenation.
    cross_layers, cross_rank : int
        The DCNv2 network's depth and its weights' rank.
    pooling : {"sum", "mean"}
    """

    def __init__(self, rows: Sequence[int], dim: int, *, hot: Sequence[int] | None = None,
                 dense_features: int = 13, bottom: Sequence[int] = (512, 256),
                 top: Sequence[int] = (1024, 1024, 512, 256, 1), interaction: str = "dot",
                 cross_layers: int = 3, cross_rank: int = 512, pooling: str = "sum") -> None:
        super().__init__()
        if interaction not in ("dot", "dcn"):
            raise ValueError(f"interaction must be 'dot' or 'dcn', got {interaction!r}")
        self.hot = tuple(int(h) for h in (hot or [1] * len(rows)))
        if len(self.hot) != len(rows):
            raise ValueError(f"hot has {len(self.hot)} entries for {len(rows)} tables")
        self.interaction = interaction
        self.bottom = _mlp([dense_features, *bottom, dim], last_relu=True)
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode=pooling) for r in rows)
        features = len(rows) + 1
        if interaction == "dcn":
            width = features * dim
            self.cross = nn.ModuleList(LowRankCross(width, cross_rank) for _ in range(cross_layers))
        else:
            width = dim + features * (features - 1) // 2
            self.cross = nn.ModuleList()
        self.top = _mlp([width, *top], last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = [table(part) for table, part in zip(self.tables, ids.split(self.hot, dim=1))]
        if self.interaction == "dcn":
            x0 = torch.cat([x, *pooled], dim=1)
            h = x0
            for layer in self.cross:
                h = layer(x0, h)
        else:
            f = torch.stack([x, *pooled], dim=1)                 # (batch, 1 + T, dim)
            z = torch.bmm(f, f.transpose(1, 2))
            i, j = torch.triu_indices(f.shape[1], f.shape[1], offset=1, device=f.device)
            h = torch.cat([x, z[:, i, j]], dim=1)
        return self.top(h).squeeze(-1)


class TwoTower(nn.Module):
    """A two-tower retrieval model (Yi et al. 2019, "Sampling-bias-corrected neural
    modeling"; TorchRec's ``two_tower`` example): a user tower over the user's id and the
    mean of its recent items, an item tower over the item's id and category, scored by
    their dot product.

    ``forward(user, history, item, category)``: ``(batch,)``, ``(batch, history_len)``,
    ``(batch,)`` and ``(batch,)`` ids; returns one logit per pair, ``(batch,)``.
    """

    def __init__(self, users: int, items: int, categories: int, dim: int, *,
                 tower: Sequence[int] = (256, 128)) -> None:
        super().__init__()
        self.user_id = nn.Embedding(users, dim)
        self.user_history = nn.EmbeddingBag(items, dim, mode="mean")
        self.item_id = nn.Embedding(items, dim)
        self.item_category = nn.Embedding(categories, dim)
        self.user_tower = _mlp([2 * dim, *tower], last_relu=False)
        self.item_tower = _mlp([2 * dim, *tower], last_relu=False)

    def forward(self, user: torch.Tensor, history: torch.Tensor, item: torch.Tensor,
                category: torch.Tensor) -> torch.Tensor:
        u = self.user_tower(torch.cat([self.user_id(user), self.user_history(history)], dim=1))
        v = self.item_tower(torch.cat([self.item_id(item), self.item_category(category)], dim=1))
        return (u * v).sum(-1)
