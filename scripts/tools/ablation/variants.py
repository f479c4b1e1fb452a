"""The variants of the studies (METHOD 2.5): DSpine, DFlash, and DSpine with one part changed.

A variant is the recipe plus `train.py` Hydra overrides, listed here, in this one place. Most
are trained; a decode-time switch (`transition_cache`) needs no training of its own: it reuses
another variant's weights with its `model.<field>` overrides written into the exported
`config.json`, which is exactly what the switch means (the same weights, another decode).

Two studies pick their rows from the one registry: the ablation (`scripts/ablate.py`,
`ABLATION`) and the training study (`scripts/study.py`, `STUDY`, whose optional rows run
only when named). An override whose key the training schema does not have fails the study
before anything trains, naming the variant and the key (`study.check_variant_overrides`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One row of a study.

    Attributes:
        name: the row's name (also its output directory).
        description: what the row measures, in a few words.
        overrides: `train.py` Hydra overrides on top of the study's shared ones (applied last,
            so they win).
        reuse: None to train; else the variant whose trained weights this row decodes with its
            own `model.<field>` overrides written into the exported config.
    """

    name: str
    description: str
    overrides: tuple[str, ...] = ()
    reuse: str | None = None

    @property
    def trained(self) -> bool:
        """Whether the variant has a training run of its own."""
        return self.reuse is None

    def hydra_overrides(self) -> list[str]:
        """The variant's `train.py` overrides."""
        return list(self.overrides)

    def switches(self) -> dict[str, Any]:
        """The `DSpineConfig` fields the variant sets (its `model.<field>` overrides), typed as
        Hydra reads them: the edits a derived variant writes into its `config.json`."""
        from omegaconf import OmegaConf

        model = [o for o in self.overrides if o.startswith("model.")]
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist(model))
        return dict(parsed.get("model", {})) if isinstance(parsed, dict) else {}


# SpecForge's published DSpine settings and objective: the `specforge_published` preset
# (recipes/preset/, from its `configs/qwen3-8b-dspine.json`): transfer rank 1024 capped at the
# target's hidden size (896 for Qwen2.5-0.5B), message 512, K 16, gamma 7, alignment warm-up
# 146 steps, 3 replacement layers, refinement over all supervised slots, readouts from the
# unwhitened directions, Adam betas 0.9/0.999; the draft size stays the recipe's.
SPECFORGE_PUBLISHED = ("preset=specforge_published",)

# Size of the pruned draft vocabulary (EAGLE-3 / SpecForge use 32k for 150k-token targets).
PRUNED_VOCAB = 32768

# `model.warm_start_layers` of the warm-start variant: the demo target's (24 layers) last two,
# one per layer of the demo's 2-layer draft (recipes/model/qwen2.5_coder_0.5b.yaml).
WARM_START_LAYERS = (22, 23)

# `dflash` is the reference DFlash draft (`method: dflash`, METHOD 1): no injection,
# bidirectional block attention, per-slot decode, and none of DSpine's extra terms (the cosine
# alignment would still pull its readouts - and so the backbone - towards the token codes, and
# the refinement term would add a candidate CE over the same logits); its export loads in
# z-lab's `dflash` client. The backbone objective (label CE + distillation, METHOD 2.3) is
# kept, so the row isolates what DSpine adds.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("dspine", "DSpine, the recipe's settings"),
        Variant("dspine_specforge", "DSpine with SpecForge's published DSpine settings",
                SPECFORGE_PUBLISHED),
        Variant("dflash", "DFlash baseline: bidirectional block, no injection, per-slot "
                "argmax, no DSpine terms", ("model.method=dflash",)),
        Variant("dspine_no_alignment", "DSpine without the cosine alignment term",
                ("model.alignment_weight=0.0",)),
        Variant("dspine_no_replacement", "DSpine without the replacement curriculum "
                "(no block is replaced: p = 0 throughout)", ("model.replacement_probability=0.0",)),
        Variant("dspine_pruned_vocab", f"DSpine with a pruned {PRUNED_VOCAB}-token draft "
                "vocabulary", (f"model.draft_vocab_size={PRUNED_VOCAB}",)),
        Variant("dspine_token_ce", "DSpine + full-vocabulary CE on intermediate layers",
                ("model.token_ce_intermediate=true",)),
        Variant("dspine_no_tcache", "dspine's weights decoded by per-slot argmax (no retraining)",
                ("model.transition_cache=false",), reuse="dspine"),
        # the study trains in bf16 (bf16 draft, fp32 master weights: `--precision`); this row
        # measures what that costs against fp32: its step costs over twice bf16's on a CPU
        # (`study.py steps` measures it); a paired 150-step check is in docs/results/fast_step/
        Variant("dspine_fp32", "DSpine trained in fp32 (the other rows: bf16)",
                ("precision=fp32",)),
        # the draft's layers start as copies of the target's last two layers (the ones that
        # turn deep states into the head's input, as the draft's layers must)
        Variant("dspine_warm_start", "DSpine with its 2 layers warm-started from target "
                f"layers {WARM_START_LAYERS}",
                (f"model.warm_start_layers=[{','.join(map(str, WARM_START_LAYERS))}]",)),
        # The other methods, on the recipe's backbone, block size, data, steps and seed: each
        # is its `method` preset (modeling/method_presets.py), nothing else changed.
        Variant("dspark", "DSpark (DeepSpec): the anchor slot predicts too, Markov and "
                "confidence heads", ("model.method=dspark",)),
        Variant("dflash2", "DFlash2 (z-lab; speculators' objective): grouped dynamic causal "
                "convolutions and a candidate selector", ("model.method=dflash2",)),
        Variant("domino", "Domino (SpecForge): a GRU logit correction over the block's previous "
                "tokens", ("model.method=domino",)),
    )
}
# The methods DSpine is compared with (the training study's method rows, run when named).
METHODS = ("dspark", "dflash2", "domino")

# The reference of every paired difference.
REFERENCE = "dspine"


@dataclass(frozen=True)
class Study:
    """Which variants a study shows, in its table's order.

    Attributes:
        rows: every row of the study, in order.
        optional: rows run only when named (`--variants`); the longest ones to train.
    """

    rows: tuple[str, ...]
    optional: tuple[str, ...] = ()

    def default(self) -> list[str]:
        """The rows run when none is named."""
        return [name for name in self.rows if name not in self.optional]

    def select(self, names: Sequence[str] | None) -> list[Variant]:
        """The variants to run, in table order: the given names (a derived variant pulls in
        the one it reuses), or the default rows.

        Raises `ValueError` naming an unknown variant and listing the known ones.
        """
        if not names:
            return [VARIANTS[name] for name in self.default()]
        unknown = [n for n in names if n not in self.rows]
        if unknown:
            raise ValueError(f"--variants: unknown variant(s) {unknown}; known: "
                             f"{list(self.rows)}")
        wanted = set(names) | {VARIANTS[n].reuse for n in names if VARIANTS[n].reuse}
        return [VARIANTS[name] for name in self.rows if name in wanted]


# The ablation (`scripts/ablate.py`): what DSpine adds over DFlash, one part at a time.
ABLATION = Study(("dflash", "dspine", "dspine_no_alignment", "dspine_token_ce",
                  "dspine_no_tcache"))
# The training study (`scripts/study.py`, docs/STUDY.md): `dspine` first, the reference.
STUDY = Study(("dspine", "dspine_specforge", "dflash", *METHODS, "dspine_no_alignment",
               "dspine_no_replacement", "dspine_pruned_vocab", "dspine_fp32",
               "dspine_warm_start"), optional=("dspine_fp32", "dspine_warm_start", *METHODS))


def variant_named(name: str | None) -> Variant:
    """The registered variant `name`; `ValueError` naming it otherwise."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {list(VARIANTS)}")
    return VARIANTS[name]
