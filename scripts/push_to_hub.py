"""Upload an exported DSpine draft to the Hugging Face Hub with a generated model card.

    python scripts/push_to_hub.py EXPORT_DIR --repo-id ORG/NAME [--private] [--dry-run]
        [--commit-message MSG] [--recipe NAME] [--dataset NAME] [--base-model ORG/TARGET]

Checks the export (config.json with model_type "dspine", readable model.safetensors), writes
README.md (the model card) into it, creates the repository if needed and uploads the folder.
`--dry-run` prints the repository, visibility, files and sizes and the card, and touches
neither the export nor the network. The token comes from $HF_TOKEN or the cached
`hf auth login`; it is never printed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from huggingface_hub import get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from dspine_train import hub


def _size(num_bytes: int) -> str:
    """Human-readable size: 512 B, 3.2 KiB, 1.4 GiB."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    exponent = min(int(math.log(num_bytes, 1024)), 3)
    return f"{num_bytes / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="push_to_hub.py", description="Upload a DSpine export to the Hugging Face Hub."
    )
    parser.add_argument("export_dir", help="directory written by the trainer's export step")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME of the model repository")
    parser.add_argument(
        "--private", action="store_true", help="create the repository private (new repos only)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan; no upload, no writes"
    )
    parser.add_argument("--commit-message", default="Upload DSpine draft")
    parser.add_argument("--recipe", help="recipe name for the card (default: training_info.json)")
    parser.add_argument(
        "--dataset", help="training data for the card (default: training_info.json)"
    )
    parser.add_argument(
        "--base-model", help="Hub id of the target for the card (default: config.json)"
    )
    return parser


def main(argv: Sequence[str] | None = None, api_factory: Callable[..., Any] | None = None) -> int:
    """Validate, render the card, then print the plan (`--dry-run`) or upload. Exit status.

    `api_factory` builds the Hub client (default `huggingface_hub.HfApi`); tests pass a fake.
    """
    args = _parser().parse_args(argv)
    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        print(f"push_to_hub.py: error: --repo-id {args.repo_id!r}: {err}", file=sys.stderr)
        return 2
    try:
        info = hub.validate_export(args.export_dir)
    except hub.ExportError as err:
        print(f"push_to_hub.py: error: {err}", file=sys.stderr)
        return 2
    card = hub.render_model_card(
        info,
        repo_id=args.repo_id,
        recipe=args.recipe,
        dataset=args.dataset,
        base_model=args.base_model,
    )
    token = get_token()  # $HF_TOKEN first, then the cached login

    if args.dry_run:
        files = dict(hub.upload_files(info.path))
        files[hub.CARD_FILE] = len(card.encode("utf-8"))  # the card replaces any README.md
        print(
            f"repository: {args.repo_id} (model, {'private' if args.private else 'public'} if created)"
        )
        print(f"commit message: {args.commit_message}")
        print(f"token: {'found' if token else 'none found (set HF_TOKEN or run `hf auth login`)'}")
        print(f"files ({len(files)}, {_size(sum(files.values()))}):")
        for name, size in sorted(files.items()):
            print(f"  {name}  {_size(size)}")
        print(f"--- {hub.CARD_FILE} ---")
        print(card)
        return 0

    if not token:
        print(
            "push_to_hub.py: error: no Hugging Face token: set HF_TOKEN or run `hf auth login`",
            file=sys.stderr,
        )
        return 2
    try:
        url = hub.push_export(
            info.path,
            args.repo_id,
            card,
            token=token,
            private=args.private,
            commit_message=args.commit_message,
            api_factory=api_factory,
        )
    except Exception as err:  # any Hub/network failure: report it without ever echoing the token
        message = str(err).replace(token, "***")
        print(f"push_to_hub.py: error: upload to {args.repo_id} failed: {message}", file=sys.stderr)
        return 1
    print(f"uploaded {info.path} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
