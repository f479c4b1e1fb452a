"""Dependencies point one way: every import of the product's source, read with `ast`.

The product (`dspine_train/`, `data_prep/`) imports nothing from its tools (`scripts/`) or the
tests; the model imports neither the engine nor the trainer (model <- training,
model <- engine); the inference engine imports no training stack; data preparation imports
no training module and no evaluation. Evaluation lives in one package, `dspine_train/evaluation/`:
its metrics and held-out loop import neither training nor the engine, so the trainer may use
them and nothing else of the package (the benchmark harness and the parity check run the engine
and the trainer's pieces: training -> metrics <- harness, parity). Every import counts, including the ones
inside functions, so a lazy import cannot hide a dependency. What a process really loads is
checked at run time too (`test_engine_validation.py`: loading a draft and generating pulls in
no hydra / deepspeed / trainer code).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("dspine_train", "data_prep")


def imported_modules(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file at `path` (under `root`), relative imports
    resolved to absolute names. `from a import b` yields `a` and `a.b` (b may be a module)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]  # a module's package; an `__init__`'s own package
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _under(module: str, names: tuple[str, ...]) -> bool:
    """Whether `module` is one of `names` or a submodule of one."""
    return any(module == n or module.startswith(n + ".") for n in names)


@dataclass(frozen=True)
class Rule:
    """Files under `sources` (paths relative to the repository: folders or single files) import
    no module under any of `forbidden` (a module or its submodules), except those under
    `allowed`."""

    sources: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()

    def violations(self, root: Path) -> list[str]:
        """`file:line imports module` for every import against the rule."""
        found = []
        for source in self.sources:
            top = root / source
            if not top.exists():  # a renamed file must not turn its rule into a silent pass
                raise FileNotFoundError(f"layering rule source {source} does not exist")
            for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
                for line, module in imported_modules(path, root):
                    if _under(module, self.forbidden) and not _under(module, self.allowed):
                        found.append(f"{path.relative_to(root)}:{line} imports {module}")
        return sorted(set(found))


TRAINING_STACK = ("dspine_train.training", "dspine_train.objective", "hydra", "omegaconf",
                  "deepspeed", "accelerate", "datasets", "wandb")
# The evaluation modules the trainer runs; they import neither training nor the engine.
EVALUATION_CORE = ("dspine_train/evaluation/__init__.py", "dspine_train/evaluation/block_metrics.py",
                   "dspine_train/evaluation/held_out.py")
RULES = {
    "the product imports no tools": Rule(PRODUCT, ("scripts", "tests")),
    "modeling imports no training": Rule(("dspine_train/modeling",), ("dspine_train.training",)),
    "modeling imports no engine": Rule(("dspine_train/modeling",), ("dspine_train.engine",)),
    "the engine imports no training stack": Rule(("dspine_train/engine",), TRAINING_STACK),
    "data_prep imports no training module": Rule(("data_prep",), ("dspine_train.training",)),
    "data_prep imports no evaluation": Rule(("data_prep",), ("dspine_train.evaluation",)),
    "the engine imports no evaluation": Rule(("dspine_train/engine",), ("dspine_train.evaluation",)),
    "the engine imports no server": Rule(("dspine_train/engine",), ("dspine_train.serving",)),
    "the server imports no training stack or evaluation": Rule(
        ("dspine_train/serving",), (*TRAINING_STACK, "dspine_train.evaluation")),
    "evaluation metrics import no training or engine": Rule(
        EVALUATION_CORE, ("dspine_train.training", "dspine_train.engine")),
    "training imports only evaluation metrics": Rule(
        ("dspine_train/training", "dspine_train/objective.py"), ("dspine_train.evaluation",),
        allowed=tuple(path.removesuffix(".py").replace("/", ".") for path in EVALUATION_CORE
                      if not path.endswith("__init__.py"))),
}


@pytest.mark.parametrize("name", list(RULES))
def test_dependencies_point_one_way(name: str) -> None:
    assert RULES[name].violations(REPO) == [], name


def test_every_import_form_is_seen(tmp_path: Path) -> None:
    """The checker finds a forbidden import in each form: absolute, from-import of a module,
    relative, and inside a function; and nothing in a file that imports only allowed ones."""
    package = tmp_path / "dspine_train" / "modeling"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .layers import Layer\n")
    (package / "layers.py").write_text(
        "import dspine_train.engine.attention\n"
        "from dspine_train import engine\n"
        "from ..training.config import TrainConfig\n"
        "def lazy():\n"
        "    from ...scripts.tools import REPO\n")
    (package / "fine.py").write_text("import torch\nfrom . import layers\n"
                                     "from dspine_train.modeling_extra import x\n")
    rule = Rule(("dspine_train/modeling",), ("dspine_train.engine", "dspine_train.training",
                                             "scripts"))
    assert rule.violations(tmp_path) == [
        "dspine_train/modeling/layers.py:1 imports dspine_train.engine.attention",
        "dspine_train/modeling/layers.py:2 imports dspine_train.engine",
        "dspine_train/modeling/layers.py:3 imports dspine_train.training.config",
        "dspine_train/modeling/layers.py:3 imports dspine_train.training.config.TrainConfig",
        "dspine_train/modeling/layers.py:5 imports scripts.tools",
        "dspine_train/modeling/layers.py:5 imports scripts.tools.REPO",
    ]


def test_allowed_modules_and_single_files(tmp_path: Path) -> None:
    """A rule on single files sees only those files; `allowed` lets the named modules (and their
    submodules) through and nothing else of the forbidden package; a source that does not exist
    is an error, not a pass."""
    package = tmp_path / "dspine_train" / "training"
    package.mkdir(parents=True)
    (package / "trainer.py").write_text(
        "from ..evaluation.block_metrics import accepted_prefix\n"
        "from dspine_train.evaluation.parity import run_parity\n")
    (package / "other.py").write_text("import dspine_train.evaluation.harness\n")
    rule = Rule(("dspine_train/training/trainer.py",), ("dspine_train.evaluation",),
                allowed=("dspine_train.evaluation.block_metrics",))
    assert rule.violations(tmp_path) == [
        "dspine_train/training/trainer.py:2 imports dspine_train.evaluation.parity",
        "dspine_train/training/trainer.py:2 imports dspine_train.evaluation.parity.run_parity",
    ]
    with pytest.raises(FileNotFoundError, match="training/gone.py"):
        Rule(("dspine_train/training/gone.py",), ("x",)).violations(tmp_path)
