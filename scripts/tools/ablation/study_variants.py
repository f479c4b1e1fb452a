"""The variants of the training study, as Hydra override lists.

Every variant trains on the same target, data, steps, batch and seed; a variant is the demo
recipe (`recipes/recipe/qwen2.5_coder_0.5b.yaml`) plus the `train.py` overrides listed here,
in this one place. An override whose key the training schema does not have fails the study
before anything trains, naming the variant and the key (`study.check_variant_overrides`), so a
setting that is not merged yet can never silently train the default.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StudyVariant:
    """One row of the study.

    Attributes:
        name: the row's name (also its output directory).
        description: what the row measures, in a few words.
        overrides: `train.py` Hydra overrides on top of the study's shared ones.
        optional: left out unless asked for by name (`--variants`).
    """

    name: str
    description: str
    overrides: tuple[str, ...] = ()
    optional: bool = False

    @property
    def trained(self) -> bool:
        """Every study variant trains (the ablation runner's interface)."""
        return True

    def hydra_overrides(self) -> list[str]:
        """The variant's `train.py` overrides (applied last, so they win)."""
        return list(self.overrides)


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

# Order is the report's order; `dspine` is the reference of every paired difference.
STUDY_VARIANTS: dict[str, StudyVariant] = {
    v.name: v
    for v in (
        StudyVariant("dspine", "DSpine, the demo recipe's settings"),
        StudyVariant("dspine_specforge", "DSpine with SpecForge's published DSpine settings",
                     SPECFORGE_PUBLISHED),
        StudyVariant("dflash", "DFlash baseline: bidirectional block, no injection, per-slot "
                     "argmax, no DSpine terms", ("model.method=dflash",)),
        StudyVariant("dspine_no_alignment", "DSpine without the cosine alignment term",
                     ("model.alignment_weight=0.0",)),
        StudyVariant("dspine_no_replacement", "DSpine without the replacement curriculum "
                     "(no block is replaced: p = 0 throughout)", ("model.replacement_probability=0.0",)),
        StudyVariant("dspine_pruned_vocab", f"DSpine with a pruned {PRUNED_VOCAB}-token draft "
                     "vocabulary", (f"model.draft_vocab_size={PRUNED_VOCAB}",)),
        # the study trains in bf16 (bf16 draft, fp32 master weights: `--precision`); this row
        # measures what that costs against fp32. Optional: its step costs over twice bf16's on a
        # CPU (`study.py steps` measures it), the longest row to train; a paired 150-step check
        # is in docs/results/fast_step/
        StudyVariant("dspine_fp32", "DSpine trained in fp32 (the other rows: bf16)",
                     ("precision=fp32",), optional=True),
        # optional: the draft's layers start as copies of the target's last two layers (the
        # ones that turn deep states into the head's input, as the draft's layers must)
        StudyVariant("dspine_warm_start", "DSpine with its 2 layers warm-started from target "
                     f"layers {WARM_START_LAYERS}",
                     (f"model.warm_start_layers=[{','.join(map(str, WARM_START_LAYERS))}]",),
                     optional=True),
    )
}
REFERENCE = "dspine"


def select_study_variants(names: list[str] | None) -> list[StudyVariant]:
    """The variants to run, in report order: the given names, or every non-optional one.

    Raises `ValueError` naming an unknown variant and listing the known ones.
    """
    if not names:
        return [v for v in STUDY_VARIANTS.values() if not v.optional]
    unknown = [n for n in names if n not in STUDY_VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown variant(s) {unknown}; known: "
                         f"{list(STUDY_VARIANTS)}")
    return [v for v in STUDY_VARIANTS.values() if v.name in names]
