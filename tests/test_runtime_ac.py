"""Selective activation recompute re-runs exactly the attention core the capture charged.

Every model here is built with ``seq_len == hidden_size``: a ``(b, s, h)``
activation then has two dimensions equal to ``seq_len``, which a shape-based
rule takes for an ``s x s`` attention tensor (and then also recomputes the
projections and the MLP).  The recompute is measured, not inferred: the
operators and FLOPs run during backward with selective recompute, minus those
run during backward without recompute, are the recomputed forward operators;
their FLOPs must equal the graph's ``selective_recompute_flops`` (what the cost
model charges) and their counted operators the captured core's, block by block.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import autoplan
from autoplan.errors import ConfigError, PlanMismatchError, RecordError
from autoplan.graph import AttentionCore, CoreOp, ModelGraph
from autoplan.models import GPT, GPTConfig
from autoplan.opstream import COUNTED, OpStream, op_name
from autoplan.runtime.ac import CorePolicy, apply_ac
from autoplan.strategy import Recompute

tf = pytest.importorskip("transformers")

VOCAB, SEQ, HIDDEN, BATCH = 64, 32, 32, 2     # SEQ == HIDDEN on purpose


def _llama(attention: str = "eager"):
    """Tiny Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    cfg._attn_implementation = attention
    return tf.LlamaForCausalLM(cfg)


def _gpt(attention: str = "eager", dropout: float = 0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=4, layers=2,
                         attention=attention, dropout=dropout))


def _gpt2(attention: str = "eager", dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                        attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attention
    return tf.GPT2LMHeadModel(cfg)


MODELS = {
    "llama": _llama,
    "llama-sdpa": lambda: _llama("sdpa"),
    "gpt": _gpt,
    "gpt-sdpa": lambda: _gpt("sdpa"),
    "gpt2": _gpt2,
}


def _loss(model, ids):
    out = model(ids) if isinstance(model, GPT) else model(input_ids=ids, use_cache=False)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                             ids[:, 1:].reshape(-1))


def _ids(seed: int = 1):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _with_ac(model, graph, mode=Recompute.SELECTIVE):
    model = copy.deepcopy(model)
    for block in graph.blocks:
        parent, _, name = block.name.rpartition(".")
        holder = model.get_submodule(parent)
        holder[int(name)] = apply_ac(holder[int(name)], mode, layer=block)
    return model


class _Ops(TorchDispatchMode):
    """Counted operators (the capture's naming) dispatched while active with grad mode on:
    during backward, the forward operators a recompute re-runs (backward's own operators
    run with grad mode off)."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = OpStream()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled():
            return out
        kind = self.stream.kind(func, args, kwargs)
        self.stream.produced(func, kind, args, out)
        if kind == COUNTED:
            self.ops[op_name(func)] += 1
        return out


def _backward(model, ids, autocast: bool = False):
    """(FLOPs, counted operators) run during backward, and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _loss(model, ids)
    with FlopCounterMode(display=False) as flops, _Ops() as ops:
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return flops.get_total_flops(), ops.ops, grads


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(name):
        if name not in cache:
            model = MODELS[name]()
            cache[name] = (model, autoplan.trace(model, seq_len=SEQ, micro_batch=BATCH))
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["llama", "gpt", "llama-sdpa", "gpt2"])
def test_selective_recomputes_exactly_the_captured_core(traced, name):
    model, graph = traced(name)
    ids = _ids()
    base_flops, base_ops, base_grads = _backward(model, ids)
    sel_flops, sel_ops, sel_grads = _backward(_with_ac(model, graph), ids)

    charged = sum(b.selective_recompute_flops for b in graph.blocks)
    assert charged > 0
    assert sel_flops - base_flops == charged
    recomputed = sel_ops - base_ops
    assert not base_ops - sel_ops
    expected = Counter()
    for block in graph.blocks:
        expected.update(o.op for o in block.attention_core.ops)
    assert recomputed == expected
    # the projections and the MLP are saved, not recomputed
    assert not {"mm", "addmm", "gelu", "silu", "native_layer_norm"} & set(recomputed)
    assert sel_grads.keys() == base_grads.keys()
    for n, g in base_grads.items():
        torch.testing.assert_close(sel_grads[n], g, atol=1e-6, rtol=0, msg=n)


def test_fused_attention_without_a_mask_is_not_in_the_core(traced):
    """The package GPT's SDPA (causal, no mask tensor) saves no quadratic tensor, so the
    capture charges nothing for it and selective recompute re-runs nothing."""
    model, graph = traced("gpt-sdpa")
    assert all(b.selective_recompute_flops == 0 and not b.attention_core.ops for b in graph.blocks)
    ids = _ids()
    base_flops, base_ops, _ = _backward(model, ids)
    sel_flops, sel_ops, _ = _backward(_with_ac(model, graph), ids)
    assert sel_flops == base_flops and sel_ops == base_ops


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_gradients_and_step_match_no_recompute(traced, name):
    model, graph = traced(name)
    ids = _ids(3)
    models = [copy.deepcopy(model), _with_ac(model, graph)]
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(2):
            opt.zero_grad()
            _loss(m, _ids(3 + step)).backward()
            opt.step()
    ref, sel = (dict(m.named_parameters()) for m in models)
    assert ref.keys() == {k.replace("._checkpoint_wrapped_module", "") for k in sel}
    for k, p in sel.items():
        q = ref[k.replace("._checkpoint_wrapped_module", "")]
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=k)
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=k)


def test_bf16_autocast_recomputes_the_core_and_its_casts(traced):
    """Autocast adds ``_to_copy`` casts the fp32 capture never saw: they are not counted,
    and the casts of recomputed data are recomputed with it."""
    model, graph = traced("llama")
    ids = _ids()
    base_flops, base_ops, base_grads = _backward(model, ids, autocast=True)
    sel_flops, sel_ops, sel_grads = _backward(_with_ac(model, graph), ids, autocast=True)
    assert sel_flops - base_flops == sum(b.selective_recompute_flops for b in graph.blocks)
    expected = Counter(o.op for b in graph.blocks for o in b.attention_core.ops)
    assert sel_ops - base_ops == expected
    worst = max((sel_grads[n] - g).abs().max().item() for n, g in base_grads.items())
    print("autocast max grad diff", worst)
    for n, g in base_grads.items():
        torch.testing.assert_close(sel_grads[n], g, atol=1e-6, rtol=0, msg=n)


def test_attention_dropout_is_saved_and_gradients_match():
    """With dropout on (CPU's composite: ``bernoulli_`` noise, ``div_``, ``x * noise``) the
    noise is saved, the product with the recomputed probabilities recomputed, and the
    gradients equal those without recompute under the same seed."""
    model = _gpt2(dropout=0.1)
    graph = autoplan.trace(model, seq_len=SEQ, micro_batch=BATCH)
    ids = _ids()
    model.train()
    base_flops, base_ops, base_grads = _backward(model, ids)
    sel_flops, sel_ops, sel_grads = _backward(_with_ac(model, graph), ids)
    assert sel_flops - base_flops == sum(b.selective_recompute_flops for b in graph.blocks)
    # the capture ran dropout as one native_dropout (random: saved, not counted); CPU runs
    # it as noise draws (saved) and one `probs * noise` per block, which follows the
    # recomputed probabilities and is recomputed with them
    core = Counter(o.op for b in graph.blocks for o in b.attention_core.ops)
    assert sel_ops - base_ops == core + Counter({"mul": len(graph.blocks)})
    for n, g in base_grads.items():
        torch.testing.assert_close(sel_grads[n], g, atol=1e-6, rtol=0, msg=n)


def _held_after_forward(model, ids) -> int:
    """Bytes of the storages operators made in the forward that are still alive after it:
    what the backward will read (and the weights' transposes, alike with and without AC)."""
    import gc
    import weakref

    from torch.utils._pytree import tree_leaves
    made: dict[int, tuple] = {}

    class _Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    old = made.get(st._cdata)
                    if old is None or old[0]() is None:   # a freed storage's address reused
                        made[st._cdata] = (weakref.ref(st), st.nbytes())
            return out

    with _Made():
        loss = _loss(model, ids)
    gc.collect()
    held = sum(n for ref, n in made.values() if ref() is not None)
    del loss
    return held


def test_selective_holds_no_recompute_less_the_core():
    """torch's selective checkpoint caches every saved operator's output for the recompute;
    those the backward never reads (the qkv and projection outputs, the residual after the
    MLP) are dropped, so the forward holds exactly what it holds without recompute less what
    the recomputed core makes: per block the softmax probabilities (b a s s, fp32) and the
    attention output's copy the projection saves (b s h).  The old cache held 4 KiB more
    than no recompute on this model instead of 80 KiB less."""
    model = _gpt()
    graph = autoplan.trace(model, seq_len=SEQ, micro_batch=BATCH)
    ids = _ids()
    none = _held_after_forward(model, ids)
    selective = _held_after_forward(_with_ac(model, graph), ids)
    heads, fp32 = 4, 4
    per_block = BATCH * heads * SEQ * SEQ * fp32 + BATCH * SEQ * HIDDEN * fp32
    assert none - selective == len(graph.blocks) * per_block      # 2 x 40 KiB


# ------------------------------------------------------------------ the record
def test_core_is_recorded_per_block_and_round_trips(traced):
    _, graph = traced("llama")
    core = graph.blocks[0].attention_core
    # QK^T, scale, mask, softmax, attention x V; the p=0 dropout and the same-dtype
    # cast dispatch nothing, and the copy QK^T's matmul makes of the rotated queries
    # (a clone, as their layout needs) follows its input instead of being counted
    assert core.nodes == ("matmul", "mul_9", "add_6", "softmax", "to_8", "dropout", "matmul_1")
    assert [o.op for o in core.ops] == ["bmm", "mul", "add", "_softmax", "bmm"]
    assert core.calls["bmm"] == 2
    assert graph.layer("pre").attention_core is None
    assert ModelGraph.from_json(graph.to_json()) == graph


def test_graph_json_without_a_core_still_loads(traced):
    _, graph = traced("gpt")
    data = json.loads(graph.to_json())
    for layer in data["layers"]:
        del layer["attention_core"]
    old = ModelGraph.from_dict(data)
    assert all(b.attention_core is None for b in old.blocks)
    block = old.blocks[0]
    with pytest.raises(ConfigError, match="re-capture"):
        apply_ac(torch.nn.Linear(2, 2), Recompute.SELECTIVE, layer=block)
    bad = json.loads(graph.to_json())
    bad["layers"][1]["attention_core"]["ops"][0]["index"] = 99
    with pytest.raises(RecordError, match="attention_core"):
        ModelGraph.from_dict(bad)


def test_a_block_that_differs_from_its_capture_raises(traced):
    """The eager GPT's core applied to the SDPA GPT: no bmm/_softmax calls to match."""
    _, eager = traced("gpt")
    sdpa_model, _ = traced("gpt-sdpa")
    model = copy.deepcopy(sdpa_model)
    model.blocks[0] = apply_ac(model.blocks[0], Recompute.SELECTIVE, layer=eager.blocks[0])
    with pytest.raises(PlanMismatchError, match=r"blocks\.0.*bmm: captured 2, ran 0"):
        _loss(model, _ids())
    with torch.no_grad():       # no grad, nothing is checkpointed or checked
        _loss(model, _ids())


def test_policy_counts_forward_and_recompute_apart():
    from torch.utils.checkpoint import CheckpointPolicy as P, SelectiveCheckpointContext as Ctx

    core = AttentionCore(nodes=("matmul",), ops=(CoreOp("bmm", 1),), calls={"bmm": 2})
    policy = CorePolicy(core, "b")
    x = torch.ones(1, 2, 2, requires_grad=True)
    bmm = torch.ops.aten.bmm.default
    decisions = [policy(Ctx(is_recompute=r), bmm, x, x) for r in (False, True, False, True)]
    assert decisions == [P.MUST_SAVE, P.MUST_SAVE, P.PREFER_RECOMPUTE, P.PREFER_RECOMPUTE]
    policy.check()
    policy(Ctx(is_recompute=False), bmm, x, x)
    with pytest.raises(PlanMismatchError, match="captured 2, ran 3"):
        policy.check()


# ------------------------------------------------------------ tensor parallelism
def _tp_step(rank: int, world: int, graph_json: str, precision: str) -> dict:
    """One TP x SP step of the tiny Llama without and with selective recompute: per rank,
    what the recompute added (FLOPs, counted operators) and the largest parameter change
    between the two."""
    from autoplan.runtime import parallelize
    from autoplan.strategy import Strategy

    graph = ModelGraph.from_json(graph_json)
    ids = _ids()
    runs = {}
    for mode in ("none", "selective"):
        model = _llama()
        pm = parallelize(model, Strategy(tp=world, sequence_parallel=True, global_batch=BATCH,
                                         micro_batch=BATCH, recompute=mode, precision=precision),
                         seq_len=SEQ, graph=graph,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
        torch.manual_seed(7)
        with FlopCounterMode(display=False) as flops, _Ops() as ops:
            pm.step(ids)
        runs[mode] = (flops.get_total_flops(), ops.ops, pm.full_state_dict())
    (f0, o0, p0), (f1, o1, p1) = runs["none"], runs["selective"]
    diff = max(((p1[k] - v).abs().max().item() for k, v in p0.items()), default=0.0) \
        if p0 is not None else None
    return {"flops": f1 - f0, "ops": dict(o1 - o0), "lost": dict(o0 - o1), "param_diff": diff}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tensor_parallel_recomputes_each_ranks_share_of_the_core(traced, precision):
    """Under TP x SP the attention core runs on each rank's local heads (plain tensors
    after the column-parallel projections): each of the 2 ranks recomputes half the
    charged FLOPs, the same operators, and the step equals the one without recompute."""
    from dist_harness import run

    _, graph = traced("llama")
    results = run(_tp_step, 2, graph.to_json(), precision, timeout=300)
    charged = sum(b.selective_recompute_flops for b in graph.blocks)
    expected = dict(Counter(o.op for b in graph.blocks for o in b.attention_core.ops))
    for r in results:
        assert r["flops"] == charged // 2
        assert r["ops"] == expected and not r["lost"]
    assert results[0]["param_diff"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("shape", ["dict", "list"])
def test_pruning_reads_the_cache_as_either_torch_keeps_it(shape):
    """torch 2.13 keys an operator's cached outputs by call index, torch 2.11 (the lent
    H100's) lists them: either way, an output the backward does not read becomes _Unread
    and one it saved stays."""
    import contextlib
    from types import SimpleNamespace

    from autoplan.runtime.ac import StorageSet, _Checked, _Unread, storage_tensors
    checked = _Checked(core=None, where="block")
    kept_tensor, dropped_tensor = torch.ones(3), torch.zeros(3)
    entries = [SimpleNamespace(val=kept_tensor), SimpleNamespace(val=dropped_tensor)]
    cache = dict(enumerate(entries)) if shape == "dict" else list(entries)
    checked._cache = {"aten.mm": cache}
    checked._saved = StorageSet()
    checked._saved.add(storage_tensors(kept_tensor))
    checked._hooks = contextlib.nullcontext()
    checked.prune(None, None, None)
    assert cache[0] is entries[0]
    assert isinstance(cache[1], _Unread)
