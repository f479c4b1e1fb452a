"""The one typed schema of a training run, registered in Hydra's ConfigStore.

Recipe YAML under `recipes/` only overrides these dataclasses; Hydra merges
dataclass defaults -> recipe groups -> command line and rejects an unknown key or a wrong type
before any work starts. `validate_config` adds the checks a type cannot express (ranges,
combinations) and names the offending field.

The draft fields of `ModelConfig` are not listed here: `_with_draft_fields` adds every
`DSpineConfig.draft_fields()` entry, typed as DSpineConfig declares it, with default None
("DSpineConfig's default"), so the draft fields and their defaults live in DSpineConfig only.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from ..cpu_bf16 import Bf16Matmul
from ..modeling.configuration_dspine import METHOD_PRESETS, DSpineConfig
from ..py_compat import StrEnum
from ..recipe_files import RECIPES_DIR  # `train.py`'s Hydra config path


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class Precision(StrEnum):
    """Numeric format of the draft's parameters and activations (DeepSpeed `bf16` section)."""

    bf16 = "bf16"
    fp32 = "fp32"


class PlanDevice(StrEnum):
    """The device `plan_only` sizes a run for; it picks the draft attention path planned."""

    cuda = "cuda"  # compiled flex attention
    cpu = "cpu"  # dense SDPA with a boolean mask


def _draft_field_types() -> dict[str, Any]:
    """The type of each `DSpineConfig.draft_fields()` entry, its annotation resolved."""
    draft = DSpineConfig.draft_fields()
    holder = types.SimpleNamespace(__annotations__={name: f.type for name, f in draft.items()})
    return typing.get_type_hints(holder, globalns=vars(sys.modules[DSpineConfig.__module__]))


def _literal_values(name: str) -> tuple[str, ...]:
    """The values of Literal draft field `name` (its annotation may be `Literal[...] | None`)."""
    kind = _draft_field_types()[name]
    for arg in (kind, *typing.get_args(kind)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    raise TypeError(f"DSpineConfig.{name} is not a Literal")


# Attention inside a block, from `DSpineConfig.block_attention`'s Literal: "causal" (DSpine)
# or "bidirectional" (plain DFlash). An Enum, so OmegaConf checks the value.
BlockAttention = StrEnum(
    "BlockAttention",
    {value: value for value in _literal_values("block_attention")},
)


# The draft's method, from `DSpineConfig.method`'s Literal: "dspine", "dflash" (the reference
# DFlash draft), "dspark", "domino" or "dflash2" (see `METHOD_PRESETS` for the fields each fixes).
DraftMethod = StrEnum(
    "DraftMethod",
    {value: value for value in _literal_values("method")},
)

# The objective options where this project and SpecForge differ (`DSpineConfig` documents them).
ReadoutInit = StrEnum("ReadoutInit", {v: v for v in _literal_values("readout_init")})
AlignmentLayerReduction = StrEnum(
    "AlignmentLayerReduction", {v: v for v in _literal_values("alignment_layer_reduction")})
RefineNormalization = StrEnum(
    "RefineNormalization", {v: v for v in _literal_values("refine_normalization")})
MarkovHeadType = StrEnum("MarkovHeadType", {v: v for v in _literal_values("markov_head_type")})

# The Enum standing for each Literal field of DSpineConfig (OmegaConf checks Enums, not Literals).
_LITERAL_ENUMS: dict[str, type[Enum]] = {"block_attention": BlockAttention,
                                         "method": DraftMethod,
                                         "readout_init": ReadoutInit,
                                         "alignment_layer_reduction": AlignmentLayerReduction,
                                         "refine_normalization": RefineNormalization,
                                         "markov_head_type": MarkovHeadType}


def _schema_type(name: str, kind: Any) -> Any:
    """The schema type of draft field `name`: its `DSpineConfig` annotation made optional,
    a Literal replaced by its Enum in `_LITERAL_ENUMS`."""
    if typing.get_origin(kind) in (types.UnionType, typing.Union):  # `X | None`: X
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if len(args) == 1 else kind
    if typing.get_origin(kind) is typing.Literal:
        if name not in _LITERAL_ENUMS:
            raise TypeError(f"DSpineConfig.{name} is a Literal: add its Enum to _LITERAL_ENUMS")
        kind = _LITERAL_ENUMS[name]
    return kind | None


def _with_draft_fields(cls: type) -> type:
    """Add every `DSpineConfig.draft_fields()` entry to `cls` as an optional field with default
    None ("DSpineConfig's default"), typed as DSpineConfig declares it; apply before
    `@dataclass`. The draft fields and their defaults so live in DSpineConfig only."""
    for name, kind in _draft_field_types().items():
        if name in cls.__annotations__:
            raise TypeError(f"ModelConfig.{name} clashes with the DSpineConfig field of that name")
        cls.__annotations__[name] = _schema_type(name, kind)
        setattr(cls, name, None)
    return cls


@dataclass
@_with_draft_fields
class ModelConfig:
    """The frozen target and the draft built for it.

    Attributes:
        target_path: a Hugging Face causal LM (local directory or Hub id; safetensors weights).
        target_config_path: a directory or config.json describing the target, read by
            `plan_only` when `target_path` is not available locally: a path from the working
            directory, else under the recipes (`targets/qwen3_8b`). None: `target_path`.
        trust_remote_code: allow the target's own modelling code (off unless asked).
        target_dtype: dtype the frozen target runs in ("bfloat16", "float16", "float32").
        tiny_random_target: when `target_path` does not exist, write a tiny random Qwen3 there
            first (the `tiny` recipe and CI; never for a real target).
        token_table_path: PCA-whitened token codes (METHOD 2.1); built from the target's lm_head
            and cached here when missing. None: `<output_dir>/token_table.safetensors`.
        init_from: a draft to start from instead of a fresh draft: a DSpine export (its
            weights and structure; the objective fields this recipe sets are the recipe's:
            `training.initialisation.from_export`), or a DFlash-format checkpoint such as a
            published z-lab draft (its backbone, with DSpine's own parts at their init and this
            recipe's method and attention; the structure fields the recipe leaves unset are the
            checkpoint's: `training.initialisation.from_dflash`).
        warm_start_layers: one target layer index per draft layer (off: None): draft layer i
            starts as a copy of target decoder layer `warm_start_layers[i]` (attention, q/k
            norms, MLP, the two RMSNorms; read from the target's safetensors, so it works with
            offline features), the DSpine-only parts at their seeded init
            (`training.initialisation.from_target_layers`). A training-time init like
            `init_from` (not recorded in the export: the draft it gives has the same
            architecture); exclusive with `init_from`.
        used_vocab_size: ids the target's tokenizer uses (`len(tokenizer)`; the mask token and
            `target_vocab_size` of the export follow from it). None: read from the tokenizer
            files in `target_path`, which a target then must have. Set it for a target
            without tokenizer files; with a tokenizer it must equal its length.

    Besides these, every field of `DSpineConfig.draft_fields()` (`num_layers`, `block_size`,
    `target_layer_ids`, `mask_token_id`, `loss_gamma`, ...) is a field here, typed as
    `DSpineConfig` declares it, default None: "`DSpineConfig`'s default" (or what
    `DSpineConfig.from_target` derives from the target: context layers, mask id, widths
    capped by the target). `draft_overrides()` returns the ones a recipe sets.
    """

    target_path: str = MISSING
    target_config_path: str | None = None
    trust_remote_code: bool = False
    target_dtype: str = "bfloat16"
    tiny_random_target: bool = False
    token_table_path: str | None = None
    init_from: str | None = None
    warm_start_layers: list[int] | None = None
    used_vocab_size: int | None = None

    def draft_overrides(self) -> dict[str, Any]:
        """The `DSpineConfig` fields this recipe sets (the ones that are not None), as plain
        values for `DSpineConfig.from_target`."""
        out: dict[str, Any] = {}
        for name in DSpineConfig.draft_fields():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, list | tuple):
                value = [int(v) for v in value]
            out[name] = value
        return out


@dataclass
class DataConfig:
    """Tokenised training data: `datasets` Arrow directories with `input_ids`, `loss_mask`, `length`.

    Attributes:
        train_path: a `save_to_disk` directory (a Dataset, or a DatasetDict holding `train_split`).
        train_split: split to train on when `train_path` holds a DatasetDict.
        eval_path: held-out data; None uses `train_path` (its `eval_split`, when it has one).
        eval_split: split to evaluate on when the eval directory holds a DatasetDict.
        max_length: sequences are cut to this many tokens.
        num_anchors: blocks sampled per sequence (METHOD 1, "Training").
        batch_size: sequences per micro-batch per process.
        group_by_length: batch sequences of similar length together (less padding).
        length_group_size: batches per shuffled length-sorted group.
        offline_features_dir: train from features cached by `training/cache_features.py`
            instead of running the target online.
        target_topk: the feature cache pass also stores the top-k of the target's next-token
            distribution (k ids and probabilities per token, 8k bytes), and training with that
            cache uses it instead of projecting each slot through the target's head
            (`vocab_loss`); an online target computes the same top-k once per position. 0
            stores none / trains on the exact distribution, projected once per block slot.
            1024 moves the demo's objective by < 2e-4 (64: 1e-2; `scripts/bench_train.py`).
        synthetic: when the train path does not exist, write a small dataset sampled from the
            target there first (the `tiny` recipe and CI).
        synthetic_num_sequences: sequences of the synthetic dataset (train + eval).
        synthetic_length: tokens per synthetic sequence.
    """

    train_path: str = MISSING
    train_split: str = "train"
    eval_path: str | None = None
    eval_split: str = "eval"
    max_length: int = 3072
    num_anchors: int = 512
    batch_size: int = 1
    group_by_length: bool = True
    length_group_size: int = 64
    offline_features_dir: str | None = None
    target_topk: int = 1024
    synthetic: bool = False
    synthetic_num_sequences: int = 160
    synthetic_length: int = 64


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (`get_cosine_schedule_with_warmup`).

    Attributes:
        lr: peak learning rate.
        warmup_ratio: share of the optimizer steps spent warming up.
        weight_decay: decoupled weight decay (not applied to norms and biases).
        betas: Adam (beta1, beta2): (0.9, 0.95) here; SpecForge's DSpine uses (0.9, 0.999).
        eps: Adam epsilon.
        max_grad_norm: global gradient-norm clip (DeepSpeed `gradient_clipping`); 0 disables.
        epochs: passes over the training data (used when `max_steps` is 0).
        max_steps: optimizer steps to run; 0 derives them from `epochs`.
        grad_accum_steps: micro-batches per optimizer step.
    """

    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    epochs: float = 6.0
    max_steps: int = 0
    grad_accum_steps: int = 1


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO settings.

    Attributes:
        stage: ZeRO stage, 2 (default) or 3.
        config_file: DeepSpeed JSON, relative to `recipes/` or absolute; batch size,
            accumulation, clipping and precision are filled in from this schema.
    """

    stage: int = 2
    config_file: str = "deepspeed/zero2.json"


@dataclass
class LoggingConfig:
    """Progress bar, metrics file and Weights & Biases.

    Attributes:
        wandb: log to wandb (offline mode unless WANDB_API_KEY or WANDB_MODE says otherwise).
        project: wandb project.
        run_name: wandb run name; None uses the recipe name.
        log_every: optimizer steps between logged metric lines.
        progress_bar: tqdm bar on rank 0.
    """

    wandb: bool = True
    project: str = "dspine-train"
    run_name: str | None = None
    log_every: int = 10
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    """Resumable training state (`accelerator.save_state` + `train_state.json`).

    Attributes:
        dir: checkpoint directory; None: `<output_dir>/checkpoints`.
        every: optimizer steps between checkpoints (0: only at the end).
        keep_last: most recent checkpoints kept (the best one is kept besides).
        resume_from: a checkpoint directory, or "latest" for the newest complete one in `dir`.
    """

    dir: str | None = None
    every: int = 1000
    keep_last: int = 2
    resume_from: str | None = None


@dataclass
class EvalConfig:
    """Simulated acceptance length on the held-out split (METHOD 1, "Inference").

    Attributes:
        every: optimizer steps between evaluations (0: only at the end).
        every_block: evaluate every block the trainer may draw in the held-out split, each
            once (when there are more than `max_blocks`, a fixed uniform draw of `max_blocks`
            of them), and report tau's standard error over blocks and clustered by row, and
            write the per-block results (`<output_dir>/eval_blocks/`) for paired comparisons.
            False: the older plan of up to `num_anchors` random anchors per row in
            length-grouped batches up to `max_blocks` (short rows weigh more).
        max_blocks: blocks evaluated per evaluation (all processes together).
        num_anchors: blocks per eval sequence (every_block: blocks of a row per forward).
        batch_size: eval sequences per forward per process.
    """

    every: int = 1000
    every_block: bool = True
    max_blocks: int = 4096
    num_anchors: int = 64
    batch_size: int = 1


class ExportFormat(StrEnum):
    """Checkpoint format of the trainer's exports (`dspine_train.formats`)."""

    dspine = "dspine"  # this project's own (DSpineDraftModel; carries the DFlash keys too)
    dflash = "dflash"  # z-lab's DFlashDraftModel format; a `method: dflash` draft only


@dataclass
class ExportConfig:
    """The exported drafts (`<output_dir>/final`, `<output_dir>/best`) and their Hub upload.

    Attributes:
        format: "dspine" (default) or "dflash": what `python -m dspine_train.export
            --format` writes. "dflash" needs `model.method: dflash` (a DSpine draft has parts
            that DFlash loaders would drop); either format loads in this project's engine.
        push_to_hub: a Hub model repository (ORG/NAME) the final export is uploaded to at the
            end of the run, with its model card (`dspine_train.hub`); None: no upload. Needs a
            token ($HF_TOKEN or `hf auth login`), checked before training.
        push_private: create the repository private (an existing one keeps its visibility).
        push_target_id: the target's Hub id (ORG/NAME) written into the uploaded config.json
            and the card's base_model; needed when `model.target_path` is a local directory
            (never uploaded). None: `model.target_path` when it is a Hub id.
        push_endpoint: the Hub URL; None: $HF_ENDPOINT or huggingface.co.
        push_timeout: seconds one HTTP request of the upload may go without progress.
    """

    format: ExportFormat = ExportFormat.dspine
    push_to_hub: str | None = None
    push_private: bool = True
    push_target_id: str | None = None
    push_endpoint: str | None = None
    push_timeout: float = 60.0


@dataclass
class TrainConfig:
    """A whole training run; `train.py` receives this, composed by Hydra from `recipes/`.

    Attributes:
        name: recipe name (run names, model cards).
        output_dir: checkpoints, metrics, plots and the exports (`final/`, `best/`).
        seed: seeds the draft init, data order, anchor sampling and replacement draws.
        precision: draft parameters and activations ("bf16" or "fp32").
        cpu_bf16_matmul: how bf16 matrix products run on a CPU (training, its evaluations and
            `cache_features`' target): "float32" computes them from the bf16 operands in
            float32 and rounds the result once (a bf16 GEMM's own semantics, ~3.5x faster
            where the CPU has no native bf16), "native" keeps PyTorch's kernels, "auto" (the
            default) is "float32" on a CPU without avx512_bf16/amx_bf16 and "native"
            elsewhere (dspine_train/cpu_bf16.py). No effect on CUDA.
        plan_only: print the per-GPU memory plan of the recipe and exit (loads no weights).
        gpu_memory_gib: GPU size the memory plan checks against.
        plan_device: the device `plan_only` sizes the run for: "cuda" counts compiled flex
            attention (what a GPU run uses), "cpu" the dense SDPA mask path.
        world_size: GPUs assumed by `plan_only` (a real run uses the launched world).
        logits_chunk_size: block slots whose full-vocabulary logits exist at once (plan_only).
    """

    name: str = "custom"
    output_dir: str = "outputs/${name}"
    seed: int = 0
    precision: Precision = Precision.bf16
    cpu_bf16_matmul: Bf16Matmul = Bf16Matmul.auto
    plan_only: bool = False
    gpu_memory_gib: float = 80.0
    plan_device: PlanDevice = PlanDevice.cuda
    world_size: int = 8
    logits_chunk_size: int = 1024
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def register_configs() -> None:
    """Register the schema as `train_schema` (the base of `recipes/config.yaml`)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose_train_config(*overrides: str) -> TrainConfig:
    """The validated `TrainConfig` that `python train.py <overrides>` runs, composed without
    running anything (no Hydra app, no output directory). Hydra's errors (an unknown key, a
    wrong type) and `ConfigError` (a value out of range) name the key."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()  # callable again, and from inside another Hydra app
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        return to_train_config(compose(config_name="config", overrides=list(overrides)))


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Turn Hydra's composed DictConfig into a validated `TrainConfig` instance.

    Re-merging onto the structured schema (as `data_prep.config.to_data_config` does) catches
    keys that a `+key=value` override forced past Hydra's struct check.
    """
    plain = OmegaConf.to_container(cfg, resolve=False)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), plain)
    except ConfigKeyError as err:
        raise ConfigError(f"{err.full_key}: not a setting of the training schema "
                          "(dspine_train/training/config.py)") from err
    except ValidationError as err:
        raise ConfigError(f"{err.full_key}: {err.msg}") from err
    config = OmegaConf.to_object(cfg)
    if not isinstance(config, TrainConfig):  # composed without the schema: a recipe bug
        raise ConfigError("the composed config is not a TrainConfig; recipes/config.yaml "
                          "must list `train_schema` first in its defaults")
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Range and combination checks a type cannot express; `ConfigError` names the field."""
    positive = {
        "data.max_length": config.data.max_length,
        "data.num_anchors": config.data.num_anchors,
        "data.batch_size": config.data.batch_size,
        "data.length_group_size": config.data.length_group_size,
        "optim.grad_accum_steps": config.optim.grad_accum_steps,
        "logging.log_every": config.logging.log_every,
        "checkpoint.keep_last": config.checkpoint.keep_last,
        "eval.max_blocks": config.eval.max_blocks,
        "eval.num_anchors": config.eval.num_anchors,
        "eval.batch_size": config.eval.batch_size,
        "world_size": config.world_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    non_negative = {
        "optim.lr": config.optim.lr,
        "optim.weight_decay": config.optim.weight_decay,
        "optim.max_grad_norm": config.optim.max_grad_norm,
        "optim.max_steps": config.optim.max_steps,
        "checkpoint.every": config.checkpoint.every,
        "eval.every": config.eval.every,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if not 0.0 <= config.optim.warmup_ratio < 1.0:
        raise ConfigError(f"optim.warmup_ratio must be in [0, 1), got {config.optim.warmup_ratio}")
    if config.optim.max_steps == 0 and config.optim.epochs <= 0:
        raise ConfigError("optim.epochs must be > 0 when optim.max_steps is 0")
    if len(config.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(f"optim.betas must hold two numbers in [0, 1), got {config.optim.betas}")
    if config.deepspeed.stage not in (2, 3):
        raise ConfigError(f"deepspeed.stage must be 2 or 3, got {config.deepspeed.stage}")
    if config.export.format == ExportFormat.dflash:
        _check_dflash_export(config.model)
    if config.model.draft_vocab_size is not None and config.export.format != ExportFormat.dspine:
        raise ConfigError(  # the other formats carry no draft-to-target id map
            f"model.draft_vocab_size: a pruned draft exports only with export.format: dspine, "
            f"not {config.export.format.value}")
    if config.model.warm_start_layers is not None and config.model.init_from:
        raise ConfigError("model.warm_start_layers and model.init_from are two init sources for "
                          "the draft: set one of them")
    if config.data.target_topk < 0:
        raise ConfigError(f"data.target_topk must be >= 0, got {config.data.target_topk}")
    _check_push(config)
    if config.model.target_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(
            "model.target_dtype must be 'bfloat16', 'float16' or 'float32', "
            f"got {config.model.target_dtype!r}"
        )


def _check_dflash_export(model: ModelConfig) -> None:
    """`export.format: dflash` writes only a DFlash draft: `model.method: dflash` (or a recipe
    that sets DFlash's network and decode field by field)."""
    overrides = model.draft_overrides()
    if overrides.get("method") == "dflash":
        return
    if overrides.get("method") == "dspark":
        raise ConfigError(
            "export.format: dflash needs model.method: dflash (a DSpark draft's anchor slot "
            "predicts and its Markov and confidence heads have no place in the DFlash format) "
            "- use export.format: dspine, then `python -m dspine_train.export` with --format "
            "speculators or deepspec for vLLM and SGLang"
        )
    if overrides.get("method") == "domino":
        raise ConfigError(
            "export.format: dflash needs model.method: dflash (a Domino draft's GRU and "
            "logit-delta MLP have no place in the DFlash format) - use export.format: dspine, "
            "then `python -m dspine_train.export` with --format specforge for SGLang")
    if overrides.get("method") == "dflash2":
        raise ConfigError(
            "export.format: dflash needs model.method: dflash (a DFlash2 draft's convolutions "
            "and candidate selector have no place in the DFlash format) - use export.format: "
            "dspine, then `python -m dspine_train.export` with --format speculators for vLLM "
            "and SGLang"
        )
    dflash = METHOD_PRESETS["dflash"]
    differ = [f"model.{name}" for name in ("injection", "block_attention", "transition_cache")
              if overrides.get(name) != dflash[name]]
    if differ:
        raise ConfigError(
            "export.format: dflash needs model.method: dflash (this recipe trains a DSpine draft: "
            f"{', '.join(differ)} not DFlash's); DFlash loaders would drop its injection "
            "weights and run another network - use export.format: dspine"
        )


def _check_push(config: TrainConfig) -> None:
    """`export.push_*`: a valid repository id, a Hub id for a local target, a usable endpoint
    and timeout, a format the Hub upload publishes; checked before any training."""
    export = config.export
    if export.push_to_hub is None:
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from ..model_card import hub_base_model

    try:
        validate_repo_id(export.push_to_hub)
    except HFValidationError as err:
        raise ConfigError(f"export.push_to_hub {export.push_to_hub!r}: not a Hub repository id "
                          f"(ORG/NAME): {err}") from None
    if "/" not in export.push_to_hub:
        raise ConfigError(f"export.push_to_hub {export.push_to_hub!r}: give the namespace too "
                          "(ORG/NAME or USER/NAME)")
    if export.format != ExportFormat.dspine:
        raise ConfigError(f"export.push_to_hub: the Hub upload publishes a dspine-format export "
                          f"(its model card reads the dspine config), not "
                          f"export.format: {export.format.value}")
    if export.push_target_id is not None and hub_base_model(export.push_target_id) is None:
        raise ConfigError(f"export.push_target_id {export.push_target_id!r}: not a Hub model id "
                          "(ORG/NAME)")
    target = config.model.target_path
    local_target = config.model.tiny_random_target or hub_base_model(target) is None
    if export.push_target_id is None and local_target:
        raise ConfigError(
            f"export.push_target_id: model.target_path {target!r} is a local path, which is "
            "never uploaded; give the target's Hub id (export.push_target_id=ORG/NAME) for the "
            "uploaded config.json and the model card")
    if not (math.isfinite(export.push_timeout) and export.push_timeout > 0):
        raise ConfigError(f"export.push_timeout must be a positive number of seconds, "
                          f"got {export.push_timeout}")
    if export.push_endpoint is not None:
        url = urlsplit(export.push_endpoint)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"export.push_endpoint {export.push_endpoint!r}: not an http(s) URL")
