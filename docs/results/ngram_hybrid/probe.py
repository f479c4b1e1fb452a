"""The n-gram mode with adaptive round shapes vs plain decoding, prompt by prompt.

    python docs/results/ngram_hybrid/probe.py humaneval 4

Prints the measured round costs, one row per prompt (plain seconds, n-gram seconds, tau, equal
outputs, rounds per shape, host seconds finding candidates) and the totals.
"""

import sys

import torch

from data_prep.benchmarks import load_benchmark_prompts
from dspine_train.engine import Engine
from dspine_train.engine.ngram import NgramConfig

name, count = sys.argv[1], int(sys.argv[2])
prompts = [m[-1]["content"] for m in load_benchmark_prompts(name, limit=count)]
target = "artifacts/default_target"
plain = Engine.from_pretrained(target, None, dtype=torch.float32, max_batch_size=1,
                               max_seq_len=2048)
ngram = Engine.from_pretrained(target, None, dtype=torch.float32, max_batch_size=1,
                               max_seq_len=2048, ngram=NgramConfig(), adaptive=True)
ngram.warmup(batch_sizes=[1])
print("costs", ngram._costs)
rows = []
for prompt in prompts:
    a = plain.generate_ar([prompt], max_new_tokens=64)
    b = ngram.generate([prompt], max_new_tokens=64)
    rows.append((a.stats.total_s, b.stats.total_s, b.stats.tau, a.token_ids == b.token_ids,
                 b.stats.round_shapes, b.stats.ngram_s))
    print(rows[-1], flush=True)
speedup = sum(r[0] for r in rows) / sum(r[1] for r in rows)
print(name, "speedup", speedup, "tau", sum(r[2] for r in rows) / len(rows),
      "lossless", all(r[3] for r in rows))
