"""GPU check: the CUDA paths of the engine and the trainer, proved in one short run.

    python scripts/gpu_check.py --out docs/results/gpu_check           # one GPU
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/check   # CI: every step, tiny
    make gpu-check                                                     # the first line

Writes OUT/gpu_check.json and OUT/gpu_check.md (default OUT: artifacts/gpu_check/<device>);
exit status 1 if a section failed. The sections and what each asserts:
`scripts/tools/gpu_check/__init__.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from scripts.tools.gpu_check.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
