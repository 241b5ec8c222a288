"""Checkpoints with ``torch.distributed.checkpoint`` that load under any other layout.

The state is keyed by the model's own parameter names (pipeline stages keep
them, ``get_state_dict`` strips the DDP/FSDP/checkpoint wrappers) and the
optimizer state is flattened per parameter (``state.<param>.exp_avg``), so a
checkpoint written under one layout (dp/tp/pp/ZeRO, world size) loads into
any other: DCP reshards on load.

Writes are atomic: every rank writes into a temporary directory next to the
target, then rank 0 renames it into place; a reader never sees a partial
checkpoint under the final name.  The directory must be on a file system that
every rank sees.

Verified checkpoints (a manifest of sha256 digests written last; a missing,
truncated or corrupt file is a :class:`~autoplan.errors.CheckpointError`) are
:mod:`.checkpoint_integrity`'s, whose names are importable from here too:
:func:`save_verified`, :func:`verify`, :func:`latest_good`, :data:`MANIFEST_FILE`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from .agree import on_rank0
from .checkpoint_integrity import MANIFEST_FILE, latest_good, save_verified, verify

if TYPE_CHECKING:
    from .parallelize import ParallelModel

__all__ = ["save_checkpoint", "load_checkpoint", "METADATA_FILE", "save_verified", "verify",
           "latest_good", "MANIFEST_FILE"]

METADATA_FILE = "autoplan.json"


def save_checkpoint(pm: "ParallelModel", path: str | os.PathLike[str]) -> str:
    """Write ``pm``'s model and optimizer state to the directory ``path`` (collective).

    An existing checkpoint at ``path`` is replaced only once the new one is complete.
    """
    path = os.path.abspath(os.fspath(path))
    tmp = on_rank0(lambda: f"{path}.tmp-{uuid.uuid4().hex[:12]}")
    state = pm.state_dict()
    dcp.save(state, checkpoint_id=tmp)
    # dcp.save returns after rank 0 has written the metadata of every rank's files
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, METADATA_FILE), "w") as f:
            json.dump({"layout": pm.plan.to_dict(), "world_size": dist.get_world_size(),
                       "steps": pm.steps}, f, indent=1)
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:12]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(pm: "ParallelModel", path: str | os.PathLike[str]) -> None:
    """Load the checkpoint at ``path`` into ``pm``, whatever layout wrote it (collective)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata); was the save "
                              "interrupted, or is this the wrong directory?")
    state = pm.state_dict()
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        # DCP raises plain exceptions for missing keys / shapes, and its CheckpointException
        # (not an Exception) for unreadable files, carrying every rank's traceback text
        raise CheckpointError(f"cannot load {path} into this model: {_first_line(e)}; is it a "
                              "complete checkpoint of this model? (autoplan's verified "
                              "checkpoints are checked before loading)") from e
    pm.load_state_dict(state)
    meta = os.path.join(path, METADATA_FILE)
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                pm.steps = int(json.load(f).get("steps", pm.steps))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot read {meta} (autoplan.json, the step count) in {path}: "
                                  f"{_first_line(e)}") from e


def _first_line(exc: BaseException) -> str:
    """The first meaningful line of an exception (DCP's carry whole tracebacks per rank)."""
    for text in (str(exc), type(exc).__name__):
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith(("Traceback", "File ", "^")):
                return line[:300]
    return type(exc).__name__
