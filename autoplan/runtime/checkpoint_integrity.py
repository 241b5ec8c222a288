"""Verified checkpoints: a manifest of sha256 digests beside the DCP files.

:func:`save_verified` writes ``root/step-<N>`` through :meth:`ParallelModel.save`
(:func:`autoplan.runtime.checkpoint.save_checkpoint`: torch.distributed.checkpoint,
written to a temporary directory and renamed into place), then writes
``manifest.json`` (step, world size, layout, sha256 and size of every file)
atomically.  The manifest is written last, so a checkpoint without a valid
manifest is incomplete by construction.  :func:`verify` checks one checkpoint
against its manifest (a missing, truncated or corrupt file, or a malformed
manifest, is a :class:`~autoplan.errors.CheckpointError`); :func:`latest_good`
returns the newest checkpoint that verifies and warns about every newer one it
skipped.  Only the last ``keep`` good checkpoints are kept, and older ones are
deleted only after a newer one verified.

Only :func:`save_verified` needs torch.distributed (imported when called):
checking a checkpoint needs the standard library alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..records import atomic_write_text

__all__ = ["MANIFEST_FILE", "MANIFEST_VERSION", "save_verified", "verify", "latest_good"]

log = logging.getLogger(__name__)

#: Name of the manifest inside a checkpoint directory; written last.
MANIFEST_FILE = "manifest.json"
#: Manifest format version.
MANIFEST_VERSION = 1

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_PREFIX = ".partial-step-"
_HASH_CHUNK_BYTES = 1 << 20


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_of(path: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "size_bytes"}}`` of every file under ``path`` but the manifest."""
    out: dict[str, dict[str, Any]] = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if rel == MANIFEST_FILE:
                continue
            out[rel] = {"sha256": _sha256(full), "size_bytes": os.path.getsize(full)}
    return dict(sorted(out.items()))


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step-<N>`` directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def verify(path: str | os.PathLike[str]) -> None:
    """Check the checkpoint at ``path`` against its manifest.

    Raises
    ------
    CheckpointError
        Naming the manifest when it is missing or unreadable (an incomplete
        checkpoint), or the file that is missing, truncated (size differs) or
        corrupt (sha256 differs).
    """
    path = os.path.abspath(os.fspath(path))
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete "
                              "(the save was interrupted before its manifest was written)")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError(f"version {manifest.get('version')!r}, expected {MANIFEST_VERSION}")
        if not _is_count(manifest.get("step")):
            raise ValueError(f"step {manifest.get('step')!r} is not a step number")
        for rel, want in files.items():
            if not (isinstance(want, dict) and _is_count(want.get("size_bytes"))
                    and isinstance(want.get("sha256"), str)):
                raise ValueError(f"files[{rel!r}] is {want!r}, not {{sha256, size_bytes}}")
            if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", ""):
                raise ValueError(f"files[{rel!r}] is outside the checkpoint directory")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable or malformed ({e}): "
                              "the checkpoint cannot be trusted") from None
    if ".metadata" not in files:
        raise CheckpointError(f"{manifest_path} lists no DCP .metadata file")
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (listed in {MANIFEST_FILE})")
        size = os.path.getsize(full)
        if size != want["size_bytes"]:
            raise CheckpointError(f"{full} is truncated or altered: {size} bytes, the manifest "
                                  f"says {want['size_bytes']}")
        if _sha256(full) != want["sha256"]:
            raise CheckpointError(f"{full} is corrupt: its sha256 differs from the manifest's")


def _is_count(value: Any) -> bool:
    """A non-negative int (not a bool): a step number or a size in bytes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_step(path: str) -> int:
    with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as f:
        return int(json.load(f)["step"])


def latest_good(root: str | os.PathLike[str]) -> tuple[str, int] | None:
    """The newest checkpoint under ``root`` that verifies, as ``(path, step)``; None if none.

    Every newer ``step-<N>`` directory that fails :func:`verify` is reported
    with a :class:`UserWarning` (and a log record) naming the problem.
    Temporary directories of interrupted saves are not checkpoints and are
    ignored.
    """
    for step, path in _step_dirs(os.fspath(root)):
        try:
            verify(path)
            if _manifest_step(path) != step:
                raise CheckpointError(f"{path}: the manifest says step "
                                      f"{_manifest_step(path)}, the directory step {step}")
        except CheckpointError as e:
            msg = f"skipping checkpoint {path}: {e}"
            log.warning(msg)
            warnings.warn(msg, stacklevel=2)
            continue
        return path, step
    return None


def _prune(root: str, keep: int, step: int) -> list[str]:
    """Delete checkpoints older than the ``keep`` newest good ones (none if fewer are good),
    and the temporary directories of saves up to ``step`` that were interrupted."""
    removed = []
    for name in os.listdir(root):
        m = re.match(re.escape(_PARTIAL_PREFIX) + r"(\d+)", name)
        if m and int(m.group(1)) <= step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    good = 0
    for step, path in _step_dirs(root):
        if good >= keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        try:
            verify(path)
            good += 1
        except CheckpointError:
            pass   # a corrupt newer one neither counts nor is deleted here
    return removed


def save_verified(program: Any, root: str | os.PathLike[str], step: int, *,
                  keep: int = 3) -> str:
    """Save ``program`` (a :class:`~autoplan.runtime.ParallelModel`) as ``root/step-<step>``
    with a manifest; collective (every rank calls it).  Returns the checkpoint's path.

    The state goes through ``program.save()`` into ``root/.partial-step-<step>``,
    rank 0 renames that to ``step-<step>``, hashes every file and writes the
    manifest atomically, then verifies the new checkpoint and deletes those
    older than the ``keep`` newest good ones.
    """
    import torch.distributed as dist

    from .agree import on_rank0_named

    if keep < 1:
        raise ConfigError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
    root = os.path.abspath(os.fspath(root))
    partial = os.path.join(root, f"{_PARTIAL_PREFIX}{step}")
    final = os.path.join(root, f"step-{step}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    program.save(partial)          # DCP, itself written to a temp dir and renamed

    def seal() -> None:
        if os.path.exists(final):      # a stale one from a run that died after this step
            shutil.rmtree(final)
        os.rename(partial, final)
        manifest = {
            "version": MANIFEST_VERSION,
            "step": step,
            "world_size": dist.get_world_size(),
            "layout": program.plan.to_dict(),
            "files": _files_of(final),
        }
        atomic_write_text(os.path.join(final, MANIFEST_FILE),
                          json.dumps(manifest, indent=1, sort_keys=True))
        verify(final)
        _prune(root, keep, step)

    on_rank0_named(seal, f"saving {final}", CheckpointError)
    return final
