"""Research and check tooling beside the product: what the scripts import, never the product.

    ablation/   the ablation study and the training study (`scripts/ablate.py`, `scripts/study.py`)
    demo/       the demo's stages, stage records and runner (`scripts/demo.py`, `make demo`)
    gpu_check/  the GPU check's sections (`scripts/gpu_check.py`, `make gpu-check`)
    bench/      training-step benchmarks and profiles, engine timings and agreement, oracle
                drafts, the reference objective, parity helpers against reference clients
"""

from pathlib import Path

# The repository root: these tools find recipes and write artifacts relative to it.
REPO = Path(__file__).resolve().parents[2]
