"""`DSpineConfig`: the configuration of a DSpine draft model (METHOD sections 1-2.5).

A draft is always made for one target: its width, head layout, RoPE and vocabulary are the
target's, and `DSpineConfig.from_target` derives them from any Hugging Face causal-LM config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from huggingface_hub.dataclasses import type_validator
from transformers import PreTrainedConfig

from .config_checks import check_settings
from .mask_token import check_mask_token, pick_mask_token_id
from .method_presets import (
    ANCHOR_PREDICTING_METHODS,
    DOMINO_METHOD,
    METHOD_FREE_FIELDS,
    METHOD_PRESETS,
)

# Families whose input embedding is scaled by sqrt(hidden_size) (transformers'
# `Gemma3TextScaledWordEmbedding`, `embed_scale`): the draft embeds its block tokens the same way.
_SCALED_EMBEDDING_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the draft (METHOD 1), 0-based.

    For N > 1 draft layers: `round(1 + i * (L - 4) / (N - 1))`, i = 0..N-1 (layers 1, 9, 17, 25,
    33 for L = 36, N = 5); for N = 1 the middle layer.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# Blocks of config.json that the exports derive from the fields (`dspine_train.formats`); they
# are written for other tools to read and dropped on load (the top-level fields are the truth).
DERIVED_BLOCKS: tuple[str, ...] = ("dflash_config", "dspine_config", "num_target_layers")


def _rope_parameters_of(config: PreTrainedConfig) -> dict[str, Any]:
    """RoPE settings of a target config, whichever transformers convention it uses."""
    params = getattr(config, "rope_parameters", None)
    if params and "full_attention" in params:
        # Per-layer-type RoPE (Gemma-3: sliding and full layers); the draft's layers attend
        # over the whole context, as the target's full-attention layers do.
        return dict(params["full_attention"])
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    return scaling


# How a field type reads in an error message (a JSON user's words, not Python's).
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true/false", str: "a string",
               dict: "an object", list: "a list", type(None): "null"}


def _describe_type(kind: Any) -> str:
    """`kind` (a field annotation) in words: `int | None` -> "an integer or null"."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(arg) for arg in args)
    if origin is list and args:
        return f"a list of {_describe_type(args[0]).split(' ', 1)[1]}s"
    return _TYPE_WORDS.get(origin or kind, str(kind))


def _accepts_float(kind: Any) -> bool:
    """Whether annotation `kind` admits a float (`float`, `float | None`)."""
    return kind is float or float in typing.get_args(kind)


def _is_choice(kind: Any) -> bool:
    """Whether annotation `kind` is a `Literal` (or a `Literal | None`)."""
    return Literal in (typing.get_origin(kind), *map(typing.get_origin, typing.get_args(kind)))


class DSpineConfig(PreTrainedConfig):
    r"""Configuration of a DSpine draft (a DFlash block drafter with adjacent injection).

    Architecture fields mirror the target (`hidden_size`, heads, `head_dim`, `intermediate_size`,
    `rope_parameters`, `vocab_size`, `embed_scale`: the factor the target multiplies its input
    embeddings by, sqrt(hidden_size) for Gemma); `from_target` fills them in (`target_fields`). The other
    fields (`draft_fields()`: the draft and objective fields below, `attention_bias`,
    `initializer_range`) are the draft's own; their defaults here are the only ones (the
    training recipe schema derives its `model.<field>` settings from them) and describe the
    published Qwen3-8B draft.

    Draft fields:
        num_layers: number of draft decoder layers N.
        target_layer_ids: 0-based target layers whose *outputs* form the context features.
        target_num_layers: depth L of the target, kept to validate `target_layer_ids`.
        block_size: block length B (slot 0 is the anchor, slots 1..B-1 are drafted; with
            `method: dspark` every slot drafts, slot k predicting token a+k+1).
        mask_token_id: an unused vocabulary id that fills slots 1..B-1 of the block input.
        method: "dspine", "dflash" (the reference DFlash network), "dspark" (DeepSpec's
            DSpark: the DFlash backbone whose anchor slot predicts too, plus the Markov and
            confidence heads), "domino" (SpecForge's Domino: the DFlash backbone plus a GRU
            logit correction, `domino_head.py`) or "dflash2" (z-lab's DFlash2: DFlash's layout
            with grouped dynamic causal convolutions in every layer and a candidate selector).
            `METHOD_PRESETS` gives each method's `injection`,
            `block_attention`, `transition_cache`, `refine_weight`, `alignment_weight`,
            `token_ce_intermediate` and DSpark head settings; a method refuses another value
            for the fields it fixes (`METHOD_FREE_FIELDS`: those it leaves open). These fields
            default to None ("the method's value").
        block_attention: "causal" (DSpine) or "bidirectional" (DFlash) attention inside a block.
        sliding_window: W, every layer's window (z-lab's `sliding_attention` layers): a query
            at position p sees the context positions j with p - j < W; None sees all of them.
        injection: gated adjacent injection (METHOD 2.2); False alone is DSpine without injection
            (`method: dflash` is plain DFlash).
        transfer_dim: r, the dimension of the token codes / prediction features.
        message_size: width of the shared message M (r -> message_size).
        replacement_layers: the first layers that use true predecessor codes for the blocks
            chosen by the replacement curriculum (METHOD 2.2: 3).
        replacement_probability: p, the share of blocks the curriculum gives true predecessor
            codes while it holds (METHOD 2.2: 0.5).
        replacement_hold_ratio: share of training during which the share stays at p (1/6).
        replacement_end_ratio: share of training at which the share has fallen linearly to 0
            (1/3); the schedule is `training.curriculum.replacement_share`.
        readout_init: how the readouts R_l start (METHOD 2.1): "whitened" (ours: a hidden state's
            feature is its whitened position, diag(1/sqrt(eigenvalues)) directions^T) or
            "directions" (SpecForge: the unwhitened directions^T).
        transition_cache: decode with the (B-1) x K x K transition cache (METHOD 2.4); False decodes
            each slot by its own argmax.
        candidate_k: K, candidates per slot for refinement and the transition cache.
        draft_vocab_size: N, a pruned draft vocabulary (EAGLE-3 / SpecForge style): the draft
            scores only N target ids, held in the `d2t` buffer (draft id i is target id
            i + d2t[i]); None scores the target's whole vocabulary. Verification always uses
            the target's full vocabulary, so decoding stays lossless.
        markov_rank: r of DSpark's Markov head (`markov_w1` Embedding(V, r), `markov_w2`
            Linear(r, V)); 0 drops the head. `method: dspark` only (256 there).
        markov_head_type: the Markov head variant; "vanilla" (first order: W2 W1[x_{k-1}] added
            to slot k's logits) is the one implemented (the one vLLM serves).
        enable_confidence_head: DSpark's per-slot acceptance predictor Linear(H (+ r), 1).
        confidence_head_with_markov: the confidence head reads [hidden ; W1[previous token]]
            (needs markov_rank > 0) rather than the hidden state alone.
        domino_emb_dim: `method: domino`: width of the logit-delta MLP `embed_proj`
            (Linear(H + G, emb_dim), SiLU, Linear(emb_dim, V); SpecForge's `emb_dim`, 256).
        domino_gru_hidden_dim: G, the hidden size of Domino's GRU over the embeddings of the
            tokens before each drafted slot (SpecForge's `gru_hidden_dim`, 1024).
        domino_prefix_len: the first drafted tokens of a block that keep the backbone's logits
            (no GRU correction; SpecForge's `pure_draft_prefix_len`).
        domino_shift_label: the anchor slot predicts too (slot k predicts token a+k+1, B drafts a
            block, as DSpark) instead of same-position labels (SpecForge's `shift_label`).
        conv_kernel_size: `method: dflash2`: taps of the grouped dynamic causal convolution
            around each layer's attention and MLP (2); 0 for the other methods.
        conv_group_size: `method: dflash2`: hidden channels sharing one dynamic kernel (16).
        selector_rank: `method: dflash2`: rank of the candidate selector (256).
        selector_top_k: `method: dflash2`: candidates per slot the selector reranks (16); also
            the K a sampling walk draws among.
    Objective fields (read by `dspine_train.objective`):
        loss_gamma: decay of the per-slot weight `exp(-(k-1)/gamma)`.
        ce_weight: c, share of label CE in the backbone and refinement terms (rest is L1 distill).
        distill: False trains on label CE only.
        refine_weight: weight of the refinement term (0 disables it).
        alignment_weight: beta of the layer-wise cosine alignment (0 disables it).
        alignment_warmup_steps: steps over which beta rises linearly to `alignment_weight`.
        alignment_layer_reduction: how the per-layer alignment terms combine: "sum" (METHOD 2.3
            and SpecForge: every layer adds its own term) or "mean" (drafts trained before this
            field existed: the sum divided by the number of layers).
        refine_normalization: what the refinement terms are averaged over: "covered" (ours: the
            CE over the weights of slots whose label is among the candidates, the L1 over those
            where the target's candidate mass passes the threshold) or "supervised"
            (SpecForge: over the weights of every supervised slot, the others adding zero).
        token_ce_intermediate: ablation switch, full-vocabulary CE after every layer.
        distill_mass_threshold: refinement L1 only where the target puts more than this mass
            on the candidates.
        confidence_weight: `method: dspark`: weight of the confidence head's BCE against each
            slot's acceptance 1 - ||p_draft - p_target||_1 / 2 (DeepSpec: 1.0).
        domino_lambda_start, domino_lambda_decay_ratio: `method: domino`: the base-logits CE
            weight l of `(1 - l) CE(final) + l CE(base)` starts at `domino_lambda_start` and falls
            linearly to 0 at `domino_lambda_decay_ratio` of training (SpecForge's
            `lambda_base_start` 1.0 and `lambda_base_decay_ratio` 0.5; its Qwen3-8B run: 1.0).
        selector_weight: `method: dflash2`: weight of the selector's K-way CE beside the unary
            KL (speculators' `selector_loss_alpha`: 1.0).
    Target identity (for validation and model cards):
        target_name_or_path, target_model_type, target_vocab_size (tokenizer length).
    """

    model_type: ClassVar[str] = "dspine"
    # Fields `from_target` takes from the target (`target_derived_fields`); a recipe never
    # sets them.
    target_fields: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "max_position_embeddings", "rope_parameters", "target_num_layers",
        "target_name_or_path", "target_model_type", "target_vocab_size", "embed_scale",
    )
    # Fields added after drafts were first exported, with the value every older export had
    # (all of them were made for unscaled targets, and were DSpine drafts with their switches
    # as saved); any other missing field is an error.
    # The objective settings added later get the values those drafts were trained with (the
    # fixed curriculum, layer-averaged alignment, covered-slot refinement, whitened readouts).
    added_fields: ClassVar[dict[str, Any]] = {
        "embed_scale": 1.0, "method": "dspine",
        "replacement_probability": 0.5, "replacement_hold_ratio": 1 / 6,
        "replacement_end_ratio": 1 / 3, "readout_init": "whitened",
        "alignment_layer_reduction": "mean", "refine_normalization": "covered",
        "draft_vocab_size": None, "markov_rank": None, "markov_head_type": None,
        "enable_confidence_head": None, "confidence_head_with_markov": None,
        "confidence_weight": 1.0, "domino_emb_dim": None, "domino_gru_hidden_dim": None,
        "domino_prefix_len": None, "domino_shift_label": None, "domino_lambda_start": 1.0,
        "domino_lambda_decay_ratio": 0.5, "conv_kernel_size": None, "conv_group_size": None,
        "selector_rank": None, "selector_top_k": None, "selector_weight": 1.0,
        "sliding_window": None,
    }
    # Kept for the PreTrainedConfig convention only: the draft has no embedding or head of its
    # own to tie (it borrows the target's).
    fixed_fields: ClassVar[tuple[str, ...]] = ("tie_word_embeddings",)

    # Architecture mirrored from the target.
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    rope_parameters: dict | None = None
    # The factor the target multiplies its input embeddings by (Gemma: sqrt(hidden_size)).
    embed_scale: float = 1.0
    attention_bias: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    # Draft structure.
    num_layers: int = 5
    target_layer_ids: list[int] | None = None
    target_num_layers: int = 36
    block_size: int = 16
    mask_token_id: int | None = None
    method: Literal["dspine", "dflash", "dspark", "domino", "dflash2"] = "dspine"
    block_attention: Literal["causal", "bidirectional"] | None = None
    sliding_window: int | None = None

    # DSpine parts (METHOD 2.1-2.4).
    injection: bool | None = None
    transfer_dim: int = 1024
    message_size: int = 512
    replacement_layers: int = 3
    replacement_probability: float = 0.5
    replacement_hold_ratio: float = 1 / 6
    replacement_end_ratio: float = 1 / 3
    readout_init: Literal["whitened", "directions"] = "whitened"
    transition_cache: bool | None = None
    candidate_k: int = 16
    draft_vocab_size: int | None = None

    # DSpark's heads (`markov_head.py`).
    markov_rank: int | None = None
    markov_head_type: Literal["vanilla", "gated", "rnn"] | None = None
    enable_confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None

    # Domino's GRU logit correction (`domino_head.py`).
    domino_emb_dim: int | None = None
    domino_gru_hidden_dim: int | None = None
    domino_prefix_len: int | None = None
    domino_shift_label: bool | None = None
    # DFlash2's convolutions and candidate selector (`dflash2_layers.py`, `candidate_selector.py`).
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    # Objective (METHOD 2.3).
    loss_gamma: float = 7.0
    ce_weight: float = 0.1
    distill: bool = True
    refine_weight: float | None = None
    alignment_weight: float | None = None
    alignment_warmup_steps: int = 150
    alignment_layer_reduction: Literal["sum", "mean"] = "sum"
    refine_normalization: Literal["covered", "supervised"] = "covered"
    token_ce_intermediate: bool | None = None
    distill_mass_threshold: float = 1e-4
    confidence_weight: float = 1.0
    domino_lambda_start: float = 1.0
    domino_lambda_decay_ratio: float = 0.5
    selector_weight: float = 1.0

    # Target identity.
    target_name_or_path: str | None = None
    target_model_type: str | None = None
    target_vocab_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.check_field_types()
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.target_num_layers, self.num_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.apply_method()
        for name in DERIVED_BLOCKS:  # written by the exports, derived from the fields
            kwargs.pop(name, None)
        super().__post_init__(**kwargs)
        self.check_consistency()

    def apply_method(self) -> None:
        """Fill the fields `method` fixes or presets (`METHOD_PRESETS`) that are unset;
        `ValueError` naming every field set against a value the method fixes."""
        if self.method not in METHOD_PRESETS:
            raise ValueError(f"method must be one of {sorted(METHOD_PRESETS)}, got {self.method!r}")
        preset = dict(METHOD_PRESETS[self.method])
        if self.method == "dspark":
            # The confidence head reads the Markov embedding by default only where both exist.
            with_markov = self.enable_confidence_head is not False and self.markov_rank != 0
            preset["confidence_head_with_markov"] = with_markov
        free = METHOD_FREE_FIELDS[self.method]
        conflicts = []
        for name, value in preset.items():
            current = getattr(self, name)
            if current is None:
                setattr(self, name, value)
            elif name not in free and current != value:
                conflicts.append(f"{name}={current!r} ({self.method}: {value!r})")
        if conflicts:
            what = {"dflash": "the reference DFlash draft",
                    "dspark": "DSpark (the DFlash backbone with its Markov and confidence heads)",
                    "domino": "Domino (the DFlash backbone with its GRU logit correction)",
                    "dflash2": "DFlash2 (the DFlash backbone with its convolutions and candidate "
                               "selector)",
                    "dspine": "DSpine (DSpark's heads belong to method: dspark)"}[self.method]
            raise ValueError(
                f"method: {self.method} is {what} and fixes these fields; remove them or use "
                f"another method: {', '.join(conflicts)}"
            )

    @property
    def anchor_predicts(self) -> bool:
        """Whether the anchor slot is itself a prediction (DSpark: slot k predicts token a+k+1,
        B predictions per block) rather than the given token (slots 1..B-1 predict a+k)."""
        return self.method in ANCHOR_PREDICTING_METHODS or (
            self.method == DOMINO_METHOD and bool(self.domino_shift_label))

    @property
    def num_predictions(self) -> int:
        """Tokens one block drafts: B with an anchor that predicts, else B - 1."""
        return self.block_size if self.anchor_predicts else self.block_size - 1

    # ------------------------------------------------------------------ field groups
    @classmethod
    def own_fields(cls) -> dict[str, dataclasses.Field]:
        """The fields DSpineConfig declares (not PreTrainedConfig's), in declaration order."""
        own = [name for name, kind in DSpineConfig.__annotations__.items()
               if not str(kind).startswith("ClassVar")]
        by_name = {f.name: f for f in dataclasses.fields(DSpineConfig)}
        return {name: by_name[name] for name in own}

    @classmethod
    def draft_fields(cls) -> dict[str, dataclasses.Field]:
        """The fields a training recipe may set (`model.<name>`): every own field that is
        neither taken from the target (`target_fields`) nor fixed (`fixed_fields`). Their
        defaults here are the only defaults; the recipe schema is derived from them."""
        skip = set(cls.target_fields) | set(cls.fixed_fields)
        return {name: f for name, f in cls.own_fields().items() if name not in skip}

    @classmethod
    @functools.cache
    def field_types(cls) -> dict[str, Any]:
        """The type of each own field (`own_fields`), its annotation resolved: the table
        `check_field_types` checks values against."""
        holder = types.SimpleNamespace(
            __annotations__={name: f.type for name, f in DSpineConfig.own_fields().items()})
        return typing.get_type_hints(holder, globalns=vars(sys.modules[DSpineConfig.__module__]))

    def check_field_types(self) -> None:
        """`ValueError` naming the first field whose value is not of its declared type.

        Every way a config is made (a `config.json` read by the engine, the export or
        `model.init_from`, a recipe, a format importer) passes here once, so a wrongly typed
        value (`block_size: "8"`, `num_layers: 2.0`, `transition_cache: "yes"`) is refused by
        name where it is read, not met as a `TypeError` at decode time. A whole number where a
        float is declared is the same number (JSON writes 1.0 as 1) and becomes a float; a
        float where an integer is declared is refused even when whole (2.0), and booleans must
        be JSON's true/false. A tuple given for a list field is taken as that list.
        """
        for name, kind in self.field_types().items():
            value = getattr(self, name)
            if _accepts_float(kind) and type(value) is int:
                value = float(value)
                setattr(self, name, value)
            elif isinstance(value, tuple) and not _is_choice(kind):
                value = list(value)
                setattr(self, name, value)
            if _is_choice(kind):
                continue  # the value checks (`apply_method`, `config_checks.check_settings`) name the choices
            try:
                type_validator(name, value, kind)
            except TypeError:
                raise ValueError(f"{name} must be {_describe_type(kind)}, got "
                                 f"{json.dumps(value, default=repr)}") from None

    # ------------------------------------------------------------------ strict loading
    @classmethod
    def export_fields(cls) -> list[str]:
        """The fields every draft `config.json` holds (`save_pretrained` writes them all)."""
        return ["model_type", *cls.own_fields()]

    @classmethod
    def check_export_dict(cls, config_dict: dict[str, Any], source: str) -> None:
        """`ValueError` naming the fields an export's `config.json` lacks: a draft loads only
        with every field it was saved with (a default would silently change it: random
        layers, another block size, other context layers)."""
        missing = [name for name in cls.export_fields()
                   if name not in config_dict and name not in cls.added_fields]
        if missing:
            raise ValueError(
                f"{source}: config.json lacks {', '.join(missing)}; a DSpine draft export "
                "holds every field (re-export it, or add the fields it was trained with)"
            )
        if config_dict["model_type"] != cls.model_type:
            raise ValueError(f"{source}: config.json has model_type "
                             f"{config_dict['model_type']!r}, not {cls.model_type!r}")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike,
                        **kwargs: Any) -> DSpineConfig:
        """Load a draft config strictly: `check_export_dict` first, then as transformers does,
        a field in `added_fields` that the export lacks set to its value there."""
        config_dict, _ = cls.get_config_dict(pretrained_model_name_or_path, **dict(kwargs))
        cls.check_export_dict(config_dict, str(pretrained_model_name_or_path))
        # An older export lacks the fields added since: it gets the values it was made with.
        older = {name: value for name, value in cls.added_fields.items()
                 if name not in config_dict and name not in kwargs}
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **older, **kwargs)
        except ValueError as err:  # a wrongly typed or inconsistent field: name the file
            source = Path(pretrained_model_name_or_path)
            path = source / "config.json" if source.is_dir() else source
            raise ValueError(f"{path}: {err}") from err

    # ------------------------------------------------------------------ validation
    def check_consistency(self) -> None:
        """Raise `ValueError` naming the field when the config contradicts itself."""
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + one drafted slot), got {self.block_size}")
        if self.block_attention not in ("causal", "bidirectional"):
            raise ValueError(
                f"block_attention must be 'causal' or 'bidirectional', got {self.block_attention!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        for layer in self.target_layer_ids:
            if not 0 <= layer < self.target_num_layers:
                raise ValueError(
                    f"target_layer_ids contains {layer}, outside the target's layers "
                    f"0..{self.target_num_layers - 1} (target_num_layers={self.target_num_layers})"
                )
        if not 1 <= self.candidate_k <= self.vocab_size:
            raise ValueError(
                f"candidate_k must be in 1..vocab_size ({self.vocab_size}), got {self.candidate_k}"
            )
        if self.draft_vocab_size is not None and not (
                self.candidate_k <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(
                f"draft_vocab_size must be in candidate_k..vocab_size ({self.candidate_k}.."
                f"{self.vocab_size}), got {self.draft_vocab_size}"
            )
        if not 1 <= self.transfer_dim <= min(self.hidden_size, self.vocab_size - 1):
            raise ValueError(
                f"transfer_dim must be in 1..min(hidden_size, vocab_size - 1) = "
                f"{min(self.hidden_size, self.vocab_size - 1)}, got {self.transfer_dim}"
            )
        if self.message_size < 1:
            raise ValueError(f"message_size must be >= 1, got {self.message_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        if self.mask_token_id is not None and self.target_vocab_size is not None:
            # With rows above the tokenizer the mask is one of them; a tokenizer that uses
            # every row leaves its reserved tokens, checked against it (`validate_for_target`).
            if self.mask_token_id < self.target_vocab_size < self.vocab_size:
                raise ValueError(
                    f"mask_token_id {self.mask_token_id} is a used token id (the tokenizer uses "
                    f"0..{self.target_vocab_size - 1}); pick an id >= target_vocab_size"
                )
        if self.loss_gamma <= 0:
            raise ValueError(f"loss_gamma must be > 0, got {self.loss_gamma}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"ce_weight must be in [0, 1], got {self.ce_weight}")
        check_settings(self)

    def validate_for_target(self, target_config: PreTrainedConfig, tokenizer: Any = None) -> None:
        """Check that this draft fits `target_config` (and its tokenizer); `ValueError` names the field."""
        target_config = getattr(target_config, "text_config", None) or target_config
        checks = {
            "hidden_size": target_config.hidden_size,
            "vocab_size": target_config.vocab_size,
        }
        for field, expected in checks.items():
            if getattr(self, field) != expected:
                raise ValueError(
                    f"{field} of the draft ({getattr(self, field)}) differs from the target's ({expected})"
                )
        depth = target_config.num_hidden_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < depth]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are beyond the target's {depth} layers"
            )
        if tokenizer is not None:
            used = len(tokenizer)
            if self.target_vocab_size is not None and used != self.target_vocab_size:
                raise ValueError(
                    f"target_vocab_size of the draft ({self.target_vocab_size}) differs from the "
                    f"tokenizer's length ({used}): the draft was made for another tokenizer"
                )
            if self.mask_token_id is not None:
                check_mask_token(self.mask_token_id, tokenizer)

    # ------------------------------------------------------------------ construction
    @classmethod
    def target_derived_fields(
        cls, target_config: PreTrainedConfig, used_vocab_size: int | None
    ) -> dict[str, Any]:
        """The `target_fields` of a draft for `target_config`: its architecture (hidden size,
        heads, head dim, MLP width, RoPE, vocabulary, norm epsilon), depth and identity."""
        target_config = getattr(target_config, "text_config", None) or target_config
        model_type = getattr(target_config, "model_type", None)
        softcap = getattr(target_config, "final_logit_softcapping", None)
        if softcap is not None:
            # The distillation target is softmax(lm_head(h)); a softcapped target's is not.
            raise ValueError(
                f"final_logit_softcapping={softcap} ({model_type}): targets that softcap their "
                "logits are not supported (the draft distils the uncapped head)"
            )
        num_heads = target_config.num_attention_heads
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // num_heads
        return {
            "vocab_size": target_config.vocab_size,
            "hidden_size": target_config.hidden_size,
            "intermediate_size": target_config.intermediate_size,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or num_heads,
            "head_dim": head_dim,
            "hidden_act": getattr(target_config, "hidden_act", "silu"),
            "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
            "max_position_embeddings": getattr(target_config, "max_position_embeddings", 32768),
            "rope_parameters": _rope_parameters_of(target_config),
            "target_num_layers": target_config.num_hidden_layers,
            "target_model_type": getattr(target_config, "model_type", None),
            "target_name_or_path": getattr(target_config, "_name_or_path", None) or None,
            "target_vocab_size": used_vocab_size,
            "embed_scale": (target_config.hidden_size ** 0.5
                            if model_type in _SCALED_EMBEDDING_MODEL_TYPES else 1.0),
        }

    @classmethod
    def from_target(
        cls,
        target_config: PreTrainedConfig,
        tokenizer: Any = None,
        *,
        used_vocab_size: int | None = None,
        **overrides: Any,
    ) -> DSpineConfig:
        """Derive a draft config from a target's HF config.

        Hidden size, heads, head dim, MLP width, RoPE, vocabulary and norm epsilon are copied;
        `target_layer_ids` follow METHOD 1 for `num_layers` draft layers; `mask_token_id` is the
        first id beyond the tokenizer's used ids (`len(tokenizer)` or `used_vocab_size`), or,
        when the tokenizer uses every row, its first reserved/unused special token
        (`mask_token.pick_mask_token_id`), unless given in `overrides`. Any other field can be
        overridden.
        """
        target_config = getattr(target_config, "text_config", None) or target_config
        if tokenizer is not None:
            used_vocab_size = len(tokenizer)
        fields = cls.target_derived_fields(target_config, used_vocab_size)
        fields.update(overrides)
        num_layers = fields.setdefault("num_layers", cls.num_layers)
        if fields.get("target_layer_ids") is None:
            fields["target_layer_ids"] = default_target_layer_ids(fields["target_num_layers"], num_layers)
        if fields.get("mask_token_id") is None:
            fields["mask_token_id"] = pick_mask_token_id(fields["vocab_size"], used_vocab_size,
                                                         tokenizer)
        fields.setdefault("transfer_dim", min(cls.transfer_dim, fields["hidden_size"]))
        fields.setdefault("message_size", min(cls.message_size, fields["hidden_size"]))
        fields.setdefault("candidate_k", min(cls.candidate_k, fields["vocab_size"]))
        config = cls(**fields)
        config.validate_for_target(target_config, tokenizer)
        return config

    @property
    def num_context_layers(self) -> int:
        """n, the number of target layers concatenated into each context feature."""
        return len(self.target_layer_ids)
