"""Capture speed and memory on meta-device models (issue: capture).

Targets (2-core machine): a Llama-3-70B-shaped model at sequence 4096 and a
GPT-3-175B-shaped model captured in <= 10 s wall and <= 2 GiB peak RSS each.
Each model runs in a fresh process so that peak RSS is its own.

    python benchmarks/capture.py
"""

from __future__ import annotations

import json
import subprocess
import sys

TARGET_S = 10.0
TARGET_RSS_GIB = 2.0

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers as tf
import autoplan
t_import = time.perf_counter() - t0
name = sys.argv[1]
with torch.device("meta"):
    if name == "llama3-70b":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
            torch_dtype=torch.bfloat16)).to(torch.bfloat16)
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=12288, n_layer=96, n_head=96, n_inner=4 * 12288, vocab_size=50257,
            n_positions=2048)).to(torch.bfloat16)
seq = 4096 if name == "llama3-70b" else 2048
t1 = time.perf_counter()
g = autoplan.trace(model, seq_len=seq)
t_trace = time.perf_counter() - t1
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
real = sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta)
print(json.dumps({"model": name, "seq_len": seq, "params": g.num_params, "layers": len(g.layers),
                  "templates": len(g.templates), "trace_s": t_trace, "import_s": t_import,
                  "total_s": time.perf_counter() - t0, "peak_rss_bytes": rss, "real_param_bytes": real,
                  "fwd_tflop_per_seq": g.fwd_flops / 1e12}))
"""


def main() -> int:
    ok = True
    print(f"{'model':<12} {'params':>10} {'layers':>6} {'trace s':>8} {'total s':>8} "
          f"{'peak RSS GiB':>12}  target: <= {TARGET_S:.0f} s, <= {TARGET_RSS_GIB:.0f} GiB")
    for name in ("llama3-70b", "gpt3-175b"):
        out = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True,
                             check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:])
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rss = r["peak_rss_bytes"] / 2**30
        passed = r["total_s"] <= TARGET_S and rss <= TARGET_RSS_GIB and r["real_param_bytes"] == 0
        ok &= passed
        print(f"{name:<12} {r['params'] / 1e9:>9.1f}B {r['layers']:>6} {r['trace_s']:>8.2f} "
              f"{r['total_s']:>8.2f} {rss:>12.2f}  {'PASS' if passed else 'FAIL'} "
              f"(import {r['import_s']:.1f} s, {r['templates']} templates, real param bytes "
              f"{r['real_param_bytes']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
