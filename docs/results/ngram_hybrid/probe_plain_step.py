"""Why an adaptive round can cost less than a plain step: time both on one prompt.

    python docs/results/ngram_hybrid/probe_plain_step.py

Plain decoding (`generate_ar`) and the adaptive hybrid (`ngram=NgramConfig(), adaptive=True`)
of the demo's target and draft, float32, 2 threads, 64 new tokens, interleaved twice; prints
each call's steps, seconds per step, target-forward seconds and round shapes, and whether the
tokens equal plain decoding's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from dspine_train.engine import Engine  # noqa: E402
from dspine_train.engine.ngram import NgramConfig  # noqa: E402

PROMPT = ("Explain the difference between a process and a thread in operating systems, "
          "with examples.")


def main() -> None:
    torch.set_num_threads(2)
    plain = Engine.from_pretrained(REPO / "artifacts/default_target", REPO / "artifacts/demo/draft",
                                   device="cpu", dtype=torch.float32, max_batch_size=1)
    adaptive = Engine(plain.target, plain.draft, plain.tokenizer, ngram=NgramConfig(),
                      adaptive=True, max_batch_size=1, eos_token_ids=plain.eos_token_ids,
                      chat_template_kwargs=plain.chat_template_kwargs)
    ids = plain.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                              add_generation_prompt=True, tokenize=False)
    ids = plain.tokenizer(ids, add_special_tokens=False)["input_ids"]
    runs = (("ar", lambda: plain.generate_ar([ids], max_new_tokens=64, chat=False)),
            ("adaptive", lambda: adaptive.generate([ids], max_new_tokens=64, chat=False)),
            ("ar-on-adaptive-engine",
             lambda: adaptive.generate_ar([ids], max_new_tokens=64, chat=False)))
    for _ in range(2):
        base = None
        for name, run in runs:
            result = run()
            s = result.stats
            print(f"{name:22s} tokens {s.new_tokens} steps {s.steps} total {s.total_s:.2f}s "
                  f"ms/step {1000 * s.total_s / max(s.steps, 1):.0f} verify_s {s.verify_s:.2f} "
                  f"shapes {s.round_shapes}", flush=True)
            if base is None:
                base = result.token_ids[0]
            else:
                print("   same tokens as ar:", result.token_ids[0] == base)


if __name__ == "__main__":
    main()
