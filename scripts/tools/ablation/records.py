"""The studies' records, typed: what an evaluation found and what a report row shows.

Each record is written as JSON (`to_json`) and read back (`from_json`), so the files stay plain
JSON with the keys the committed results under `docs/results/` have: a study record archived
there reads back as the same record. The figures inside (the simulated acceptance of
`BlockResults.summary`, the harness's `BenchResult`s, the loss terms, the learning curve) stay
the JSON objects those producers write; the records give each its name and type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# the trailing fields a record carries only when known (left out of its JSON otherwise, as the
# records written before were)
_OPTIONAL = ("request", "session", "paired_vs_reference", "paired_curve")


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """`data` restricted to `cls`'s fields (a record written by another version may carry
    more; the missing ones take their defaults)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class Session:
    """One training session of a run (`sessions.json`): its start and end (time.time()); a
    killed session has no end until the next session closes it at its last metrics line."""

    start: float
    end: float | None = None
    killed: bool = False

    def to_json(self) -> dict[str, Any]:
        """The session as JSON values (`killed` only when it was)."""
        data = asdict(self)
        if not self.killed:
            del data["killed"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Session:
        """The session of `to_json`'s output."""
        return cls(**_known(cls, data))


@dataclass
class Evaluation:
    """One export's measured acceptance, cached beside its run (`evaluation.json` of the
    ablation, `result.json` of the study) and reused only for the same weights and request.

    Attributes:
        weights_mtime_ns: the evaluated `model.safetensors`'s modification time.
        simulated: the simulated acceptance (tau, per-position rates, blocks, SEs, wall_s);
            None when the run has no held-out split.
        engine: the evaluation harness's `BenchResult`s, as JSON objects.
        engine_wall_s: wall time of the engine evaluation.
        request: the engine-evaluation settings it answers (`StudySettings.evaluation_request`).
    """

    weights_mtime_ns: int
    simulated: dict[str, Any] | None
    engine: list[dict[str, Any]]
    engine_wall_s: float | None = None
    request: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Evaluation:
        """The record of `to_json`'s output."""
        return cls(**_known(cls, data))


@dataclass
class RunBudget:
    """What a training run was given, read back from its own saved config."""

    dir: str
    recipe: str
    steps: int
    seed: int
    train_path: str
    offline_features_dir: str | None
    batch_size: int
    num_anchors: int
    max_length: int
    lr: float
    precision: str

    def key(self) -> tuple[Any, ...]:
        """Everything but the directory and recipe name: equal for runs of one budget."""
        return tuple(v for k, v in asdict(self).items() if k not in ("dir", "recipe"))


@dataclass
class AblationRow:
    """One row of the ablation table (`runner.collect_row`)."""

    variant: str
    description: str
    switches: dict[str, Any]
    trained: bool
    reuse: str | None
    run: RunBudget
    train_wall_s: float | None
    resumed_from_step: int
    final_losses: dict[str, float]
    trainer_sim_tau: float | None
    simulated: dict[str, Any] | None
    paired_vs_dspine: dict[str, float] | None
    engine: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """The row as JSON values."""
        return asdict(self)


@dataclass
class StudyRecord:
    """Everything the study's report shows about one finished variant (`study.variant_record`);
    archived with the request it answers and the session that made it, and shown with its
    paired differences to the reference (`study.with_pairs`)."""

    variant: str
    description: str
    overrides: list[str]
    steps: int
    seed: int
    batch_size: int
    block_size: int
    train_wall_s: float | None
    sessions: int
    final_losses: dict[str, float]
    curve: list[dict[str, Any]]
    simulated: dict[str, Any]
    engine: list[dict[str, Any]]
    precision: str | None = None
    engine_wall_s: float | None = None
    request: dict[str, Any] | None = None
    session: dict[str, Any] | None = None
    paired_vs_reference: dict[str, Any] | None = None
    paired_curve: dict[str, dict[str, float]] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values, in the key order of the archived records."""
        data = asdict(self)
        order = ["variant", "description", "overrides", "steps", "seed", "batch_size",
                 "precision", "block_size", "train_wall_s", "sessions", "final_losses", "curve",
                 "simulated", "engine", "engine_wall_s", *_OPTIONAL]
        return {k: data[k] for k in order if not (k in _OPTIONAL and data[k] is None)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StudyRecord:
        """The record of `to_json`'s output (or of an archived `record.json`)."""
        return cls(**_known(cls, data))
