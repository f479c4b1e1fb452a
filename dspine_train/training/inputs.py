"""Check a run's inputs before any heavy work: target config, draft fields, datasets.

`check_inputs` reads configs and dataset metadata only (no weights, no process group, no
DeepSpeed), so a bad recipe, a target/draft mismatch or a malformed dataset stops the run in
seconds with a `TrainingError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
from transformers import PretrainedConfig

from ..chat_template import recorded_in_dataset
from ..modeling import DSpineConfig
from .config import TrainConfig
from .data import check_supervised, check_token_absent, load_token_dataset, split_names
from .draft_builder import draft_config_for
from .errors import TrainingError
from .target import load_target_config, load_target_tokenizer, used_vocab_size
from .tiny_assets import write_synthetic_dataset, write_tiny_target


@dataclass
class RunInputs:
    """The checked inputs of a run.

    target_config: the target's HF config. draft_config: the draft for it (before any
    `model.init_from` override). train / eval: the token datasets (eval None when absent).
    """

    target_config: PretrainedConfig
    draft_config: DSpineConfig
    train: datasets.Dataset
    eval: datasets.Dataset | None


def check_inputs(config: TrainConfig) -> RunInputs:
    """Check everything a run reads; `TrainingError` names the field at fault.

    Each split must hold at least one anchor (two consecutive supervised tokens).

    The `tiny` recipe's assets are written first when asked. Every process of a launch may
    race to write them: each writes a private copy and the first complete one is kept.
    """
    m, d = config.model, config.data
    if m.tiny_random_target:
        write_tiny_target(m.target_path, seed=config.seed)
    if d.synthetic:
        write_synthetic_dataset(d.train_path, m.target_path, d.synthetic_num_sequences,
                                d.synthetic_length, seed=config.seed)
    target_config = load_target_config(m.target_path, m.trust_remote_code)
    used = used_vocab_size(m.target_path, target_config.vocab_size, m.used_vocab_size)
    # A tokenizer that uses every row leaves only its reserved tokens for the mask id.
    tokenizer = load_target_tokenizer(m.target_path) if used >= target_config.vocab_size else None
    draft_config = draft_config_for(m, target_config, used, tokenizer)
    # How the training rows were rendered travels with the export: the engine renders prompts
    # the same way and warns when serving with another template (`dspine_train.chat_template`).
    for key, value in (recorded_in_dataset(d.train_path) or {}).items():
        setattr(draft_config, key, value)
    depth = target_config.num_hidden_layers
    bad = [i for i in draft_config.target_layer_ids if not 0 <= i < depth - 1]
    if bad:
        # hidden_states[depth] is the *normed* final state, not the raw last-layer output.
        raise TrainingError(
            f"model.target_layer_ids: {bad} outside 0..{depth - 2} for the {depth}-layer "
            f"target {m.target_path!r}"
        )
    mask = draft_config.mask_token_id
    # A mask id above the tokenizer cannot come out of it; one of its reserved tokens can, from
    # the token's literal text, so the data is checked for it (one vectorised pass).
    check_mask = mask < used
    mask_name = f"model.mask_token_id {mask}"
    if tokenizer is not None:
        mask_name += f" ({tokenizer.convert_ids_to_tokens(mask)!r})"
    train = load_token_dataset(d.train_path, d.train_split, "data.train_path")
    where = f"{d.train_path!r} (split {d.train_split!r})"
    check_supervised(train, "data.train_path", where)
    if check_mask:
        check_token_absent(train, mask, "data.train_path", where, mask_name)
    eval_set = None
    if d.eval_path or d.eval_split in split_names(d.train_path):
        eval_path = d.eval_path or d.train_path
        eval_set = load_token_dataset(eval_path, d.eval_split, "data.eval_path")
        where = f"{eval_path!r} (split {d.eval_split!r})"
        check_supervised(eval_set, "data.eval_path", where)
        if check_mask:
            check_token_absent(eval_set, mask, "data.eval_path", where, mask_name)
    return RunInputs(target_config, draft_config, train, eval_set)
