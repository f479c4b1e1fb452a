"""vLLM's draft format, as the `speculators` package (`speculators==0.9.0`) writes it for DFlash.

`vllm serve DRAFT_DIR` recognises a speculators checkpoint by `speculators_model_type` in its
`config.json`, builds the draft from `transformer_layer_config` plus the algorithm's own keys,
and takes the target (verifier) and the number of drafted tokens from `speculators_config`.
What `speculators`' `DFlashSpeculatorConfig` / `DFlashDraftModel.save_pretrained` and its
`convert/dflash` converter write for a DFlash draft (established from the package source):

* `config.json`: `speculators_model_type: "dflash"`, `speculators_version`, `architectures:
  ["DFlashDraftModel"]` (the model class name, which `save_pretrained` puts there);
  `transformer_layer_config`: the draft's Qwen3 config (`to_diff_dict` of the DFlash config
  without `architectures`, `auto_map`, `block_size`, `dflash_config`, `num_target_layers`);
  `draft_vocab_size` (the full vocabulary: no draft-vocabulary mapping), `target_hidden_size`
  (null: the draft is as wide as the target), `block_size`, `mask_token_id`,
  `sample_from_anchor: false` (slot 0 is the anchor, slots 1.. are drafted),
  `sliding_window_non_causal: false`, and `aux_hidden_state_layer_ids`;
  `speculators_config {algorithm: "dflash", proposal_methods: [greedy, speculative_tokens =
  block_size - 1], default_proposal_method: "greedy", verifier {name_or_path, architectures}}`.
* `aux_hidden_state_layer_ids` number the target's hidden states as vLLM captures them: id
  i + 1 is the output of decoder layer i, so DFlash's `target_layer_ids` [i, ...] become
  [i + 1, ...]. The converter drops the id of the target's last layer (that state reaches a
  speculators draft as the verifier's last hidden state, not as a context feature), which would
  leave `fc` wider than the draft it builds: such a draft is refused here.
* weights: the DFlash backbone under DFlash's names (`fc`, `hidden_norm`, `layers.N.*`, `norm`):
  the target's embedding and head (`embed_tokens`, `lm_head`, `verifier_lm_head`,
  `verifier_norm`) are reloaded from the verifier and never saved for a full-vocabulary draft.
* no input-embedding scale: a draft for a target that scales its embeddings (Gemma) is refused.

DSpark drafts (`method: dspark`) are written in the same format with their own keys and head
tensors: `speculators_dspark.py`.

The converter also copies speculators' own config module next to the checkpoint (`config.py`,
with `auto_map` naming it: the remote-code hook of its config class); neither vLLM nor
`speculators` reads it to load the draft, and this project writes neither.
`tests/test_speculators_format.py` checks all of this against the package itself.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, Qwen3Config

from ..modeling import DSpineConfig
from . import dflash
from .dflash import FormatError

MODEL_TYPE = "dflash"  # `speculators_model_type`
ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_VERSION = "0.9.0"  # the package version this format follows (tested against)
# Keys of a DFlash config.json that are not the draft transformer's own.
NON_TRANSFORMER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config",
                        "num_target_layers")


def is_speculators_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a speculators checkpoint's."""
    return "speculators_model_type" in fields


def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless `config` is a DFlash draft that speculators' DFlash model runs as
    ours: a DFlash draft, no input-embedding scale, no context feature from the last layer
    (a DSpark draft: `speculators_dspark.check_exportable`)."""
    dflash.check_exportable(config, source, fmt="speculators")
    check_runnable(config, source)


def check_runnable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless speculators' DFlash-family backbone runs `config`'s as ours: no
    input-embedding scale, no context feature from the target's last layer."""
    if config.embed_scale != 1.0:
        raise FormatError(
            f"{source}: the target scales its input embeddings (embed_scale={config.embed_scale})"
            " and speculators' DFlash draft has no such scale; it would draft from unscaled "
            "embeddings - use --format dflash (dflash_config.input_embedding_scale)"
        )
    last = config.target_num_layers - 1
    if last in config.target_layer_ids:
        raise FormatError(
            f"{source}: target_layer_ids {config.target_layer_ids} include the target's last "
            f"layer ({last}), which speculators feeds to a draft as the verifier's last hidden "
            "state, not as a context feature; use --format dflash"
        )


def verifier_block(config: DSpineConfig, verifier: str | None, source: str) -> dict[str, Any]:
    """`speculators_config.verifier`: the target's name or path (`verifier`, default the draft's
    `target_name_or_path`) and the `architectures` of its `config.json`, which must be readable
    (speculators and vLLM load the target from it) and match the draft's target by size."""
    name = verifier or config.target_name_or_path
    if not name:
        raise FormatError(
            f"{source}: the speculators format names the target model (verifier) and the "
            "draft's config has no target_name_or_path; pass --verifier PATH_OR_HUB_ID"
        )
    try:
        fields, _ = PretrainedConfig.get_config_dict(name)
    except (OSError, ValueError) as err:
        raise FormatError(f"verifier {name}: no readable config.json ({err})") from err
    text = fields.get("text_config") or fields
    expected = {"hidden_size": config.hidden_size, "num_hidden_layers": config.target_num_layers,
                "vocab_size": config.vocab_size}
    wrong = [f"{key}={text.get(key)} (the draft's target has {value})"
             for key, value in expected.items() if text.get(key) != value]
    if wrong:
        raise FormatError(f"verifier {name}: not the draft's target: {', '.join(wrong)}")
    return {"name_or_path": str(name), "architectures": list(fields.get("architectures") or [])}


def config_dict(config: DSpineConfig, dtype: torch.dtype,
                verifier: dict[str, Any]) -> dict[str, Any]:
    """The speculators `config.json` of a DFlash draft with `config`, weights of `dtype`, for
    the verifier `verifier` (`verifier_block`)."""
    fields = dflash.config_dict(config, dtype)
    layer = Qwen3Config(**{k: v for k, v in fields.items() if k not in NON_TRANSFORMER_KEYS})
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            # one chain of block_size - 1 drafted tokens, accepted where the target agrees
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": config.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "transformer_layer_config": layer.to_diff_dict(),
        "draft_vocab_size": config.vocab_size,
        "target_hidden_size": None,
        # vLLM's capture ids: id i + 1 is the output of layer i (DFlash's id i)
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "tie_word_embeddings": False,
        "dtype": fields["dtype"],
        "transformers_version": transformers.__version__,
    }
