"""The training study (docs/STUDY.md): its data, then every variant, in resumable pieces.

    python scripts/study.py data                      # prompts, regeneration, token data
    python scripts/study.py run --steps 1500          # every variant; finished ones skipped
    python scripts/study.py run --stop-after 1        # one variant per session
    python scripts/study.py run --smoke               # 2 variants x 20 steps on the demo data

See `scripts.tools.ablation.study` (runner) and `scripts.tools.ablation.study_data` (data).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from scripts.tools.ablation.study_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
