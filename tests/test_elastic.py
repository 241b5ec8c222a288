"""Fault tolerance: verified checkpoints, refusing a world no layout fits, and resuming
after a killed process on fewer processes with the loss of an uninterrupted run.

The kill test orchestrates the restart itself rather than through torchrun's
elastic agents: 4 ranks train with checkpoints, one rank is SIGKILLed in mid-run,
the harness sees the others fail at their next collective (gloo notices the
closed connection at once) and ends them, then the 3 survivors' world starts
again from the last good checkpoint, which DCP reshards from 4 to 3 ranks.
Why not torchrun: the same scenario under ``torchrun --nnodes=2:4
--nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d`` with 4 agents on
localhost (kill one agent and its worker at step 10, checkpoints every 4 steps)
works, re-rendezvouses with 3 and matches the reference from step 9 on, but
takes ~106 s on a 2-core machine (~40 s of it the first rendezvous), too slow
for the test suite; this test takes ~20 s.  Note that torchrun starts each
worker in its own session: killing an agent's process group leaves its worker
running.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal

import pytest
import torch

from autoplan import elastic
from autoplan.elastic import (EXIT_NO_LAYOUT, MANIFEST_FILE, NoLayoutFits, batch_for_step,
                              latest_good, main_exit_code, run_elastic, verify)
from autoplan.errors import CheckpointError
from dist_harness import run, run_outcomes

#: tiny fp32 GPT; the global batch divides by 4 and by 3 (the world before and after the kill)
GPT_ARGS = dict(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=2)
GLOBAL_BATCH = 12
SEED = 7
#: loss tolerance against the single-process reference (fp32, DDP over 4 and 3 ranks)
ATOL = 1e-5


def _gpt() -> torch.nn.Module:
    from autoplan.zoo import build_model

    return build_model("gpt", GPT_ARGS, dtype=torch.float32, device="cpu")[0]


def _train(rank: int, world: int, root: str, steps: int, every: int, keep: int = 3,
           kill_at: int | None = None, kill_rank: int | None = None) -> dict:
    """``run_elastic`` on this rank; ``kill_rank`` SIGKILLs itself after step ``kill_at``."""

    def on_step(step: int, loss: float) -> None:
        if step == kill_at and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    res = run_elastic(_gpt, global_batch=GLOBAL_BATCH, seq_len=GPT_ARGS["seq_len"],
                      vocab_size=GPT_ARGS["vocab_size"], steps=steps, checkpoint_dir=root,
                      checkpoint_every=every, seed=SEED, keep=keep, on_step=on_step)
    return {"world": res.world_size, "resumed_from": res.resumed_from, "losses": res.losses,
            "checkpoints": res.checkpoints}


def _reference_losses(steps: int) -> dict[int, float]:
    """One plain process, no autoplan runtime: same seed, same model, same per-step data."""
    from autoplan.capture import token_cross_entropy

    torch.manual_seed(SEED)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    out = {}
    for step in range(1, steps + 1):
        ids = batch_for_step(SEED, step, global_batch=GLOBAL_BATCH, seq_len=GPT_ARGS["seq_len"],
                             vocab_size=GPT_ARGS["vocab_size"])
        loss = token_cross_entropy(model(ids), ids, shift=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[step] = float(loss.detach())
    return out


def _tree(root) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _data_file(ckpt: str) -> str:
    """The largest DCP data file of a checkpoint."""
    names = [n for n in os.listdir(ckpt) if n.endswith(".distcp")]
    return max(names, key=lambda n: os.path.getsize(os.path.join(ckpt, n)))


# ---------------------------------------------------------------------- (a) integrity
@pytest.mark.distributed
def test_latest_good_skips_corrupt_and_half_written_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    out = run(_train, 2, str(root), 3, 1, 2)
    assert out[0]["losses"].keys() == {1, 2, 3}
    # keep=2: step-1 was deleted once step-3 verified
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]
    for name in ("step-2", "step-3"):
        verify(root / name)
    assert latest_good(root) == (str(root / "step-3"), 3)

    # a save interrupted before its rename/manifest leaves temp dirs: never a checkpoint
    (root / ".partial-step-4").mkdir()
    (root / ".partial-step-4" / "__0_0.distcp").write_bytes(b"half")
    (root / "step-5.tmp-0123456789ab").mkdir()

    pristine = tmp_path / "pristine"
    shutil.copytree(root / "step-3", pristine)
    data = _data_file(pristine)

    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))

    def truncate(path):
        path.write_bytes(path.read_bytes()[:-7])

    cases = {
        "flipped bytes": (lambda d: flip(d / data), [data, "corrupt"]),
        "truncated": (lambda d: truncate(d / data), [data, "truncated"]),
        "deleted file": (lambda d: (d / data).unlink(), [data, "missing"]),
        "no manifest": (lambda d: (d / MANIFEST_FILE).unlink(), [MANIFEST_FILE, "incomplete"]),
        "bad manifest": (lambda d: (d / MANIFEST_FILE).write_text("{"), [MANIFEST_FILE,
                                                                         "malformed"]),
    }
    for what, (damage, words) in cases.items():
        shutil.rmtree(root / "step-3")
        shutil.copytree(pristine, root / "step-3")
        damage(root / "step-3")
        with pytest.raises(CheckpointError) as err:
            verify(root / "step-3")
        for word in words:
            assert word in str(err.value), (what, str(err.value))
        with pytest.warns(UserWarning, match=re.escape(str(root / "step-3"))) as rec:
            assert latest_good(root) == (str(root / "step-2"), 2), what
        assert any(words[0] in str(w.message) for w in rec), what

    # nothing good at all
    shutil.rmtree(root / "step-2")
    with pytest.warns(UserWarning):
        assert latest_good(root) is None
    assert latest_good(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------- (b) nothing fits
def test_refuses_a_world_no_layout_fits_and_leaves_checkpoints(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    root = tmp_path / "ckpt"
    (root / "step-4").mkdir(parents=True)
    (root / "step-4" / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / "step-4" / MANIFEST_FILE).write_text("{}")
    before = _tree(root)
    monkeypatch.setenv("WORLD_SIZE", "5")     # 12 sequences do not split over 5 replicas

    def body():
        run_elastic(_gpt, global_batch=GLOBAL_BATCH, seq_len=16, vocab_size=128, steps=8,
                    checkpoint_dir=str(root), checkpoint_every=2)

    with pytest.raises(NoLayoutFits) as err:
        body()
    msg = str(err.value)
    assert "no layout fits 5 processes" in msg and "global_batch=12" in msg
    assert "[1, 2, 3, 4, 6, 12]" in msg
    assert main_exit_code(body) == EXIT_NO_LAYOUT == 3
    assert "no layout fits 5 processes" in capsys.readouterr().err
    assert _tree(root) == before
    assert not dist.is_initialized()
    # the policy itself
    s = elastic.choose_strategy(3, GLOBAL_BATCH, zero=3)
    assert (s.dp, s.tp, s.pp, s.micro_batch, s.zero) == (3, 1, 1, 4, 3)


# ---------------------------------------------------------------------- (c) the kill test
@pytest.mark.distributed
def test_kill_one_of_four_and_resume_on_three_matches_reference(tmp_path):
    root = str(tmp_path / "ckpt")
    steps, every, kill_at = 8, 2, 5
    reference = _reference_losses(steps)

    # 4 ranks; rank 3 is killed after step 5, the others fail at step 6's all-reduce
    outcomes = run_outcomes(_train, 4, root, steps, every, 3, kill_at, 3,
                            timeout=120, pg_timeout=30, grace=10)
    assert outcomes[3].exitcode == -signal.SIGKILL, outcomes[3].describe()
    for o in outcomes[:3]:
        assert o.exitcode != 0 and o.value is None, (o.rank, o.describe())
    logged = {int(s): float(x) for s, x in re.findall(r"step (\d+) loss ([0-9.]+)",
                                                      outcomes[0].log)}
    assert sorted(logged) == list(range(1, kill_at + 1)), outcomes[0].log
    torch.testing.assert_close(logged, {s: reference[s] for s in logged}, atol=ATOL, rtol=0)
    good = latest_good(root)
    assert good == (os.path.join(root, "step-4"), 4)

    # the 3 survivors start again: resume from step 4 (resharded 4 -> 3), run steps 5..8
    out = run(_train, 3, root, steps, every, 3, timeout=120, pg_timeout=30)
    for rank_out in out:
        assert rank_out["world"] == 3 and rank_out["resumed_from"] == 4
        # no step applied twice, none skipped after the checkpoint
        assert sorted(rank_out["losses"]) == [5, 6, 7, 8]
    resumed = out[0]["losses"]
    torch.testing.assert_close(resumed, {s: reference[s] for s in resumed}, atol=ATOL, rtol=0)
    verify(os.path.join(root, "step-8"))
    assert latest_good(root) == (os.path.join(root, "step-8"), 8)
