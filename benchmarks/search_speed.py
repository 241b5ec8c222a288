"""Search speed on a 2-core machine (issue: search).

Targets: GPT-3 175B on 1024 A100 (128 nodes of a100-sxm4-80gb) <= 10 s; the 1T row of
the public runs (Narayanan et al. 2021 Table 1, 3072 A100) <= 60 s; Llama-3-70B on the
64 GPUs of mixed-a100-v100 <= 20 s.  Each case is searched twice and the two plan JSONs
must be byte-identical.  Capture time is reported apart from search time.

    python benchmarks/search_speed.py
"""

from __future__ import annotations

import sys
import time

import torch

import autoplan

CASES = [
    # name, model config (HF type, kwargs), seq, cluster (profile, nodes), global batch, target s
    ("gpt3-175b @ 1024 A100", ("gpt2", dict(n_embd=12288, n_layer=96, n_head=96, n_inner=49152,
                                            vocab_size=51200, n_positions=2048)), 2048,
     ("a100-sxm4-80gb", 128), 1536, 10.0),
    ("gpt-1T @ 3072 A100", ("gpt2", dict(n_embd=25600, n_layer=128, n_head=160, n_inner=102400,
                                         vocab_size=51200, n_positions=2048)), 2048,
     ("a100-sxm4-80gb", 384), 3072, 60.0),
    ("llama3-70b @ 64 mixed A100+V100", ("llama", dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256)), 4096, ("mixed-a100-v100", None), 256, 20.0),
]


def _model(kind: str, kw: dict):
    import transformers as tf
    cls = {"gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config),
           "llama": (tf.LlamaForCausalLM, tf.LlamaConfig)}[kind]
    with torch.device("meta"):
        return cls[0](cls[1](**kw)).to(torch.bfloat16)


def main() -> int:
    ok = True
    print(f"{'case':<34} {'capture s':>9} {'search s':>9} {'target':>7} {'evals':>6} "
          f"{'pruned':>6} {'same JSON':>9}  plan")
    for name, (kind, kw), seq, (profile, nodes), gb, target in CASES:
        t0 = time.perf_counter()
        graph = autoplan.trace(_model(kind, kw), seq_len=seq)
        t_capture = time.perf_counter() - t0
        cluster = autoplan.load_cluster(profile, nodes=nodes)
        t1 = time.perf_counter()
        plan = autoplan.plan(graph, cluster, global_batch=gb)
        t_search = time.perf_counter() - t1
        again = autoplan.plan(graph, cluster, global_batch=gb)
        same = plan.to_json() == again.to_json()
        stats = plan.search_stats
        passed = t_search <= target and same
        ok &= passed
        print(f"{name:<34} {t_capture:>9.2f} {t_search:>9.2f} {target:>6.0f}s {stats.evaluated:>6} "
              f"{stats.pruned:>6} {str(same):>9}  {'PASS' if passed else 'FAIL'} {plan.summary()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
