"""Why does the adaptive engine's round cost less than a plain step? Time both on one prompt."""
import sys, time, json
import torch
sys.path.insert(0, "/work/main")
torch.set_num_threads(2)
from dspine_train.engine import Engine
from dspine_train.engine.ngram import NgramConfig
main = Engine.from_pretrained("/work/main/artifacts/default_target", "/work/main/artifacts/demo/draft",
                              device="cpu", dtype=torch.float32, max_batch_size=1)
kw = dict(max_batch_size=1, eos_token_ids=main.eos_token_ids, chat_template_kwargs=main.chat_template_kwargs)
ad = Engine(main.target, main.draft, main.tokenizer, ngram=NgramConfig(), adaptive=True, **kw)
rows = [json.loads(l) for l in open("/work/main/docs/results/ngram_hybrid/compare_few_rows.prompts.jsonl")]
from dspine_train.benchmark_prompts import *  # noqa
prompt = "Explain the difference between a process and a thread in operating systems, with examples."
ids = main.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
for rep in range(2):
    for name, fn in (("ar", lambda: main.generate_ar([ids], max_new_tokens=64, chat=False)),
                     ("adaptive", lambda: ad.generate([ids], max_new_tokens=64, chat=False)),
                     ("ar-on-adaptive-engine", lambda: ad.generate_ar([ids], max_new_tokens=64, chat=False))):
        r = fn(); s = r.stats
        print(f"{name:22s} tokens {s.new_tokens} steps {s.steps} total {s.total_s:.2f}s "
              f"ms/step {1000*s.total_s/max(s.steps,1):.0f} verify_s {s.verify_s:.2f} "
              f"shapes {getattr(s,'round_shapes',None)}", flush=True)
        if name == "ar": base = r.token_ids[0]
        else: print("   same tokens as ar:", r.token_ids[0] == base)
