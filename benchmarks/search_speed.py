"""Search speed on a 2-core machine (issue: search).

Targets: GPT-3 175B on 1024 A100 (128 nodes of a100-sxm4-80gb) <= 10 s; the 1T row of
the public runs (Narayanan et al. 2021 Table 1, 3072 A100) <= 60 s; Llama-3-70B on the
64 GPUs of mixed-a100-v100 <= 20 s; the mixtures of experts, whose search also chooses
the expert parallel degree, <= 10 s each: Mixtral 8x7B on 64 H100 (global batch 512) and
DeepSeek-V3 671B on 1024 H100 (global batch 8192, as the published Megatron-Bridge H100
run in validation/published_moe.csv).  Each case is searched twice and the two plan
JSONs must be byte-identical.  Capture time is reported apart from search time, and the
search's CPU time beside its wall time (on a shared machine they differ).

    python benchmarks/search_speed.py [case-name-substring ...]
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
    ("mixtral-8x7b @ 64 H100", ("zoo", dict(name="mixtral-8x7b")), 4096,
     ("h100-sxm5-80gb", 8), 512, 10.0),
    ("deepseek-v3 @ 1024 H100", ("zoo", dict(name="deepseek-v3")), 4096,
     ("h100-sxm5-80gb", 128), 8192, 10.0),
]


def _model(kind: str, kw: dict):
    if kind == "zoo":
        from autoplan.zoo import build_model
        return build_model(f"zoo:{kw['name']}")[0]
    import transformers as tf
    cls = {"gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config),
           "llama": (tf.LlamaForCausalLM, tf.LlamaConfig)}[kind]
    with torch.device("meta"):
        return cls[0](cls[1](**kw)).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    wanted = sys.argv[1:] if argv is None else argv
    ok = True
    print(f"{'case':<34} {'capture s':>9} {'search s':>9} {'cpu s':>6} {'target':>7} {'evals':>6} "
          f"{'pruned':>6} {'steps':>6} {'same JSON':>9}  plan")
    for name, (kind, kw), seq, (profile, nodes), gb, target in CASES:
        if wanted and not any(w in name for w in wanted):
            continue
        t0 = time.perf_counter()
        graph = autoplan.trace(_model(kind, kw), seq_len=seq)
        t_capture = time.perf_counter() - t0
        cluster = autoplan.load_cluster(profile, nodes=nodes)
        t1, c1 = time.perf_counter(), time.process_time()
        plan = autoplan.plan(graph, cluster, global_batch=gb)
        t_search, c_search = time.perf_counter() - t1, time.process_time() - c1
        again = autoplan.plan(graph, cluster, global_batch=gb)
        same = plan.to_json() == again.to_json()
        stats = plan.search_stats
        passed = t_search <= target and same
        ok &= passed
        print(f"{name:<34} {t_capture:>9.2f} {t_search:>9.2f} {c_search:>6.2f} {target:>6.0f}s "
              f"{stats.evaluated:>6} {stats.pruned:>6} {stats.steps:>6} {str(same):>9}  "
              f"{'PASS' if passed else 'FAIL'} {plan.summary()}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
