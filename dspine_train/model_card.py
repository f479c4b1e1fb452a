"""The model card (README.md) of a DSpine draft on the Hugging Face Hub.

`render_model_card` writes what an export records (`dspine_train.hub.validate_export` reads
it): the draft's config, the training recipe, data and budget (training_info.json), and the
acceptance measured (eval_results.json). A missing measurement is written as "not measured",
never estimated; local absolute paths appear by their last component only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from dspine_train.markdown_table import markdown_table

if TYPE_CHECKING:
    from dspine_train.hub import ExportInfo

EVAL_RESULTS_FILE = "eval_results.json"  # the measured results an export may hold
CARD_TAGS = ["speculative-decoding", "dspine", "draft-model"]
LIBRARY_NAME = "dspine-train"
NOT_MEASURED = "not measured"
NOT_RECORDED = "not recorded"
# A POSIX absolute path (or ~/...) inside free text: not preceded by a word character, a dot,
# a colon or a slash, so URLs, "org/name" ids and "3/4" are left alone.
LOCAL_PATH = re.compile(r"(?<![\w.:/~-])~?(?:/[^\s/`'\"|()<>]+)+/?")


# What one draft forward does, per `method` (the card's first paragraph); the verify that
# follows is the same for all.
METHOD_SUMMARIES = {
    "dspine": ("A DSpine draft model", "each position conditioned on its predecessor's forming "
               "prediction"),
    "dflash": ("A DFlash draft model (`method: dflash`)", "each position predicted from the "
               "target's context features and decoded on its own"),
    "dspark": ("A DSpark draft model (`method: dspark`, DeepSpec's method)", "the anchor slot "
               "predicting too and a Markov head conditioning each token on the one drafted "
               "before it"),
    "domino": ("A Domino draft model (`method: domino`, SpecForge's method)", "a GRU over the "
               "tokens drafted before each position correcting its logits"),
    "dflash2": ("A DFlash2 draft model (`method: dflash2`, z-lab's network)", "grouped causal "
                "convolutions along the block and a candidate selector choosing each token "
                "given the one drafted before it"),
}
# The `python -m dspine_train.export --format` its serving stacks read, per method (none: the
# project's own engine serves it, docs/SERVING.md).
SERVER_FORMATS = {"dflash": "speculators", "dspark": "speculators", "dflash2": "speculators",
                  "domino": "specforge"}


def hub_base_model(name: str | None) -> str | None:
    """`name` when it can be a Hub model id (and is not a local directory), else None."""
    if not name or Path(name).expanduser().exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def public_text(text: str) -> str:
    """`text` with every local absolute path replaced by its last component."""

    def last_component(match: re.Match[str]) -> str:
        return match.group(0).rstrip("/").rsplit("/", 1)[-1]

    return LOCAL_PATH.sub(last_component, text)


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_format_value(v) for v in value)
    return public_text(str(value))


def _eval_section(eval_results: dict[str, Any] | None) -> list[str]:
    """Measured results exactly as eval_results.json records them."""
    if eval_results is None:
        return [
            f"Mean acceptance length: **{NOT_MEASURED}** (the export has no {EVAL_RESULTS_FILE}).",
        ]
    lines = []
    tau = eval_results.get("acceptance_length")
    if tau is None:
        lines.append(
            f"Mean acceptance length: **{NOT_MEASURED}** ({EVAL_RESULTS_FILE} has no "
            "`acceptance_length`)."
        )
    else:
        lines.append(
            f"Mean acceptance length: **{tau:.3f}** tokens per target verification "
            f"(from {EVAL_RESULTS_FILE})."
        )
    per_position = eval_results.get("acceptance_length_per_position")
    if isinstance(per_position, list) and per_position:
        lines += ["", *markdown_table(
            ["k (drafted tokens)", *range(1, len(per_position) + 1)],
            [["share of blocks with the first k accepted", *map(_format_value, per_position)]],
        )]
    scalars = {
        key: value
        for key, value in eval_results.items()
        if key != "acceptance_length"
        and isinstance(value, str | int | float)
        and not isinstance(value, bool)
    }
    if scalars:
        lines += ["", *markdown_table(
            ["metric", "value"],
            [(key, _format_value(value)) for key, value in sorted(scalars.items())],
        )]
    return lines


# The trainer's budget entries (training_info.json "budget"), as the card names them.
_BUDGET_LABELS = {
    "optimizer_steps": "optimizer steps",
    "sequences_seen": "sequences seen",
    "tokens_seen": "tokens seen (unpadded)",
    "epochs": "epochs",
    "global_batch_sequences": "global batch (sequences)",
    "processes": "processes",
    "wall_time_s": "wall time (s)",
}


def _budget_section(training_info: dict[str, Any]) -> list[str]:
    """The training budget exactly as training_info.json records it."""
    budget = training_info.get("budget")
    if not isinstance(budget, dict) or not budget:
        return [f"- budget: {NOT_RECORDED}"]

    def shown(value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return _format_value(value)

    keys = [k for k in _BUDGET_LABELS if k in budget] + sorted(set(budget) - set(_BUDGET_LABELS))
    rows = [(_BUDGET_LABELS.get(key, key), shown(budget[key])) for key in keys]
    return ["", *markdown_table(["budget", "value"], rows)]


def render_model_card(
    info: ExportInfo,
    *,
    repo_id: str,
    recipe: str | None = None,
    dataset: str | None = None,
    base_model: str | None = None,
) -> str:
    """The README.md of the Hub repository: YAML front matter, then what the export records.

    `recipe`, `dataset` and `base_model` override what training_info.json / config.json say.
    Numbers in the card come only from the export's files. The card is built by
    huggingface_hub's `ModelCard` from a `ModelCardData` (which validates the metadata and
    writes the front matter); local absolute paths appear by their last component only.
    """
    config = info.config
    target = base_model or config.get("target_name_or_path")
    hub_target = base_model or hub_base_model(target)
    method = config.get("method") if config.get("method") in METHOD_SUMMARIES else "dspine"
    tags = list(CARD_TAGS) + ([method] if method != "dspine" else [])
    metadata = ModelCardData(library_name=LIBRARY_NAME, tags=tags, base_model=hub_target)
    recorded_recipe = info.training_info.get("recipe")
    recipe = recipe or (recorded_recipe if isinstance(recorded_recipe, str) else None)
    recipe = public_text(recipe) if recipe else NOT_RECORDED
    recorded_data = info.training_info.get("dataset")
    if isinstance(recorded_data, list) and all(isinstance(d, str) for d in recorded_data):
        recorded_data = ", ".join(recorded_data)
    dataset = dataset or (recorded_data if isinstance(recorded_data, str) else None)
    dataset = public_text(dataset) if dataset else NOT_RECORDED
    target_text = f"`{public_text(target)}`" if target else NOT_RECORDED
    if config.get("target_model_type"):
        target_text += f" ({config['target_model_type']})"
    layer_ids = config.get("target_layer_ids")

    def field_of(key: str) -> str:
        return _format_value(config[key]) if key in config else NOT_RECORDED

    rows = [
        ("method", method),
        ("target model", target_text),
        ("draft layers", field_of("num_layers")),
        ("target layers read (0-based)", _format_value(layer_ids) if layer_ids else NOT_RECORDED),
        ("block size", field_of("block_size")),
        ("block attention", field_of("block_attention")),
        ("adjacent injection", field_of("injection")),
        ("transfer dim / message size", f"{field_of('transfer_dim')} / {field_of('message_size')}"),
        ("transition-cache candidates (K)", field_of("candidate_k")),
        ("transition-cache decode", field_of("transition_cache")),
        (
            "weights",
            f"{info.num_values:,} values in {info.num_tensors} tensors "
            f"({', '.join(info.weight_files)})",
        ),
    ]
    target_id = hub_target or "TARGET_MODEL"  # a local checkpoint is the reader's own
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"{METHOD_SUMMARIES[method][0]} for lossless speculative decoding with {target_text} as "
        f"the target. One forward of the draft proposes a block of tokens, "
        f"{METHOD_SUMMARIES[method][1]}; the target verifies the block in one forward, so the "
        "output is the target's own.",
        "",
        "## Model",
        "",
        *markdown_table(["", ""], rows),
        "",
        "## Training",
        "",
        f"- recipe: {recipe}",
        f"- data: {dataset}",
        *_budget_section(info.training_info),
        "",
        "## Evaluation",
        "",
        *_eval_section(info.eval_results),
        "",
        "## Usage",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM",
        "from dspine_train import DSpineDraftModel",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target_id}", dtype=torch.bfloat16)',
        f'draft = DSpineDraftModel.from_pretrained("{repo_id}", dtype=torch.bfloat16)',
        "# The draft shares the target's frozen embedding and lm_head (not stored in this repo).",
        "draft.bind_target(target.get_input_embeddings().weight,",
        "                  target.get_output_embeddings().weight)",
        "```",
        "",
        f"Trained and exported with {LIBRARY_NAME}; its README describes the speculative decoding "
        "engine that runs this draft and the benchmark scripts.",
        "",
    ]
    if method in SERVER_FORMATS:
        # a sliding-window DFlash or DFlash2 goes in z-lab's format (speculators' windows differ)
        fmt = "dflash" if config.get("sliding_window") and method in ("dflash", "dflash2") \
            else SERVER_FORMATS[method]
        lines[-1:-1] = [
            f"For vLLM or SGLang, write it in the format they read with `python -m "
            f"dspine_train.export THIS_DRAFT OUT --format {fmt}` (the "
            "serving commands: docs/SERVING.md in the repository).",
            "",
        ]
    # The template only places the body after the front matter ModelCard renders from the
    # metadata; ModelCard parses the result back, so invalid metadata raises here.
    card = ModelCard.from_template(
        metadata, template_str="---\n{{ card_data }}\n---\n\n{{ body }}", body="\n".join(lines)
    )
    return str(card)
