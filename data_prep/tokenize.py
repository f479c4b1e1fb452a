"""Conversations -> a ``datasets`` Arrow DatasetDict of token ids and loss masks (train/eval).

    python -m data_prep.tokenize data=default_target_humaneval [data.tokenize.num_proc=2]

Input: normalised JSONL (by default the regeneration shards of ``data.regenerate.output_dir``)
or any file :mod:`data_prep.readers` reads.  Output directory (written to a temporary sibling
and renamed into place)::

    train/, eval/, dataset_dict.json   columns input_ids (int32), loss_mask (int8), length (int32)
    splits.json                        row ids of each split, in row order
    tokenize_report.json               counts, the drop reason of every dropped row, settings
    .data_prep.tokenize                marker: this tool wrote the directory and may replace it

The output directory is replaced only when it carries the marker (or is empty, or holds
only an older output of this tool); anything else -- the regeneration shards, unrelated files,
a file, a path overlapping an input -- is refused by name (see :mod:`dspine_train.owned_dir`).
A run holds :mod:`dspine_train.output_lock` on it: a second run into it is refused by name. A
failed write (a full disk) is one line saying the old output is intact.
With ``eval_fraction`` 0 no eval split is written; an eval share that leaves either split
empty is an error naming ``data.tokenize.eval_fraction``.

Masks follow :mod:`data_prep.loss_mask`.  Policy: a row longer than ``max_length`` keeps its
first ``max_length`` tokens (``truncation=right``; the draft still learns from the answer's
start) or is dropped (``truncation=drop``).  A row is dropped (and counted) when it has fewer
than ``min_supervised_run`` consecutive supervised tokens, because the objective needs an
anchor followed by a supervised token.  The eval split is a stable hash of the row id, and
rows are sorted by id, so the output does not depend on the order regeneration finished in.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from data_prep.config import RECIPES_PATH, DataConfig, TokenizeConfig, Truncation, to_data_config
from data_prep.loss_mask import TemplateError, end_of_turn_token, longest_run, tokenize_conversation
from data_prep.readers import read_rows
from data_prep.schema import DataError, SkippedRow
from data_prep.shards import shard_paths
from data_prep.sources import is_heldout
from dspine_train.chat_template import chat_template_fingerprint
from dspine_train.checkpoint_io import build_dir, clean_dead_builds, replace_dir
from dspine_train.cli_errors import existing_output, os_error_line, write_os_error
from dspine_train.output_lock import OutputLockedError, lock_output
from dspine_train.owned_dir import check_no_overlap, check_replaceable, write_marker

COLUMNS = ("input_ids", "loss_mask", "length")
REPORT_FILE = "tokenize_report.json"
SPLITS_FILE = "splits.json"
MARKER = ".data_prep.tokenize"
TOOL = "data_prep.tokenize"
# What an output written before the marker existed holds: accepted as this tool's own.
LEGACY_ENTRIES = {"train", "eval", "dataset_dict.json", SPLITS_FILE, REPORT_FILE}


def _is_legacy_output(path: Path) -> bool:
    return ((path / REPORT_FILE).is_file()
            and {entry.name for entry in path.iterdir()} <= LEGACY_ENTRIES)


class RowEncoder:
    """Picklable batch function for ``Dataset.map``: conversations -> ids, mask, drop reason."""

    def __init__(self, tokenizer: Any, *, max_length: int, truncation: Truncation,
                 min_supervised_run: int, eval_fraction: float, seed: int,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = Truncation(truncation)
        self.min_supervised_run = min_supervised_run
        self.eval_fraction = eval_fraction
        self.seed = seed
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.end_of_turn = end_of_turn_token(tokenizer, self.chat_template_kwargs)

    def encode(self, row_id: str, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One row's output columns; ``drop_reason`` is empty for a kept row."""
        out: dict[str, Any] = {"input_ids": [], "loss_mask": [], "length": 0, "supervised": 0,
                               "drop_reason": "", "truncated": False,
                               "eval": is_heldout(row_id, self.eval_fraction, self.seed, "eval")}
        messages = [{key: value for key, value in m.items() if value is not None}
                    for m in messages]
        if not any(m["role"] == "assistant" for m in messages):
            out["drop_reason"] = "no_assistant_turn"
            return out
        try:
            encoded = tokenize_conversation(self.tokenizer, messages, end_of_turn=self.end_of_turn,
                                            chat_template_kwargs=self.chat_template_kwargs)
        except TemplateError as error:
            out["drop_reason"] = error.reason
            return out
        ids, mask = encoded.input_ids, encoded.loss_mask
        if len(ids) > self.max_length:
            if self.truncation == Truncation.drop:
                out["drop_reason"] = "too_long"
                return out
            ids, mask = ids[:self.max_length], mask[:self.max_length]
            out["truncated"] = True
        if longest_run(mask) < self.min_supervised_run:
            out["drop_reason"] = "too_few_supervised_tokens"
            return out
        out.update(input_ids=ids, loss_mask=mask, length=len(ids), supervised=sum(mask))
        return out

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        rows = [self.encode(row_id, messages)
                for row_id, messages in zip(batch["id"], batch["messages"])]
        return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def _features():
    from datasets import Features, Sequence, Value

    message = {"role": Value("string"), "content": Value("string"), "truncated": Value("bool")}
    conversation = Features({"id": Value("string"), "messages": [message]})
    encoded = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                        "loss_mask": Sequence(Value("int8")), "length": Value("int32"),
                        "supervised": Value("int32"), "drop_reason": Value("string"),
                        "truncated": Value("bool"),
                        "eval": Value("bool")})
    return conversation, encoded


class _ReadLog:
    """What the row generator read: skipped rows and the count of rows yielded.

    An object, not a list, so ``from_generator`` does not take it for shards to split.
    """

    def __init__(self) -> None:
        self.skipped: list[dict[str, Any]] = []
        self.yielded = 0


def _conversations(paths: tuple[str, ...], log: _ReadLog) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    for path in paths:
        for result in read_rows(path):
            if isinstance(result, SkippedRow):
                log.skipped.append(result.to_json())
                continue
            row = result.conversation
            if row["id"] in seen:
                log.skipped.append(SkippedRow(result.ref, "duplicate_id", "id already seen",
                                              row["id"]).to_json())
                continue
            seen.add(row["id"])
            log.yielded += 1
            yield {"id": row["id"],
                   "messages": [{"role": m["role"], "content": m["content"],
                                 "truncated": bool(m.get("truncated", False))}
                                for m in row["messages"]]}


def tokenize_files(paths: Sequence[str | Path], tokenizer: Any, output_dir: str | Path,
                   **settings: Any) -> dict[str, Any]:
    """Tokenise conversation files into ``output_dir``; return the report (also saved there).

    This is the function the trainer can call directly; the CLI wraps it.  ``output_dir``
    must be one this tool may replace (module docstring) and is locked for the run
    (:mod:`dspine_train.output_lock`: a second run into it is refused by name, before it checks
    or writes anything).  ``settings``: those of :func:`_tokenize_locked`.
    """
    # an output over an input is refused before even the lock file is written beside it
    check_no_overlap(output_dir, "data.tokenize.output_dir", TOOL,
                     {"data.tokenize.input_paths": paths, **(settings.get("other_inputs") or {})})
    with lock_output(output_dir, "data.tokenize.output_dir"):
        return _tokenize_locked(paths, tokenizer, output_dir, **settings)


def _tokenize_locked(paths: Sequence[str | Path], tokenizer: Any, output_dir: str | Path, *,
                   max_length: int = 2048, truncation: Truncation = Truncation.right,
                   min_supervised_run: int = 2, eval_fraction: float = 0.02, seed: int = 0,
                   num_proc: int = 1, chat_template_kwargs: Mapping[str, Any] | None = None,
                   other_inputs: Mapping[str, Sequence[str | Path]] | None = None,
                   ) -> dict[str, Any]:
    """:func:`tokenize_files` once ``output_dir`` is locked; ``other_inputs`` (config key ->
    paths) are refused as outputs too."""
    from datasets import Dataset, DatasetDict
    from datasets.exceptions import DatasetGenerationError

    output_dir = Path(output_dir)
    for path in paths:
        read_rows(path)  # a missing input or a directory without data files fails here, by name
    check_replaceable(output_dir, "data.tokenize.output_dir", MARKER, TOOL,
                      {"data.tokenize.input_paths": paths, **(other_inputs or {})},
                      is_legacy=_is_legacy_output)
    encoder = RowEncoder(tokenizer, max_length=max_length, truncation=truncation,
                         min_supervised_run=min_supervised_run, eval_fraction=eval_fraction,
                         seed=seed, chat_template_kwargs=chat_template_kwargs)
    conversation_features, encoded_features = _features()
    clean_dead_builds(output_dir)
    build = build_dir(output_dir)
    try:
        read_log = _ReadLog()
        # Written to Arrow files in the build directory, so memory stays flat on big inputs
        # and no stale datasets cache from an earlier run can be picked up.
        try:
            raw = Dataset.from_generator(_conversations, features=conversation_features,
                                         cache_dir=str(build / "cache"),
                                             gen_kwargs={"paths": tuple(str(p) for p in paths),
                                                     "log": read_log})
        except DatasetGenerationError as error:
            if isinstance(error.__cause__, DataError):
                raise error.__cause__ from None
            raise
        except ValueError:
            if read_log.yielded:
                raise
            # datasets cannot build a dataset of zero rows: say why there are none
            reasons = Counter(row["reason"] for row in read_log.skipped)
            raise DataError(f"no usable row in {[str(p) for p in paths]} "
                            f"(skipped: {dict(reasons)})") from None
        skipped = read_log.skipped
        # An explicit fingerprint: hashing the encoder would dill-serialise the whole tokenizer
        # (seconds for Qwen's), and the fresh cache directory makes reuse impossible anyway.
        encoded = raw.map(encoder, batched=True, batch_size=32,
                          # 1 means in this process (datasets would start one worker for it)
                          num_proc=num_proc if num_proc > 1 and len(raw) >= 2 * num_proc else None,
                          remove_columns=["messages"], features=encoded_features,
                          load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex,
                          desc="tokenise + mask")
        # Column access returns lazy Column objects in datasets 5; take plain lists.
        dropped = [{"id": row_id, "reason": reason}
                   for row_id, reason in zip(list(encoded["id"]), list(encoded["drop_reason"]))
                   if reason]
        kept = encoded.filter(lambda reason: not reason, input_columns="drop_reason")
        if len(kept) == 0:
            reasons = Counter(r["reason"] for r in dropped + skipped)
            raise DataError(f"no row survived tokenisation (dropped: {dict(reasons)}); "
                            f"see the reasons above")
        row_ids = list(kept["id"])
        kept = kept.select(sorted(range(len(row_ids)), key=row_ids.__getitem__))
        splits = {}
        ids = {}
        for name, want_eval in (("train", False), ("eval", True))[:2 if eval_fraction else 1]:
            part = kept.filter(lambda flag, want=want_eval: flag == want, input_columns="eval")
            ids[name] = list(part["id"])
            splits[name] = part.select_columns(list(COLUMNS))
            if not ids[name]:
                raise DataError(
                    f"data.tokenize.eval_fraction={eval_fraction} leaves the {name} split "
                    f"empty ({len(kept)} rows kept, split by a hash of the row id); "
                    + ("lower it" if name == "train" else
                       "raise it, add rows, or set it to 0 for no eval split"))
        ids.setdefault("eval", [])
        dataset_dir = build / "dataset"
        DatasetDict(splits).save_to_disk(str(dataset_dir))
        report = {
            "input_rows": len(raw) + len(skipped),
            "kept": len(kept), "dropped": len(dropped) + len(skipped),
            "train_rows": len(ids["train"]), "eval_rows": len(ids["eval"]),
            "truncated_rows": int(sum(list(kept["truncated"]))),
            "tokens": int(sum(list(kept["length"]))),
            "supervised_tokens": int(sum(list(kept["supervised"]))),
            "drop_reasons": dict(Counter(r["reason"] for r in dropped + skipped)),
            "dropped_rows": skipped + dropped,
            "settings": {"max_length": max_length, "truncation": str(truncation),
                         "min_supervised_run": min_supervised_run,
                         "eval_fraction": eval_fraction, "seed": seed,
                         "end_of_turn": encoder.end_of_turn,
                         "chat_template_kwargs": encoder.chat_template_kwargs,
                         # the trainer copies both into the draft's export (engine check)
                         "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
                         "inputs": [str(p) for p in paths]},
        }
        (dataset_dir / SPLITS_FILE).write_text(json.dumps(ids) + "\n")
        (dataset_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        write_marker(dataset_dir, MARKER, TOOL)
        replace_dir(dataset_dir, output_dir)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return report


def run_tokenize(data: DataConfig) -> dict[str, Any]:
    """The ``tokenize`` stage of a data config: resolve inputs and tokenizer, then tokenise."""
    from transformers import AutoTokenizer

    config: TokenizeConfig = data.tokenize
    paths = list(config.input_paths) or [str(p) for p in shard_paths(data.regenerate.output_dir)]
    if not paths:
        raise DataError(f"no input: tokenize.input_paths is empty and "
                        f"{data.regenerate.output_dir} has no shards; run data_prep.regenerate")
    if not Path(config.tokenizer_path).exists():
        raise DataError(f"tokenize.tokenizer_path {config.tokenizer_path} does not exist "
                        f"(for the default target run: python -m data_prep.default_target)")
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
    if not getattr(tokenizer, "chat_template", None):  # the rows are rendered as chats
        raise DataError(f"data.tokenize.tokenizer_path {config.tokenizer_path}: the tokenizer "
                        "has no chat template (a base model?); point it at a chat model's "
                        "tokenizer, or add a chat_template to its tokenizer_config.json")
    kwargs = {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}
    return tokenize_files(paths, tokenizer, config.output_dir, max_length=config.max_length,
                          truncation=config.truncation,
                          min_supervised_run=config.min_supervised_run,
                          eval_fraction=config.eval_fraction, seed=config.seed,
                          num_proc=config.num_proc, chat_template_kwargs=kwargs,
                          other_inputs={
                              "data.tokenize.tokenizer_path": [config.tokenizer_path],
                              "data.regenerate.output_dir": [data.regenerate.output_dir]})


@hydra.main(version_base="1.3", config_path=RECIPES_PATH, config_name="data_prep_job")
def main(cfg: DictConfig) -> None:
    """CLI: tokenise the configured conversations and print the summary."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    output_dir = cfg.data.tokenize.output_dir
    kept = output_dir if existing_output(output_dir) else None  # before anything is written
    try:
        data = to_data_config(cfg.data)
        report = run_tokenize(data)
    except (DataError, ValueError, OutputLockedError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except Exception as error:  # a full disk: datasets wraps the OSError of a failed write
        os_error = write_os_error(error)
        if os_error is None:
            raise
        where = f"data.tokenize.output_dir {output_dir}"
        print(f"error: {os_error_line(os_error, where, kept)}", file=sys.stderr)
        sys.exit(1)
    summary = {key: report[key] for key in ("input_rows", "kept", "dropped", "train_rows",
                                             "eval_rows", "truncated_rows", "drop_reasons")}
    print(json.dumps(summary, indent=2))
    print(f"wrote {data.tokenize.output_dir}")


if __name__ == "__main__":
    main()
