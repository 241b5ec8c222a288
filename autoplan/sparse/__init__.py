"""The sparse mode: embedding-heavy models on GPUs, host memory and CPU parameter servers.

Recommendation and search models hold huge, sparsely read embedding tables next to a
small dense network.  This package plans and runs them as TorchRec and parameter-server
systems do, one module per stage:

* :mod:`.tables` captures the tables (every ``nn.Embedding`` / ``nn.EmbeddingBag``), the
  traffic each gets, and the dense rest (:func:`trace_sparse`);
* :mod:`.cost` prices each table's placement (sharding, storage, devices) and a whole
  step (:class:`SparseCostModel`);
* :mod:`.placement` places the tables with OR-Tools CP-SAT, beside a TorchRec-style
  greedy baseline on the same cost model (:func:`plan_sparse`, :func:`greedy_plan`);
* :mod:`.runtime` runs a plan with torch.distributed (sharded ``EmbeddingBag`` s, id
  bucketing and all-to-alls, the dense part under DDP or FSDP2), :mod:`.server` the CPU
  parameter servers of the same job;
* :mod:`.report` prints plans per table and compares clusters (:func:`sparse_whatif`);
* :mod:`.models` holds DLRM (dot or DCNv2) and a two-tower model, :mod:`.validation`
  scores the cost model against published runs.
"""

from __future__ import annotations

from .plan import (Pooling, Sharding, SparseEstimate, SparseOptimizer, SparsePlan, Storage,
                   TableCost, TablePlacement)
from .tables import EmbeddingTable, SparseGraph, TableTraffic, find_tables, trace_sparse
from .cost import SparseConstants, SparseCostModel, load_sparse_constants

__all__ = ["Pooling", "Sharding", "Storage", "SparseOptimizer", "TablePlacement", "TableCost",
           "SparseEstimate", "SparsePlan", "EmbeddingTable", "SparseGraph", "TableTraffic",
           "find_tables", "trace_sparse", "SparseConstants", "SparseCostModel",
           "load_sparse_constants"]
from .placement import Prices, estimate_sparse, greedy_plan, plan_sparse, table_options

__all__ += ["Prices", "estimate_sparse", "greedy_plan", "plan_sparse", "table_options"]
from .report import ServerSpec, plan_frame, plan_text, sparse_whatif, whatif_text

__all__ += ["ServerSpec", "plan_frame", "plan_text", "sparse_whatif", "whatif_text"]
