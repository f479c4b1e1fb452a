"""Served acceptance against trained acceptance, block by block (the parity check).

The trainer's simulated evaluation (`evaluation.held_out`, run by `DraftStep` with
`evaluate=True`) and the engine (`engine.Engine` at temperature 0) must accept the same drafts
when they see the same block: the same prefix, the same anchor, the same draft. This module
runs both on the same rows and lines them up:

* the engine decodes each row's prompt greedily and records, round by round, how many drafts
  the target accepted (`GenerationStats.round_accepted`); round r's anchor is the token
  `prompt_len + sum(accepted before r) + (r - 1)` of the teacher-forced row prompt + output;
* the simulated evaluation runs on that teacher-forced row at exactly those anchors
  (`DraftStep.accepted_prefixes`), with the target's features from the training path
  (`training.target.TargetFeatureExtractor` on the Hugging Face model).

With no train/serve mismatch both agree on every block, except where a block runs past the
row's end: the target may accept drafts after the EOS or the token budget (they are in
`round_accepted`, though the engine's tau counts only the tokens kept), the simulation has no
supervised slot there. The paired comparison therefore clips the engine's count to the slots
the row holds (`room`).

Besides the paired figures it reports the trainer's own figure on the same rows (every valid
anchor of the responses, as `sample_anchors` draws them), so a gap between "trainer" and
"engine" splits into the anchor distribution (which positions are measured: the window) and a
mismatch (the paired difference). When the dataset rows are given, it also says whether the
engine reproduced each response (a response that is not the target's greedy output makes the
trainer's figure on the dataset rows incomparable) and the trainer's figure on those rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..markdown_table import markdown_table
from ..training.draft_step import DraftStep
from ..training.target import TargetFeatureExtractor, TargetFeatures

if TYPE_CHECKING:  # annotations only; the engine is loaded where one is built (`load_parity_pair`)
    from ..engine import Engine

FeatureFn = Callable[[torch.Tensor], TargetFeatures]
# the target's next-token logits after a sequence of ids (one unpadded row)
NextLogitsFn = Callable[[list[int]], torch.Tensor]
# A response that leaves the engine's greedy output where the target's two candidates are
# within this many logits of each other left it on numerics (batched vs one-row decoding in
# the same dtype flips such near-ties), not on a setup error; bf16 answers miss by ~0.1.
NEAR_TIE_LOGITS = 0.01


# ---------------------------------------------------------------------------------- figures
@dataclass
class Figure:
    """Acceptance over a set of blocks: tau and the per-position rates, each with its SE.

    per_position[k-1] is the share of blocks whose first k drafts were all accepted. SEs treat
    blocks as independent (blocks of one row are correlated, so they are a lower bound).
    """

    name: str
    blocks: int
    tau: float
    tau_se: float
    per_position: list[float]
    per_position_se: list[float]


def acceptance_figure(name: str, accepted: Sequence[int], width: int) -> Figure:
    """`Figure` of blocks that accepted `accepted[i]` drafts each (0..width)."""
    n = len(accepted)
    if n == 0:
        return Figure(name, 0, float("nan"), float("nan"), [float("nan")] * width,
                      [float("nan")] * width)
    values = torch.tensor(accepted, dtype=torch.float64)
    rates, ses = [], []
    for k in range(1, width + 1):
        p = float((values >= k).double().mean())
        rates.append(p)
        ses.append(math.sqrt(p * (1 - p) / n))
    return Figure(name, n, 1.0 + float(values.mean()), _se(values), rates, ses)


def _se(values: torch.Tensor) -> float:
    n = values.numel()
    return float(values.std(unbiased=True) / math.sqrt(n)) if n > 1 else 0.0


# ---------------------------------------------------------------------------------- rows
@dataclass
class ParityRow:
    """One row: the engine's rounds and the simulation at the same anchors.

    anchors: position of each round's anchor in the teacher-forced row (prompt + output);
    engine: drafts the engine accepted per round; simulated: drafts the simulated evaluation
    accepts at the same anchor; room: supervised slots the row holds after each anchor (the
    simulation cannot accept beyond it). reproduces_row: whether the engine's output equals
    the dataset row's response (None when no dataset row was given); first_divergence: the
    first new token where they differ; divergence_margin: there, the target's logit of the
    engine's token minus that of the response's (None unless measured); same_text: whether
    the two decode to the same text (one a prefix of the other, as the token budget ends them
    apart): the response is the engine's output stored as text and re-tokenized into another
    split (None unless checked).
    """

    row_id: str
    prompt_len: int
    new_tokens: int
    anchors: list[int]
    engine: list[int]
    simulated: list[int]
    room: list[int]
    reproduces_row: bool | None = None
    first_divergence: int | None = None
    divergence_margin: float | None = None
    same_text: bool | None = None

    @property
    def near_tie(self) -> bool:
        """The response left the engine's output at a near-tie of the target (numerics)."""
        return self.divergence_margin is not None and abs(self.divergence_margin) < NEAR_TIE_LOGITS

    def mismatched_rounds(self) -> list[int]:
        """Rounds where the clipped engine count differs from the simulated one."""
        return [r for r, (e, s, room) in enumerate(zip(self.engine, self.simulated, self.room))
                if min(e, room) != s]


def round_anchors(prompt_len: int, accepted: Sequence[int]) -> list[int]:
    """Anchor positions of the engine's rounds: the first new token sits at `prompt_len`, and
    each round commits its accepted drafts plus one bonus token (the next anchor)."""
    anchors, position = [], prompt_len
    for count in accepted:
        anchors.append(position)
        position += count + 1
    return anchors


def simulated_walk(counts: dict[int, int], start: int, length: int) -> list[int]:
    """The engine's rounds replayed on the simulated evaluation of every anchor of a row.

    `counts[a]` is the simulated acceptance at anchor a; the walk starts at the first new
    token (`start`) and moves by accepted + 1 as the engine does, until the row's last token
    (which no block follows) or an anchor without a count. With parity this is the engine's
    own sequence of rounds (clipped at the row's end), from the trainer's evaluation alone.
    """
    out, anchor = [], start
    while anchor < length - 1 and anchor in counts:
        out.append(counts[anchor])
        anchor += counts[anchor] + 1
    return out


def valid_anchors(loss_mask: Sequence[int]) -> list[int]:
    """Every anchor the trainer may draw (`objective.sample_anchors`): loss_mask[a] and
    loss_mask[a + 1] both 1."""
    return [a for a in range(len(loss_mask) - 1) if loss_mask[a] and loss_mask[a + 1]]


@torch.no_grad()
def simulated_accepted(step: DraftStep, features: FeatureFn, input_ids: Sequence[int],
                       loss_mask: Sequence[int], anchors: Sequence[int],
                       anchors_per_forward: int = 64) -> list[int]:
    """Drafts the trainer's simulated evaluation accepts at each anchor of one row.

    The target runs once; the draft's training forward takes `anchors_per_forward` blocks at a
    time (the dense CPU attention mask grows with blocks x row length).
    """
    if not anchors:
        return []
    device = step.draft.fc.weight.device
    ids = torch.tensor([list(input_ids)], device=device)
    mask = torch.tensor([list(loss_mask)], device=device)
    feats = features(ids)
    counts: list[int] = []
    for start in range(0, len(anchors), anchors_per_forward):
        anchor_t = torch.tensor([list(anchors[start:start + anchors_per_forward])], device=device)
        prefix = step.accepted_prefixes(ids, feats.context, feats.final_hidden, mask, anchor_t,
                                        torch.ones_like(anchor_t, dtype=torch.bool))
        counts += prefix.sum(-1).long().tolist()
    return counts


def extractor_features(hf_target: torch.nn.Module, layer_ids: Sequence[int]) -> FeatureFn:
    """The training path's features (`TargetFeatureExtractor`) of one unpadded row."""
    extractor = TargetFeatureExtractor(hf_target, list(layer_ids))
    return lambda ids: extractor(ids, torch.ones_like(ids))


# ---------------------------------------------------------------------------------- report
@dataclass
class ParityReport:
    """The side-by-side figures, the paired difference and the rows behind them.

    engine: the engine's rounds as it counts them; simulated_same_anchors: the simulation at
    the engine's anchors; simulated_all_anchors: the trainer's figure on the teacher-forced
    rows (every valid anchor); simulated_walk: the engine's rounds replayed on those per-anchor
    results (`simulated_walk`; no engine needed, equal to the engine's rounds with parity);
    simulated_dataset_rows: the trainer's figure on the dataset rows
    themselves (None without them). difference: mean over rounds of (engine clipped to the row)
    - (simulated), with its SE; per_position_difference likewise per position.
    """

    block_size: int
    num_draft_tokens: int
    engine: Figure
    simulated_same_anchors: Figure
    simulated_all_anchors: Figure
    simulated_walk: Figure
    simulated_dataset_rows: Figure | None
    difference: float
    difference_se: float
    per_position_difference: list[float]
    per_position_difference_se: list[float]
    mismatched_rounds: int
    clipped_rounds: int
    rows: list[ParityRow]
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    def markdown(self) -> str:
        """Tables: tau and per-position acceptance of each figure, then the paired difference."""
        figures = [self.engine, self.simulated_same_anchors, self.simulated_walk,
                   self.simulated_all_anchors]
        if self.simulated_dataset_rows is not None:
            figures.append(self.simulated_dataset_rows)
        width = self.num_draft_tokens
        rows = [[fig.name, fig.blocks, f"{fig.tau:.3f} ± {fig.tau_se:.3f}",
                 *(f"{p:.3f} ± {s:.3f}" for p, s in zip(fig.per_position, fig.per_position_se))]
                for fig in figures]
        rows.append(["paired difference (engine - simulated, same anchors)", self.engine.blocks,
                     f"{self.difference:+.3f} ± {self.difference_se:.3f}",
                     *(f"{d:+.3f} ± {s:.3f}" for d, s in
                       zip(self.per_position_difference, self.per_position_difference_se))])
        lines = ["#### Parity: engine vs the trainer's simulated evaluation (T=0)", "",
                 *markdown_table(["figure", "blocks", "tau ± SE",
                                  *(f"k={k}" for k in range(1, width + 1))], rows,
                                 align="lrr" + "r" * width)]
        reproduced = [r.reproduces_row for r in self.rows if r.reproduces_row is not None]
        lines += ["", f"rounds: {self.engine.blocks}; differing on the same anchor: "
                      f"{self.mismatched_rounds}; past the row's end (engine count clipped): "
                      f"{self.clipped_rounds}"]
        if reproduced:
            ties = [r for r in self.rows if r.reproduces_row is False and r.near_tie]
            split = [r.row_id for r in self.rows if r.reproduces_row is False and r.same_text]
            lines.append(f"rows whose response the engine reproduced: {sum(reproduced)} of "
                         f"{len(reproduced)}" + (
                             f"; {len(ties)} left it at a near-tie of the target (logit margin "
                             f"< {NEAR_TIE_LOGITS:g}: {', '.join(_tie(r) for r in ties)}), the "
                             "numerics of batched decoding, not a setup error" if ties else "")
                         + (f"; {len(split)} {'holds' if len(split) == 1 else 'hold'} the "
                            f"engine's text split into other tokens ({', '.join(split)}): "
                            "answers are stored as text and re-tokenized" if split else ""))
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"


def build_report(rows: list[ParityRow], block_size: int, num_draft_tokens: int,
                 all_anchor_counts: Sequence[int], walk_counts: Sequence[int],
                 dataset_counts: Sequence[int] | None = None) -> ParityReport:
    """Figures, paired differences and warnings of `rows` (see `ParityReport`)."""
    width = num_draft_tokens
    engine = [e for r in rows for e in r.engine]
    clipped = [min(e, room) for r in rows for e, room in zip(r.engine, r.room)]
    simulated = [s for r in rows for s in r.simulated]
    diff = torch.tensor(clipped, dtype=torch.float64) - torch.tensor(simulated, dtype=torch.float64)
    per_diff, per_se = [], []
    for k in range(1, width + 1):
        d = (torch.tensor([c >= k for c in clipped], dtype=torch.float64)
             - torch.tensor([s >= k for s in simulated], dtype=torch.float64))
        per_diff.append(float(d.mean()) if d.numel() else float("nan"))
        per_se.append(_se(d) if d.numel() else float("nan"))
    report = ParityReport(
        block_size=block_size, num_draft_tokens=width,
        engine=acceptance_figure("engine (its rounds)", engine, width),
        simulated_same_anchors=acceptance_figure("simulated, same anchors", simulated, width),
        simulated_all_anchors=acceptance_figure("simulated, every anchor (trainer)",
                                                all_anchor_counts, width),
        simulated_walk=acceptance_figure("simulated, engine's walk", walk_counts, width),
        simulated_dataset_rows=None if dataset_counts is None else acceptance_figure(
            "simulated, dataset rows (trainer)", dataset_counts, width),
        difference=float(diff.mean()) if diff.numel() else float("nan"),
        difference_se=_se(diff) if diff.numel() else float("nan"),
        per_position_difference=per_diff, per_position_difference_se=per_se,
        mismatched_rounds=sum(len(r.mismatched_rounds()) for r in rows),
        clipped_rounds=sum(e > room for r in rows for e, room in zip(r.engine, r.room)),
        rows=rows,
    )
    report.warnings = parity_warnings(report)
    return report


def _differs(a: Figure, b: Figure) -> bool:
    """tau differs by more than 2 SE (independent samples)."""
    se = math.sqrt(a.tau_se ** 2 + b.tau_se ** 2)
    return abs(a.tau - b.tau) > 2 * se


def _tie(row: ParityRow) -> str:
    return f"{row.row_id} token {row.first_divergence}, margin {row.divergence_margin:.2g}"


def parity_warnings(report: ParityReport) -> list[str]:
    """What a user must know: a mismatch on the same blocks, or figures that differ > 2 SE."""
    out = []
    if report.mismatched_rounds:
        out.append(
            f"on {report.mismatched_rounds} of {report.engine.blocks} rounds the engine and the "
            f"simulated evaluation accept a different number of drafts on the same block "
            f"(paired tau difference {report.difference:+.3f} ± {report.difference_se:.3f}): "
            "the draft sees something else when served than when evaluated in training "
            "(features, positions, mask id, dtype), or the two targets' greedy tokens differ")
    if _differs(report.engine, report.simulated_all_anchors):
        out.append(
            f"engine tau {report.engine.tau:.3f} ± {report.engine.tau_se:.3f} and the trainer's "
            f"simulated tau over every anchor {report.simulated_all_anchors.tau:.3f} ± "
            f"{report.simulated_all_anchors.tau_se:.3f} differ by more than 2 SE: the engine's "
            "rounds land on other positions than uniformly drawn anchors (rounds crowd where "
            "acceptance is low; compare the simulated engine's walk "
            f"{report.simulated_walk.tau:.3f})")
    dataset = report.simulated_dataset_rows
    if dataset is not None and _differs(dataset, report.simulated_all_anchors):
        out.append(
            f"the trainer's tau on the dataset rows {dataset.tau:.3f} and on the engine's own "
            f"responses {report.simulated_all_anchors.tau:.3f} differ by more than 2 SE: the "
            "dataset responses are not the target's greedy output on these prompts")
    missed = [r.row_id for r in report.rows
              if r.reproduces_row is False and not r.near_tie and not r.same_text]
    if missed:
        out.append(f"{len(missed)} of {len(report.rows)} rows' responses are not what the "
                   f"engine generates greedily (first: {missed[0]}): regenerated with sampling, "
                   "another chat template, or other numerics")
    return out


# ---------------------------------------------------------------------------------- running
@dataclass
class ParityRowInput:
    """One row to check: its prompt ids and, optionally, the dataset's response ids."""

    row_id: str
    prompt: list[int]
    response: list[int] | None = None


def rows_from_dataset(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                      row_ids: Sequence[str] | None = None) -> list[ParityRowInput]:
    """Split tokenised rows into prompt (before the first supervised token) and response (the
    first supervised run: the first assistant turn and its end-of-turn token)."""
    rows = []
    for index, (ids, mask) in enumerate(zip(input_ids, loss_masks)):
        ids, mask = list(ids), list(mask)
        if 1 not in mask:
            continue
        start = mask.index(1)
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        if start == 0:
            continue  # no prompt to serve
        name = str(row_ids[index]) if row_ids is not None else str(index)
        rows.append(ParityRowInput(name, ids[:start], ids[start:end]))
    return rows


@torch.no_grad()
def run_parity(engine: Engine, step: DraftStep, features: FeatureFn,
               rows: Sequence[ParityRowInput], *, max_new_tokens: int | None = None,
               num_draft_tokens: int | None = None,
               next_logits: NextLogitsFn | None = None,
               decode: Callable[[list[int]], str] | None = None) -> ParityReport:
    """The parity check of `rows` with a ready engine (its draft) and the same draft in
    `step`, target features from `features` (the training path). With `next_logits`, a
    response that leaves the engine's output is measured where it does (`divergence_margin`);
    with `decode` (ids -> text), such a response is also compared as text (`same_text`).

    Each prompt is decoded alone at temperature 0 for `max_new_tokens` (default: the row's
    response length, so whole responses are measured; 256 without a response).
    """
    if engine.draft is None:
        raise ValueError("the engine has no draft")
    bk = int(engine.block_size)
    g = bk - 1 if num_draft_tokens is None else int(num_draft_tokens)
    out_rows: list[ParityRow] = []
    all_counts: list[int] = []
    walk_counts: list[int] = []
    dataset_counts: list[int] | None = [] if any(r.response for r in rows) else None
    for row in tqdm(rows, desc="parity (engine + simulated)", unit="row"):
        budget = max_new_tokens or (len(row.response) if row.response else 256)
        result = engine.generate([row.prompt], max_new_tokens=budget, chat=False,
                                 num_draft_tokens=g)
        tokens = list(result.token_ids[0])
        accepted = list(result.stats.round_accepted[0])
        seq = row.prompt + tokens
        mask = [0] * len(row.prompt) + [1] * len(tokens)
        anchors = round_anchors(len(row.prompt), accepted)
        simulated = simulated_accepted(step, features, seq, mask, anchors)
        # Drafts past g are never verified by the engine: compare the first g slots only.
        simulated = [min(s, g) for s in simulated]
        room = [min(g, len(seq) - 1 - a) for a in anchors]
        reproduces = divergence = margin = same_text = None
        if row.response:
            reference = row.response[:budget]
            reproduces = tokens == reference
            if not reproduces:
                divergence = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y),
                                  min(len(tokens), len(reference)))
                inside = divergence < min(len(tokens), len(reference))  # not a length gap
                if next_logits is not None and inside:
                    logits = next_logits(row.prompt + tokens[:divergence]).float()
                    margin = float(logits[tokens[divergence]] - logits[reference[divergence]])
                if decode is not None:
                    ours, theirs = decode(tokens), decode(reference)
                    same_text = inside and (ours.startswith(theirs) or theirs.startswith(ours))
            if dataset_counts is not None:
                full = row.prompt + reference
                full_mask = [0] * len(row.prompt) + [1] * len(reference)
                dataset_counts += [min(s, g) for s in simulated_accepted(
                    step, features, full, full_mask, valid_anchors(full_mask))]
        every = valid_anchors(mask)
        counts = [min(s, g) for s in simulated_accepted(step, features, seq, mask, every)]
        all_counts += counts
        walk_counts += simulated_walk(dict(zip(every, counts)), len(row.prompt), len(seq))
        out_rows.append(ParityRow(row.row_id, len(row.prompt), len(tokens), anchors, accepted,
                                  simulated, room, reproduces, divergence, margin, same_text))
    return build_report(out_rows, bk, g, all_counts, walk_counts, dataset_counts)


def load_parity_pair(target: str | Path, draft: str | Path, *, device: str = "cpu",
                     dtype: torch.dtype = torch.float32, max_seq_len: int = 4096,
                     ) -> tuple[Engine, DraftStep, FeatureFn, NextLogitsFn]:
    """The engine (as `Engine.from_pretrained` serves) and the trainer's evaluation pieces
    (HF target, the same exported draft, `DraftStep`) in `dtype` on `device`, with the HF
    target's next-token logits."""
    from transformers import AutoModelForCausalLM

    from ..engine import Engine
    from ..modeling import DSpineDraftModel

    engine = Engine.from_pretrained(target, draft, device=device, dtype=dtype,
                                    max_batch_size=1, max_seq_len=max_seq_len)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype,
                                              use_safetensors=True).eval().to(device)
    hf.requires_grad_(False)
    model = DSpineDraftModel.from_pretrained(str(draft)).to(device=device, dtype=dtype).eval()
    model.bind_target(hf.get_input_embeddings().weight.detach(),
                      hf.get_output_embeddings().weight.detach())
    return (engine, DraftStep(model), extractor_features(hf, model.config.target_layer_ids),
            hf_next_logits(hf))


def _decoder(engine: Engine) -> Callable[[list[int]], str] | None:
    """The engine's tokenizer as ids -> text (None without one)."""
    tokenizer = engine.tokenizer
    return None if tokenizer is None else tokenizer.decode


def hf_next_logits(hf_target: torch.nn.Module) -> NextLogitsFn:
    """The target's logits for the token after `ids` (one unpadded row, no cache)."""
    device = next(hf_target.parameters()).device

    def next_logits(ids: list[int]) -> torch.Tensor:
        return hf_target(input_ids=torch.tensor([ids], device=device)).logits[0, -1]

    return next_logits


def parity_from_dataset(target: str | Path, draft: str | Path, data: str | Path, *,
                        split: str = "eval", limit: int | None = None,
                        max_new_tokens: int | None = None, num_draft_tokens: int | None = None,
                        device: str = "cpu", dtype: torch.dtype = torch.float32) -> ParityReport:
    """The parity check on the first `limit` rows of a tokenised dataset's `split` (the
    trainer's held-out split by default): prompts and responses as `rows_from_dataset` cuts
    them, whole responses unless `max_new_tokens` caps them."""
    from ..training.data import load_token_dataset

    dataset = load_token_dataset(str(data), split, "--data")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    ids = list(dataset["input_ids"])
    rows = rows_from_dataset(ids, list(dataset["loss_mask"]),
                             [f"{split}[{i}]" for i in range(len(ids))])
    if not rows:
        raise ValueError(f"--data {data} (split {split!r}): no row has a prompt followed by "
                         "a supervised response")
    budget = max_new_tokens or max(len(r.response or []) for r in rows)
    config = Path(draft) / "config.json"
    if not config.is_file():
        raise ValueError(f"--draft {draft}: no config.json (not an exported draft directory)")
    block = int(json.loads(config.read_text()).get("block_size", 16))
    longest = max(len(r.prompt) for r in rows) + budget + block + 1
    engine, step, features, next_logits = load_parity_pair(target, draft, device=device,
                                                           dtype=dtype, max_seq_len=longest)
    return run_parity(engine, step, features, rows, max_new_tokens=max_new_tokens,
                      num_draft_tokens=num_draft_tokens, next_logits=next_logits,
                      decode=_decoder(engine))
