"""The variants of the ablation study (METHOD 2.5): each is DSpine with one part switched off.

A variant is a set of `DSpineConfig` switches applied on top of the recipe. Most are trained;
a decode-time switch (`transition_cache`) needs no training of its own: it reuses another
variant's weights with the switch flipped in the exported `config.json`, which is exactly what
the switch means (the weights are the same, only the decode differs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One row of the ablation table.

    Attributes:
        name: the row's name (also its output directory).
        description: what the row measures, in a few words.
        switches: `DSpineConfig` fields set for this variant (recipe `model.<field>` overrides
            when trained, `config.json` edits when derived).
        reuse: None to train; else the variant whose trained weights this row decodes with its
            own `switches` written into the exported config.
    """

    name: str
    description: str
    switches: dict[str, Any] = field(default_factory=dict)
    reuse: str | None = None

    @property
    def trained(self) -> bool:
        """Whether the variant has a training run of its own."""
        return self.reuse is None

    def hydra_overrides(self) -> list[str]:
        """`model.<field>=<value>` overrides of `train.py` for this variant's switches."""
        return [f"model.{key}={_hydra_value(value)}" for key, value in self.switches.items()]


def _hydra_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it (booleans lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# Order is the table's order. `dflash` is the reference DFlash draft (`method: dflash`, METHOD 1):
# no injection, bidirectional block attention, per-slot decode, and none of DSpine's extra terms
# (the cosine alignment would still pull its readouts - and so the backbone - towards the token
# codes, and the refinement term would add a candidate CE over the same logits); its export
# loads in z-lab's `dflash` client. The backbone objective (label CE + distillation, METHOD 2.3) is
# kept, so the row isolates what DSpine adds.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "dflash",
            "plain DFlash (method: dflash): no injection, bidirectional block, per-slot argmax, "
            "no DSpine terms",
            {"method": "dflash"},
        ),
        Variant("dspine", "full DSpine (the recipe as is)"),
        Variant("dspine_no_cosine", "DSpine without the cosine alignment term",
                {"alignment_weight": 0.0}),
        Variant("dspine_token_ce", "DSpine + full-vocabulary CE on intermediate layers",
                {"token_ce_intermediate": True}),
        Variant("dspine_no_tcache", "dspine's weights decoded by per-slot argmax (no retraining)",
                {"transition_cache": False}, reuse="dspine"),
    )
}


def select_variants(names: list[str] | None) -> list[Variant]:
    """The variants to run, in table order; a derived variant pulls in the one it reuses.

    Raises `ValueError` naming an unknown variant and listing the known ones.
    """
    if not names:
        return list(VARIANTS.values())
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    wanted = set(names)
    for name in names:
        if VARIANTS[name].reuse:
            wanted.add(VARIANTS[name].reuse)
    return [v for v in VARIANTS.values() if v.name in wanted]
