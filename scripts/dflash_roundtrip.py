"""Round trip of a DFlash draft through z-lab's reference client (`dflash`) on a real target.

    python scripts/dflash_roundtrip.py [--target artifacts/default_target] [--draft DIR]
        [--max-new-tokens 32] [--out docs/results/dflash_roundtrip]

The draft (`--draft`: a `method: dflash` export in either format; default: an untrained
`method: dflash` draft made for the target, which checks the formats and the network but says
nothing about acceptance) is exported with `--format dflash`, loaded with
`dflash.DFlashDraftModel.from_pretrained`, and compared with ours: missing/unexpected weights,
the largest logit difference on each prompt's first block, whether `spec_generate` and our
engine both reproduce the target's greedy output, and whether they draft the same tokens in
every full-block round (so accept the same ones). fp32 on CPU. Writes `results.json` and
`results.md` under `--out`. Needs `pip install --no-deps dflash==0.1.0` (`make install` does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspine_train.checkpoint_io import write_json_atomic, write_text_atomic  # noqa: E402
from dspine_train.engine import Engine  # noqa: E402
from dspine_train.formats import export_dir, load_draft  # noqa: E402
from dspine_train.markdown_table import markdown_table  # noqa: E402
from dspine_train.modeling import DSpineConfig, DSpineDraftModel  # noqa: E402
from scripts.tools.bench.reference_parity import (  # noqa: E402
    compare_rounds,
    our_block_logits,
    record_engine_rounds,
    record_reference_rounds,
    reference_block_logits,
)

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "def quicksort(xs):",
]


def main(argv: list[str] | None = None) -> int:
    """Run the round trip; returns the exit status (1 when any check fails)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "artifacts" / "default_target"))
    parser.add_argument("--draft", default=None, help="a method: dflash draft (either format)")
    parser.add_argument("--num-layers", type=int, default=2, help="untrained draft's depth")
    parser.add_argument("--block-size", type=int, default=16, help="untrained draft's block")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "docs" / "results" / "dflash_roundtrip"))
    args = parser.parse_args(argv)
    from dflash.model import DFlashDraftModel  # the reference client, a test/script dependency

    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.draft) if args.draft else Path(tmp) / "ours"
        if not args.draft:
            config = DSpineConfig.from_target(target.config, tokenizer, method="dflash",
                                              num_layers=args.num_layers,
                                              block_size=args.block_size)
            DSpineDraftModel(config).save_pretrained(source)
        exported = export_dir(source, Path(tmp) / "dflash", "dflash")
        theirs, info = DFlashDraftModel.from_pretrained(str(exported), output_loading_info=True)
        theirs.eval()
        ours = load_draft(source).float().eval()
        ours.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
        engine = Engine.from_pretrained(args.target, source, dtype=torch.float32,
                                        max_batch_size=1, eos_token_ids=[],
                                        max_seq_len=256 + args.max_new_tokens)
        rows = []
        for text in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            with torch.no_grad():
                out = target(torch.tensor([ids]), output_hidden_states=True)
                greedy = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
            greedy = greedy[0, len(ids):].tolist()
            feats = torch.cat([out.hidden_states[i + 1][0] for i in ours.config.target_layer_ids],
                              dim=-1)
            anchor = greedy[0]
            diff = (our_block_logits(ours, feats, anchor)
                    - reference_block_logits(theirs, target, feats, anchor)).abs().max().item()
            model = DFlashDraftModel.from_pretrained(str(exported)).eval()
            ref_rounds = record_reference_rounds(model)
            spec = model.spec_generate(target, torch.tensor([ids]),
                                       max_new_tokens=args.max_new_tokens, stop_token_ids=None)
            our_rounds = record_engine_rounds(engine)
            result = engine.generate([ids], max_new_tokens=args.max_new_tokens, chat=False)
            rounds = compare_rounds(ref_rounds, our_rounds, ours.config.block_size, ids + greedy)
            rows.append({
                "prompt": text, "prompt_tokens": len(ids),
                "max_abs_logit_diff": diff,
                "reference_equals_greedy": spec[0, len(ids):].tolist() == greedy,
                "engine_equals_greedy": result.token_ids[0] == greedy,
                "full_block_rounds": rounds.compared,
                "same_drafts_and_acceptance": rounds.same,
                "accepted_drafts": rounds.accepted,
                "engine_tau": result.stats.tau,
            })
            print(json.dumps(rows[-1]))
    summary = {
        "target": Path(args.target).name,
        "draft": Path(args.draft).name if args.draft else
        f"untrained method: dflash draft ({args.num_layers} layers, block {args.block_size})",
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "max_new_tokens": args.max_new_tokens,
        "prompts": rows,
    }
    ok = not summary["missing_keys"] and not summary["unexpected_keys"] and all(
        r["reference_equals_greedy"] and r["engine_equals_greedy"]
        and r["same_drafts_and_acceptance"] for r in rows)
    summary["all_checks_pass"] = ok
    out = Path(args.out)
    write_json_atomic(out / "results.json", summary)
    lines = [f"# DFlash round trip: {summary['target']}, {summary['draft']}", "",
             f"Missing / unexpected weights in `DFlashDraftModel.from_pretrained`: "
             f"{len(summary['missing_keys'])} / {len(summary['unexpected_keys'])}.", ""]
    lines += markdown_table(
        ["prompt", "max abs logit diff", "reference = greedy", "engine = greedy",
         "full-block rounds", "same drafts", "accepted drafts"],
        [(r["prompt"][:40], f"{r['max_abs_logit_diff']:.1e}", r["reference_equals_greedy"],
          r["engine_equals_greedy"], r["full_block_rounds"], r["same_drafts_and_acceptance"],
          r["accepted_drafts"]) for r in rows])
    write_text_atomic(out / "results.md", "\n".join(lines) + "\n")
    print(f"{'all checks pass' if ok else 'CHECKS FAILED'}; wrote {out}/results.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
