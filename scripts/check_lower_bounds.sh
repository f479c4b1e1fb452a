#!/usr/bin/env bash
# Installs the LOWER bounds of pyproject.toml's ranges into a throwaway venv and runs a subset
# of the tests there (docs/INSTALL.md says which bounds and which tests). Not run by `make test`.
#   scripts/check_lower_bounds.sh [VENV_DIR]    (default /tmp/lowvenv; needs python3.11)
# Uses pip's cache and the network (or a local index) for the old releases.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/lowvenv}"
PYTHON="${PYTHON:-python3.11}"
# The lower bounds under test (keep in step with pyproject.toml's `>=` bounds and INSTALL.md).
LOWER=(
    "transformers==5.18.0"
    "huggingface_hub==2.0.0"
    "httpx2==2.0.0"
    "datasets==5.1.0"
    "accelerate==1.13.0"
    "safetensors==0.8.0"
    "tokenizers==0.23.3"
    "hydra-core==1.3.0"
    "omegaconf==2.3.0"
    "scikit-learn==1.6.1"
)
TESTS=(
    tests/test_model.py
    tests/test_engine_lossless.py
    tests/test_train_run.py
    tests/test_train_config.py
    tests/test_data_tokenize.py
    tests/test_push_to_hub.py
    tests/test_token_table.py
)
# constraints.txt with the pins above swapped in (pip refuses two pins of one name).
low_constraints="$(mktemp)"
trap 'rm -f "$low_constraints"' EXIT
names_re="$(printf '%s\n' "${LOWER[@]}" | sed -E 's/==.*//; s/[-_]/[-_]/g' | paste -sd'|')"
grep -viE "^(${names_re})==" constraints.txt > "$low_constraints"
printf '%s\n' "${LOWER[@]}" >> "$low_constraints"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -c "$low_constraints" torch==2.13.0 -e ".[dev,prompts]"
"$VENV/bin/pip" freeze | grep -iE "^($(printf '%s\n' "${LOWER[@]}" | sed -E 's/==.*//; s/[-_]/[-_]/g' | paste -sd'|')|torch)=="
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
