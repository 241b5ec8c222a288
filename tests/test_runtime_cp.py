"""Context parallelism (autoplan.runtime.cp): load-balanced sharding, and numerical
parity of CP training with a single process.

Unit tests (no processes) check the sharding, targets, positions and the loss
split exactly.  The distributed tests train the tiny GPT (eager and SDPA
attention) and the tiny Llama with grouped-query attention for 3 AdamW steps
under ``apply_cp`` with gradients averaged over the ``dp x cp`` group (DDP or
FSDP2): loss after every step and every parameter after steps 1 and 3 within
``ATOL = 1e-5`` of the single-process reference (see cp_cases.py).  Also the
two pipeline-stage modules of each model under CP (the adapters' embed and
block runners), chained in one process, and tensor (+ sequence) parallelism
inside each cp rank.
"""

from __future__ import annotations

import math

import pytest
import torch

import cp_cases
import runtime_cases as rc
from autoplan.errors import ConfigError, StrategyError
from autoplan.runtime.cp import (
    IGNORE_INDEX,
    NextTokenLoss,
    check_cp,
    cp_positions,
    next_token_targets,
    shard_batch,
    shard_sequence,
)
from autoplan.runtime.loss import token_cross_entropy
from dist_harness import run


# ---------------------------------------------------------------------- unit tests
@pytest.mark.parametrize("seq_len,cp", [(8, 1), (8, 2), (16, 4), (24, 3), (64, 8)])
def test_positions_partition_the_sequence(seq_len, cp):
    held = [cp_positions(seq_len, cp, r) for r in range(cp)]
    assert all(h.dtype == torch.long and h.shape == (seq_len // cp,) for h in held)
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 4), (24, 3), (64, 8)])
def test_positions_balance_causal_work(seq_len, cp):
    # a query at position p attends to p + 1 keys: every rank gets the same total
    work = [int((cp_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    assert work[0] * cp == seq_len * (seq_len + 1) // 2


def test_positions_are_head_and_tail_chunks():
    assert cp_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert cp_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert cp_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert cp_positions(6, 1, 0).tolist() == [0, 1, 2, 3, 4, 5]


def test_seq_len_must_divide_by_two_cp():
    with pytest.raises(StrategyError, match=r"seq_len=12 is not divisible by 2 \* cp = 8.*\[1, 2, 3, 6\]"):
        cp_positions(12, 4, 0)
    with pytest.raises(StrategyError, match="rank 2 is outside 0..1"):
        cp_positions(8, 2, 2)
    with pytest.raises(StrategyError, match="cp=0"):
        cp_positions(8, 0, 0)
    with pytest.raises(StrategyError):
        NextTokenLoss(seq_len=10, cp=2)


def test_check_cp_without_a_group():
    # what parallelize can check on every rank before any collective
    assert check_cp(rc.make_gpt(0, layers=1), seq_len=16, cp=4) == "gpt"
    with pytest.raises(StrategyError, match=r"2 \* cp = 6: .* use cp in \[1, 2, 4, 8\]"):
        check_cp(rc.make_gpt(0, layers=1), seq_len=16, cp=3)
    with pytest.raises(ConfigError, match="knows the package GPT"):
        check_cp(torch.nn.Linear(2, 2), seq_len=16, cp=2)
    pytest.importorskip("transformers")
    llama = rc.make_llama(0, layers=1)
    assert check_cp(llama, seq_len=16, cp=2) == "llama"
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="flash_attention_2"):
        check_cp(llama, seq_len=16, cp=2)


def test_shard_sequence_any_dim():
    x = torch.arange(2 * 3 * 8).view(2, 3, 8)
    got = shard_sequence(x, cp=2, rank=1, dim=2)
    assert torch.equal(got, x[:, :, 2:6])
    got = shard_sequence(x.transpose(1, 2), cp=2, rank=0, dim=1)
    assert torch.equal(got, x.transpose(1, 2)[:, [0, 1, 6, 7]])


def test_targets_are_shifted_before_sharding():
    ids = torch.arange(100, 116).view(1, 16)
    assert next_token_targets(ids)[0, -1] == IGNORE_INDEX
    for r in range(4):
        b = shard_batch(ids, cp=4, rank=r)
        assert torch.equal(b.ids[0], 100 + b.positions)
        for p, t in zip(b.positions.tolist(), b.targets[0].tolist()):
            assert t == (IGNORE_INDEX if p == 15 else 101 + p)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_loss_split_gives_the_mean_loss_and_its_gradient(cp):
    # the ranks' losses average to the single-process mean loss, and the average of
    # their gradients (what DDP/FSDP over dp x cp take) is its gradient
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (3, 16), generator=g)
    logits = torch.randn(3, 16, 11, generator=g, requires_grad=True)
    ref = token_cross_entropy(logits, ids, shift=True)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    loss_fn = NextTokenLoss(seq_len=16, cp=cp)
    losses, grad = [], torch.zeros_like(logits)
    for r in range(cp):
        b = shard_batch(ids, cp, r)
        local = logits.detach().index_select(1, b.positions).requires_grad_(True)
        loss = loss_fn(local, b.targets)
        (gl,) = torch.autograd.grad(loss, local)
        grad.index_add_(1, b.positions, gl / cp)
        losses.append(loss.detach())
    # fp32 (the loss upcasts to fp32, as token_cross_entropy does): rounding only
    torch.testing.assert_close(torch.stack(losses).mean(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-6)
    if cp > 1:   # a rank's loss is not the mean over its own tokens
        b = shard_batch(ids, cp, 0)
        local_mean = torch.nn.functional.cross_entropy(
            logits.detach().index_select(1, b.positions).reshape(-1, 11), b.targets.reshape(-1))
        assert not math.isclose(losses[0].item(), local_mean.item(), rel_tol=1e-3)


def test_loss_rejects_whole_sequences():
    with pytest.raises(Exception, match=r"takes one rank's logits \(batch, 8, vocab\)"):
        NextTokenLoss(seq_len=16, cp=2)(torch.zeros(1, 16, 5), torch.zeros(1, 16, dtype=torch.long))


# ---------------------------------------------------------------------- parity
def _report(title: str, results: dict) -> None:
    print(f"\n{title}")
    for label, r in results.items():
        print(f"  {label:30s} loss {r['loss_err']:.1e}  params {r['param_err']:.1e}  "
              f"{r['seconds']:.2f}s")


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_parity():
    pytest.importorskip("transformers")
    jobs = [
        ("gpt eager cp2", "gpt", 2, "ddp"),
        ("gpt sdpa cp2", "gpt-sdpa", 2, "ddp"),
        ("llama gqa cp2", "llama", 2, "ddp"),
        ("llama gqa sdpa cp2", "llama-sdpa", 2, "ddp"),
        ("gpt stages cp2", "gpt", 2, "stages-ddp"),
        ("llama stages cp2", "llama", 2, "stages-ddp"),
    ]
    results = run(cp_cases.cp_parity, 2, jobs, 3, None, True)
    errors = results[0].pop("errors")
    _report("cp=2 (DDP over the cp group)", results[0])
    assert set(results[0]) == {j[0] for j in jobs}
    assert errors["seq_len"].startswith("StrategyError: seq_len=10 is not divisible by 2 * cp = 4")
    assert "already runs context parallelism" in errors["twice"]
    assert "takes this rank's 8 tokens per sequence" in errors["whole sequences"]
    assert "flash_attention_2" in errors["flash attention"] and "'sdpa'" in errors["flash attention"]
    assert errors["family"].startswith("ConfigError: context parallelism knows the package GPT")


@pytest.mark.distributed
@pytest.mark.slow
def test_cp4_and_cp2_dp2_parity():
    pytest.importorskip("transformers")
    jobs = [
        ("gpt eager cp4", "gpt", 4, "ddp"),
        ("gpt sdpa cp4", "gpt-sdpa", 4, "ddp"),
        ("llama gqa cp4", "llama", 4, "ddp"),
        ("gpt eager cp2 x dp2 (DDP)", "gpt", 2, "ddp"),
        ("gpt sdpa cp2 x dp2 (FSDP2)", "gpt-sdpa", 2, "fsdp"),
        ("llama gqa cp2 x dp2 (FSDP2)", "llama", 2, "fsdp"),
    ]
    results = run(cp_cases.cp_parity, 4, jobs)
    _report("cp=4, and cp=2 x dp=2 (gradients over the 4-rank dp x cp group)", results[0])
    assert set(results[0]) == {j[0] for j in jobs}


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_tp2_parity():
    # tensor (and sequence) parallelism inside each cp rank: K/V gathered per local head
    pytest.importorskip("transformers")
    jobs = [
        ("gpt eager cp2 x tp2", "gpt", 2, "tp"),
        ("gpt sdpa cp2 x tp2 + sp", "gpt-sdpa", 2, "tp-sp"),
        ("llama gqa cp2 x tp2 + sp", "llama", 2, "tp-sp"),
    ]
    from autoplan import trace

    graphs = {name: trace(cp_cases.MODELS[name](0), seq_len=rc.SEQ).to_json()
              for name in ("gpt", "gpt-sdpa", "llama")}
    results = run(cp_cases.cp_parity, 4, jobs, 3, graphs)
    _report("cp=2 x tp=2 (FSDP2 over the cp group)", results[0])
    assert set(results[0]) == {j[0] for j in jobs}
