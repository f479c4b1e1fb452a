"""Sampled tau on common draws: every point-mass mode replayed on the same sampled answers.

At temperature > 0 a round whose candidates are point masses accepts a candidate exactly when
it is the token the target draws at that node:
- transformers' prompt lookup compares its candidates with the target's draws;
- the engine's n-gram chain is rejection sampling with q = 1 (a rejected candidate is never
  the drawn token);
- the engine's trees (DSpine tree, hybrid, hybrid tree) descend while a child holds the drawn
  token (`engine.tree_verify.sampled_tree_accept`).

So once an answer is drawn, the target forwards such a mode needs to produce it are fixed. A
mode's candidates depend only on the context (and, for the draft, on the target's features of
it), so *replaying* reproduces them: greedy decoding whose target logits are forced to the
answer (the answer's next token made the argmax at each position, after the real forward, so
the draft still reads the real features) emits the answer, and its rounds are the rounds the
mode would have run had it drawn that answer.

Every mode is lossless, so each logged answer is a draw from the target whichever mode sampled
it. Replaying every mode on every logged answer estimates each mode's sampled tau on *common*
draws: a difference between two modes no longer carries the answer-to-answer variance that
dominates separately drawn runs (one HumanEval prompt took 12 forwards for 64 tokens in one
draw and 47 in another).

Not replayed: the DSpine chain (rejection sampling against the draft's own q: whether a
candidate is kept depends on q and a uniform draw, not on the answer alone), adaptive (its
shapes follow timings) and the plain modes (tau 1).

The check: a mode replayed on the answers it drew itself must need exactly the forwards its
live run logged (`ReplayTotals.self_checks`); the replay is exact only if it does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspine_train.evaluation.block_metrics import ratio_se
from dspine_train.markdown_table import markdown_table
from scripts.tools.bench.hf_reference import Decoded

# the modes whose sampled rounds verify point masses only (module doc)
REPLAYABLE = ("HF prompt lookup", "n-gram", "DSpine tree", "hybrid", "hybrid tree")
FORCE = 1.0e6  # added to the forced token's logit: larger than any real logit gap


class ReplayError(RuntimeError):
    """A replay did not reproduce the answer it was forced to (the replay is not exact)."""


class ForcedAnswer:
    """The next token of each position of one prompt + answer (batch of one): what the forced
    logits make the argmax. Positions past the answer's end are left as the model gives them."""

    def __init__(self) -> None:
        self.next_of: torch.Tensor | None = None

    def set(self, prompt: list[int], answer: list[int], device: torch.device) -> None:
        full = list(prompt) + list(answer)
        self.next_of = torch.tensor(full[1:], dtype=torch.long, device=device)

    def clear(self) -> None:
        self.next_of = None

    def force(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`logits (..., V)` with the answer's token at each of `positions (...)` lifted above
        every other."""
        if self.next_of is None:
            return logits
        inside = positions < self.next_of.shape[0]
        token = self.next_of[positions.clamp(max=self.next_of.shape[0] - 1)]
        lift = torch.zeros_like(logits).scatter_(-1, token[..., None],
                                                 (inside.to(logits.dtype) * FORCE)[..., None])
        return logits + lift


@contextmanager
def forced_engine_target(target: Any, answer: ForcedAnswer) -> Iterator[None]:
    """Force the engine's `TargetModel` logits to `answer` while inside (module doc).

    The forward records each new token's position (`cache.lengths + offset`, or `+ depth` in a
    token tree, as `TargetModel.forward` places them); `logits` lifts the answer's token at
    those positions. A `logits` call on one state per sequence (a prefill's last token) takes
    the last recorded position. Batch of one; eager steps only (a compiled or captured step
    would not see the patch: run on a CPU, or with CUDA graphs off)."""
    forward, logits = target.forward, target.logits
    seen: dict[str, torch.Tensor] = {}

    def recording_forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input_ids.shape[0] != 1:
            raise ReplayError("forced replay decodes one prompt at a time")
        lengths = target.cache.lengths[:1, None]
        depths = kwargs.get("tree_depths")
        offsets = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        seen["positions"] = lengths + (offsets if depths is None else depths)
        return forward(input_ids, *args, **kwargs)

    def forced_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        positions = seen["positions"]
        if hidden.dim() == 2:  # one state per sequence: the last token's
            positions = positions[:, -1]
        elif hidden.shape[:-1] != positions.shape:
            raise ReplayError(f"logits of states {tuple(hidden.shape)} do not line up with the "
                              f"last forward's tokens {tuple(positions.shape)}")
        return answer.force(out, positions)

    target.forward, target.logits = recording_forward, forced_logits
    try:
        yield
    finally:
        del target.forward, target.logits  # the class's methods again


class ForcedAnswerProcessor:
    """A transformers logits processor forcing `answer` after `prompt_len` prompt tokens (the
    HF side of the replay: assisted generation runs it at every candidate position)."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len = prompt_len
        self.answer = list(answer)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        index = input_ids.shape[1] - self.prompt_len
        if index >= len(self.answer):
            return scores
        lifted = scores.clone()
        lifted[:, self.answer[index]] += FORCE
        return lifted


@dataclass
class Answer:
    """One logged sampled answer: which mode drew it, in which round, and what it cost live."""

    bench: str
    prompt: int
    round: int
    drawn_by: str
    decoded: Decoded

    @property
    def key(self) -> str:
        return f"{self.bench}/{self.prompt}/{self.round}/{self.drawn_by}"


def logged_answers(done: dict[tuple[float, int, str, int], dict[str, Decoded]],
                   temperature: float) -> list[Answer]:
    """Every answer the log holds at `temperature`, in log order."""
    out = []
    for (temp, rnd, bench, prompt), modes in done.items():
        if temp != temperature:
            continue
        out += [Answer(bench, prompt, rnd, name, decoded) for name, decoded in modes.items()]
    return out


@dataclass
class ReplayTotals:
    """One (benchmark, mode)'s replays: per prompt [new tokens, forwards] over its answers,
    and the self-check (answers the mode drew itself: replayed forwards equal to live ones)."""

    per_prompt: dict[int, list[int]] = field(default_factory=dict)
    answers: int = 0
    self_checks: int = 0
    self_matches: int = 0

    def add(self, prompt: int, replayed: Decoded, live: Decoded | None) -> None:
        sums = self.per_prompt.setdefault(prompt, [0, 0])
        sums[0] += replayed.verified_tokens
        sums[1] += replayed.verifications
        self.answers += 1
        if live is not None:
            self.self_checks += 1
            self.self_matches += int(live.verifications == replayed.verifications
                                     and live.verified_tokens == replayed.verified_tokens)

    @property
    def tau(self) -> float:
        tokens = sum(t for t, _ in self.per_prompt.values())
        forwards = sum(f for _, f in self.per_prompt.values())
        return tokens / forwards if forwards else 0.0

    def tau_se(self) -> float | None:
        """Clustered by prompt, as the live rows' (`side_by_side.Totals.tau_se`)."""
        return ratio_se([(t, f) for t, f in self.per_prompt.values()])


def paired_difference(a: ReplayTotals, b: ReplayTotals) -> tuple[float, float | None]:
    """tau(a) - tau(b) on the same answers, and its standard error clustered by prompt (the
    delta method on the two ratios: a prompt's contribution is its linearised difference
    (t_a - tau_a f_a) / F_a - (t_b - tau_b f_b) / F_b)."""
    prompts = sorted(set(a.per_prompt) & set(b.per_prompt))
    fa = sum(a.per_prompt[p][1] for p in prompts)
    fb = sum(b.per_prompt[p][1] for p in prompts)
    if not prompts or not fa or not fb:
        return 0.0, None
    ta = sum(a.per_prompt[p][0] for p in prompts) / fa
    tb = sum(b.per_prompt[p][0] for p in prompts) / fb
    if len(prompts) < 2:
        return ta - tb, None
    z = np.array([(a.per_prompt[p][0] - ta * a.per_prompt[p][1]) / fa
                  - (b.per_prompt[p][0] - tb * b.per_prompt[p][1]) / fb for p in prompts])
    n = len(prompts)
    return ta - tb, float(np.sqrt(n / (n - 1) * np.sum(z**2)))


class ReplayLog:
    """Replays appended one JSON line each as they finish (`<log>.replay.jsonl`), so an
    interrupted replay resumes where it stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[tuple[str, str], Decoded] = {}
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                try:
                    row = json.loads(line)
                    self.done[(row["answer"], row["mode"])] = Decoded(**row["replayed"])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ReplayError(f"{path}:{number}: not a replay record ({err}); "
                                      "remove the file to replay again") from err

    def append(self, answer: str, mode: str, replayed: Decoded) -> None:
        self.done[(answer, mode)] = replayed
        with self.path.open("a") as fh:
            fh.write(json.dumps({"answer": answer, "mode": mode,
                                 "replayed": asdict(replayed)}) + "\n")


@dataclass
class ReplayRow:
    """One (benchmark, mode) of the replay table; `vs` is the reference mode of `difference`
    (tau here minus tau there, on the same answers)."""

    bench: str
    mode: str
    answers: int
    prompts: int
    tau: float
    tau_se: float | None
    self_checks: int
    self_matches: int
    vs: str | None = None
    difference: float | None = None
    difference_se: float | None = None


def replay_answers(replayers: dict[str, Any], prompts_of: dict[str, list[list[int]]],
                   answers: list[Answer], log: ReplayLog) -> dict[tuple[str, str], ReplayTotals]:
    """Replay every answer through every mode of `replayers` (name -> (ids, answer) ->
    `Decoded`), reading finished replays from `log` and appending new ones; the totals."""
    totals: dict[tuple[str, str], ReplayTotals] = {}
    todo = sum((a.key, m) not in log.done for a in answers for m in replayers)
    done = 0
    for answer in answers:
        ids = prompts_of[answer.bench][answer.prompt]
        for name, replay in replayers.items():
            got = log.done.get((answer.key, name))
            if got is None:
                got = replay(ids, answer.decoded.tokens)
                if got.tokens != answer.decoded.tokens:
                    raise ReplayError(
                        f"{name} replayed on {answer.key} did not reproduce the answer (first of "
                        f"{len(answer.decoded.tokens)} tokens to differ: "
                        f"{_first_difference(got.tokens, answer.decoded.tokens)})")
                log.append(answer.key, name, got)
                done += 1
                if done % 10 == 0 or done == todo:
                    print(f"replay: {done}/{todo} ({answer.key})", flush=True)
            live = answer.decoded if answer.drawn_by == name else None
            totals.setdefault((answer.bench, name), ReplayTotals()).add(answer.prompt, got, live)
    return totals


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def replay_rows(totals: dict[tuple[str, str], ReplayTotals], benches: list[str],
                modes: list[str], reference: str | None) -> list[ReplayRow]:
    """The table's rows, each mode's tau also as a paired difference from `reference`."""
    rows = []
    for bench in benches:
        for mode in modes:
            t = totals.get((bench, mode))
            if t is None:
                continue
            row = ReplayRow(bench, mode, t.answers, len(t.per_prompt), t.tau, t.tau_se(),
                            t.self_checks, t.self_matches)
            base = totals.get((bench, reference)) if reference else None
            if base is not None and mode != reference:
                row.vs = reference
                row.difference, row.difference_se = paired_difference(t, base)
            rows.append(row)
    return rows


def replay_table(rows: list[ReplayRow]) -> str:
    """`rows` as a markdown table."""
    def num(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    header = ["benchmark", "mode", "answers", "tau replayed", "SE", "minus", "difference", "SE",
              "self-check"]
    cells = []
    for r in rows:
        check = f"{r.self_matches}/{r.self_checks}" if r.self_checks else "-"
        cells.append([r.bench, r.mode, str(r.answers), f"{r.tau:.2f}", num(r.tau_se),
                      r.vs or "-", num(r.difference, "+.2f"), num(r.difference_se), check])
    return "\n".join(markdown_table(header, cells, align="llrrrlrrl"))
