"""Replay the adaptive n-gram planner offline on the logged greedy outputs (no model runs).

    python docs/results/ngram_hybrid/replay.py docs/results/ngram_hybrid/compare_full.prompts.jsonl

At T=0 every mode's output is plain decoding's, so each round can be replayed from the log:
the n-gram proposal at each position (`NgramIndex`), how many of its tokens the target takes
(the common prefix with the logged continuation), the shape `RoundPlanner` picks, and the
proposal scored by `ProposalLedger` as the engine does. Time is counted with per-shape round
costs; the memory persists across prompts in the benchmark's order, as in the engine. Prints
speed-up over plain decoding and tau per benchmark for: the configured n-gram engine, the
adaptive planner with the costs measured at warmup (context 1) and with the costs the run
really paid (`paid_costs`: fitted to the logged seconds of plain decoding and of the n-gram
mode), and an oracle that knows each round's acceptance (an upper bound for any rule choosing
among these shapes).
"""

import json
import sys
import types

from transformers import AutoTokenizer

from data_prep.benchmarks import load_benchmark
from dspine_train.engine import round_planner as rp
from dspine_train.engine.ngram import NgramConfig, NgramIndex
from dspine_train.engine.round_results import ProposalLedger
from dspine_train.evaluation.harness import encode_messages

# Engine.calibrate's figures on this machine (2026-12-04, 2 threads, demo target, fp32).
WARMUP = {"plain": 0.1294, "ngram1": 0.2698, "ngram2": 0.3761, "ngram3": 0.3542,
          "ngram4": 0.3444, "ngram5": 0.3341, "ngram6": 0.364, "ngram7": 0.3243}


def read_log(path):
    lines = [json.loads(line) for line in open(path)]
    settings = lines[0]["settings"]
    rows = [(r["bench"], r["prompt"], r["modes"]) for r in lines[1:]
            if "modes" in r and r["temperature"] == 0]
    tokenizer = AutoTokenizer.from_pretrained(settings["target"])
    ids = {name: encode_messages(tokenizer, load_benchmark(name, limit=n).prompts, None)
           for name, n in settings["benchmarks"].items()}
    return rows, ids


def paid_costs(rows, ids):
    """Seconds per round the run paid: plain decoding's from the log; each n-gram width's
    warmup figure times the one factor that makes the configured n-gram engine's replayed
    time equal to the n-gram mode's logged seconds (both at the paid plain step)."""
    plain = sum(m["engine plain"]["seconds"] for _, _, m in rows) / sum(
        m["engine plain"]["verifications"] for _, _, m in rows)
    logged = sum(m["n-gram"]["seconds"] for _, _, m in rows)

    def costs(scale):
        return {k: plain if k == "plain" else v * scale for k, v in WARMUP.items()}

    base = replay(rows, ids, costs(1.0), costs(0.0), adaptive=False, raw=True)
    unit = replay(rows, ids, costs(1.0), costs(1.0), adaptive=False, raw=True)
    return costs((logged - base) / (unit - base))


def replay(rows, ids, plan_costs, paid, adaptive=True, oracle=False, raw=False):
    shapes = rp.round_shapes(list(range(1, 8)), 0, None)
    memory, totals = rp.PlannerMemory(), {}
    for bench, prompt, modes in rows:
        truth = modes["engine plain"]["tokens"]
        planner = rp.RoundPlanner(shapes, rp.RoundCosts(plan_costs, 1), adaptive, memory)
        ledger = ProposalLedger(planner, 1)
        state = types.SimpleNamespace(tokens=truth[:1], done=False)
        index = NgramIndex(NgramConfig(), ids[bench][prompt] + state.tokens)
        seconds = rounds = 0
        while len(state.tokens) < len(truth):
            proposal, size = index.propose()
            at = len(state.tokens)
            if oracle:
                shape = max(shapes, key=lambda s, p=proposal, rest=truth[at:]: (
                    1 + rp.common_prefix(p[:s.nodes if s.ngram else 0], rest)) / paid[s.key])
            else:
                shape = planner.choose([size], [len(proposal)])
            width = shape.nodes if shape.ngram else 0
            new = truth[at: at + rp.common_prefix(proposal[:width], truth[at:]) + 1]
            seconds, rounds = seconds + paid[shape.key], rounds + 1
            state.tokens = state.tokens + new
            state.done = len(state.tokens) >= len(truth)
            if size > 0:
                ledger.propose(0, at, "ngram", size, proposal)
            ledger.settle(0, state)
            index.extend(new)
        t = totals.setdefault(bench, [0.0, 0.0, 0, 0])
        t[0] += paid["plain"] * (len(truth) - 1)
        t[1] += seconds
        t[2] += len(truth) - 1
        t[3] += rounds
    if raw:  # the replayed seconds, all benchmarks together
        return sum(t[1] for t in totals.values())
    return {b: f"{t[0] / t[1]:.2f}x plain, tau {t[2] / t[3]:.2f}" for b, t in totals.items()}


if __name__ == "__main__":
    rows, ids = read_log(sys.argv[1])
    paid = paid_costs(rows, ids)
    print("paid seconds per round:", {k: round(v, 3) for k, v in paid.items()})
    print("n-gram, configured:           ", replay(rows, ids, paid, paid, adaptive=False))
    print("adaptive, warmup costs:       ", replay(rows, ids, WARMUP, paid))
    print("adaptive, paid costs:         ", replay(rows, ids, paid, paid))
    print("oracle (knows the acceptance):", replay(rows, ids, paid, paid, oracle=True))
