"""Fault tolerance: verified checkpoints and an elastic training entry point.

Two pieces, usable apart:

**Checkpoint integrity.**  :func:`save_verified` writes ``root/step-<N>``
through :meth:`ParallelModel.save` (torch.distributed.checkpoint, written to a
temporary directory and renamed into place), then writes ``manifest.json``
(step, world size, layout, sha256 and size of every file) atomically.  The
manifest is written last, so a checkpoint without a valid manifest is
incomplete by construction.  :func:`verify` checks one checkpoint against its
manifest; :func:`latest_good` returns the newest checkpoint that verifies and
warns about every newer one it skipped.  Only the last ``keep`` good
checkpoints are kept, and older ones are deleted only after a newer one
verified.

**Elastic training.**  :func:`run_elastic` is called by a training script in
every process of a job (under ``torchrun`` or any launcher that sets
``WORLD_SIZE``/``RANK``).  It chooses a layout for the world it finds
(:func:`choose_strategy`), loads the last good checkpoint, resharding it to
this world (DCP reshards on load), and continues from the step after it.  The
batch of step ``n`` is a function of ``(seed, n)`` only (:func:`batch_for_step`),
so after a restart no step is applied twice and none is lost beyond the
checkpoint interval: a run killed at any point and resumed on any world size
the policy accepts trains the same sequence of steps as an uninterrupted one.

Layout policy (elastic re-planning)
-----------------------------------
The runtime rejects uneven replica batches, so after a change of world size
the layout must divide the global batch evenly.  The policy is the uniform
one every world size can run: pure data parallelism, ``dp = world size``,
``tp = pp = 1``, one micro-batch per replica (``micro_batch = global_batch /
world``), ZeRO stage ``zero`` (0: DDP, 3: FSDP2), fp32.  When the global batch
is not divisible by the world size nothing fits: :func:`run_elastic` refuses
with :class:`NoLayoutFits` (a ConfigError) naming the world size, the batch and
the world sizes that would work, before touching the process group or the
checkpoint directory; :func:`main_exit_code` turns that into exit code
:data:`EXIT_NO_LAYOUT`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CheckpointError, ConfigError
from .records import atomic_write_text

__all__ = [
    "MANIFEST_FILE",
    "EXIT_NO_LAYOUT",
    "save_verified",
    "verify",
    "latest_good",
    "choose_strategy",
    "batch_for_step",
    "run_elastic",
    "ElasticResult",
    "main_exit_code",
    "NoLayoutFits",
]

log = logging.getLogger(__name__)

#: Name of the manifest inside a checkpoint directory; written last.
MANIFEST_FILE = "manifest.json"
#: Manifest format version.
MANIFEST_VERSION = 1
#: Exit code of a training script whose world size no layout fits (see module docstring).
EXIT_NO_LAYOUT = 3

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_PREFIX = ".partial-step-"
_HASH_CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------- integrity
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
    except (OSError, ValueError, KeyError, TypeError) as e:
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
    error: list[Any] = [None]
    if rank == 0:
        try:
            if os.path.exists(final):      # a stale one from a run that died after this step
                shutil.rmtree(final)
            os.rename(partial, final)
            manifest = {
                "version": MANIFEST_VERSION,
                "step": step,
                "world_size": dist.get_world_size(),
                "layout": program.layout.to_dict(),
                "files": _files_of(final),
            }
            atomic_write_text(os.path.join(final, MANIFEST_FILE),
                              json.dumps(manifest, indent=1, sort_keys=True))
            verify(final)
            _prune(root, keep, step)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"saving {final} failed on rank 0: {error[0]}")
    return final


# ---------------------------------------------------------------------- policy
class NoLayoutFits(ConfigError):
    """No layout of the elastic policy fits the world size (the message says which would)."""


def choose_strategy(world_size: int, global_batch: int, *, zero: int = 0):
    """The layout the elastic entry point runs on ``world_size`` processes (policy above).

    Raises
    ------
    NoLayoutFits
        When the global batch does not divide evenly over ``world_size``
        replicas; the message lists the world sizes that fit.
    """
    from .strategy import Strategy

    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if global_batch % world_size:
        fits = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        raise NoLayoutFits(
            f"no layout fits {world_size} processes: the elastic policy is data parallelism "
            f"with dp = world size, and global_batch={global_batch} is not divisible by "
            f"{world_size}; world sizes that fit: {fits}. Restart with one of them or change "
            "global_batch (checkpoints were left untouched)")
    return Strategy(dp=world_size, micro_batch=global_batch // world_size,
                    global_batch=global_batch, zero=zero, precision="fp32")


def batch_for_step(seed: int, step: int, *, global_batch: int, seq_len: int,
                   vocab_size: int) -> torch.Tensor:
    """The token batch of training step ``step`` (1-based): a function of ``(seed, step)``
    only, identical on every rank and for every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab_size, (global_batch, seq_len), generator=g)


# ---------------------------------------------------------------------- entry point
@dataclass
class ElasticResult:
    """What one :func:`run_elastic` call did.

    Attributes
    ----------
    world_size : int
    resumed_from : int
        The step of the checkpoint loaded (0: started fresh).
    losses : dict of int to float
        Loss of every step this call ran, by step number.
    checkpoints : list of str
        Checkpoints this call wrote.
    """

    world_size: int
    resumed_from: int
    losses: dict[int, float]
    checkpoints: list[str]


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_elastic(model_factory: Callable[[], torch.nn.Module], *, global_batch: int,
                seq_len: int, vocab_size: int, steps: int, checkpoint_dir: str,
                checkpoint_every: int, seed: int = 0, zero: int = 0, keep: int = 3,
                on_step: Callable[[int, float], None] | None = None) -> ElasticResult:
    """Train ``steps`` steps in total across restarts; call it in every process of the job.

    Parameters
    ----------
    model_factory : callable
        ``model_factory() -> nn.Module``, called after ``torch.manual_seed(seed)``
        on every rank: the same model everywhere (its initial weights matter
        only for a fresh start).
    global_batch, seq_len, vocab_size : int
        Shape of every step's token batch (:func:`batch_for_step`).
    steps : int
        Total training steps (1-based step numbers ``1..steps``).
    checkpoint_dir : str
        Root of the ``step-<N>`` checkpoints, on a file system every rank sees.
    checkpoint_every : int
        Save a verified checkpoint after every step divisible by it (and after the last).
    seed : int
        Seeds the model initialisation and the per-step data.
    zero : int
        ZeRO stage of the data-parallel layout (0: DDP, 3: FSDP2).
    keep : int
        Good checkpoints to keep.
    on_step : callable, optional
        ``on_step(step, loss)`` after each step, before its checkpoint (tests use it).

    Returns
    -------
    ElasticResult

    Raises
    ------
    NoLayoutFits
        When no layout fits the world size (see the module's policy), before
        any collective and without touching ``checkpoint_dir``.
    """
    import torch.distributed as dist

    from .runtime import parallelize

    if steps < 0 or checkpoint_every < 1:
        raise ConfigError(f"steps must be >= 0 and checkpoint_every >= 1, got steps={steps}, "
                          f"checkpoint_every={checkpoint_every}")
    world = _world_size()
    strategy = choose_strategy(world, global_batch, zero=zero)   # refuses before anything else
    if not dist.is_initialized():
        dist.init_process_group("gloo")       # torchrun's env:// rendezvous
    rank = dist.get_rank()

    torch.manual_seed(seed)
    model = model_factory()
    program = parallelize(model, strategy, global_batch=global_batch, seq_len=seq_len)

    # every rank must agree on the checkpoint: rank 0 picks, the others follow
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", latest_good(checkpoint_dir))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, found = box[0]
    if kind == "error":
        raise CheckpointError(f"looking for a checkpoint in {checkpoint_dir} failed on rank 0: "
                              f"{found}")
    resumed_from = 0
    if found is not None:
        path, resumed_from = found
        program.load(path)
        if rank == 0:
            log.info("resumed from %s (step %d) on %d processes", path, resumed_from, world)
            print(f"resumed from step {resumed_from} on {world} processes", flush=True)

    losses: dict[int, float] = {}
    written: list[str] = []
    for step in range(resumed_from + 1, steps + 1):
        batch = batch_for_step(seed, step, global_batch=global_batch, seq_len=seq_len,
                               vocab_size=vocab_size)
        loss = program.step(batch)
        losses[step] = loss
        if rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
        if on_step is not None:
            on_step(step, loss)
        if step % checkpoint_every == 0 or step == steps:
            written.append(save_verified(program, checkpoint_dir, step, keep=keep))
    return ElasticResult(world_size=world, resumed_from=resumed_from, losses=losses,
                         checkpoints=written)


def main_exit_code(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` (a training script's body calling :func:`run_elastic`); return the
    process exit code: 0, or :data:`EXIT_NO_LAYOUT` with the reason on stderr when no
    layout fits the world size.  Other errors propagate."""
    try:
        fn()
    except NoLayoutFits as e:
        print(f"autoplan.elastic: {e}", file=sys.stderr, flush=True)
        return EXIT_NO_LAYOUT
    return 0
