"""autoplan: a cost-model-based automatic parallelism planner for PyTorch training.

The flow: :func:`trace` captures a model as a costed layer graph;
:func:`load_cluster` describes the hardware; :func:`estimate` predicts the step
time and memory of a layout; :func:`plan` searches the layouts;
:func:`parallelize` runs the chosen plan with torch.distributed.  Embedding-heavy
models (recommendation) take :func:`trace_sparse` and :func:`plan_sparse`
(:mod:`autoplan.sparse`), whose :class:`SparsePlan` :func:`parallelize` runs too.
"""

from __future__ import annotations

from ._lazy import lazy_names as _lazy_names
from ._optional import quiet_torchao as _quiet_torchao
from .errors import AutoplanError
from .graph import LayerRecord, ModelGraph
from .hardware import Cluster, available_profiles, compose_cluster, load_cluster
from .strategy import Strategy
from .cost import Estimate, estimate, estimate_plan
from .plan import Plan
from .search import plan, plan_diff, replan
from .zoo import trace  # capture.trace, also taking "zoo:<name>" / "hf:<type>" specs as whatif does

__all__ = ["trace", "ModelGraph", "LayerRecord", "AutoplanError", "load_cluster", "compose_cluster",
           "available_profiles", "Cluster", "Strategy", "estimate", "estimate_plan", "Estimate",
           "plan", "Plan", "replan", "plan_diff", "parallelize", "ParallelModel", "whatif",
           "trace_sparse", "plan_sparse", "SparsePlan", "__version__"]

# Heavier entry points load on first use: the runtime pulls in torch.distributed's
# tensor/FSDP/pipelining stacks, the reports pandas plotting and matplotlib.
_LAZY = {"parallelize": ".runtime", "ParallelModel": ".runtime", "whatif": ".report",
         # the sparse mode (embedding tables on GPUs, host memory and CPU servers)
         "trace_sparse": ".sparse", "plan_sparse": ".sparse", "SparsePlan": ".sparse"}
__getattr__, __dir__ = _lazy_names(__name__, _LAZY, __all__)

__version__ = "0.1.0"

# transformers imports torchao (the fp8 extra) where it is installed: keep its kernel
# loading messages off the console (autoplan._optional.quiet_torchao)
_quiet_torchao()
