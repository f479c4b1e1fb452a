"""Upload an exported DSpine draft to the Hugging Face Hub with a generated model card.

    dspine-train push EXPORT_DIR --repo-id ORG/NAME [--public] [--dry-run]
        [--commit-message MSG] [--recipe NAME] [--dataset NAME] [--target-id ORG/TARGET]
        [--endpoint URL] [--timeout SECONDS]

Checks the export (config.json with model_type "dspine", readable model.safetensors, regular
files only: a symbolic link is refused; the draft must load with the engine's strict loader,
in the dry run too), writes README.md (the model card) into it, creates the repository if
needed (private unless `--public`) and uploads the export's files (never dotfiles; JSON files
without local absolute paths: config.json's target_name_or_path is uploaded as `--target-id`,
default the recorded one when it is a Hub id, and a local one without `--target-id` is
refused). Each HTTP request gives up after
`--timeout` seconds without progress (default 60) with a one-line error and exit status 1.
`--dry-run` prints the repository, visibility, files and sizes and the card, and touches
neither the export nor the network. The token comes from $HF_TOKEN or the cached
`hf auth login`; it is never printed. The endpoint defaults to $HF_ENDPOINT or huggingface.co.
`python scripts/push_to_hub.py` and `python -m dspine_train.hub_cli` take the same arguments;
the logic is in `dspine_train.hub`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import constants, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from dspine_train import hub

PROG = "dspine-train push"  # the name its usage and error lines give (scripts/push_to_hub.py too)


def _size(num_bytes: int) -> str:
    """Human-readable size: 512 B, 3.2 KiB, 1.4 GiB."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    exponent = min(int(math.log(num_bytes, 1024)), 3)
    return f"{num_bytes / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Upload a DSpine export to the Hugging Face Hub."
    )
    parser.add_argument("export_dir", help="directory written by the trainer's export step")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME of the model repository")
    visibility = parser.add_mutually_exclusive_group()
    visibility.add_argument(
        "--public",
        dest="private",
        action="store_false",
        help="create the repository public (default: private; new repos only)",
    )
    visibility.add_argument(
        "--private",
        dest="private",
        action="store_true",
        help="create the repository private (the default; kept for old command lines)",
    )
    parser.set_defaults(private=True)
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan; no upload, no writes"
    )
    parser.add_argument("--commit-message", default="Upload DSpine draft")
    parser.add_argument("--recipe", help="recipe name for the card (default: training_info.json)")
    parser.add_argument(
        "--dataset", help="training data for the card (default: training_info.json)"
    )
    parser.add_argument(
        "--target-id",
        help="Hub id of the target: the uploaded config.json's target_name_or_path and the "
        "card's base_model (default: config.json's, when it is a Hub id)",
    )
    parser.add_argument("--base-model", help="the same as --target-id (older name)")
    parser.add_argument("--endpoint", help="Hub URL (default: $HF_ENDPOINT or huggingface.co)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=hub.DEFAULT_TIMEOUT_S,
        help="seconds an HTTP request may go without progress before the upload fails",
    )
    return parser


def _argument_error(args: argparse.Namespace) -> str | None:
    """The first bad flag value, as a message naming the flag; None when all are usable."""
    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        return f"--repo-id {args.repo_id!r}: {err}"
    for flag in ("target_id", "base_model"):
        value = getattr(args, flag)
        if value is not None and hub.hub_base_model(value) is None:
            return f"--{flag.replace('_', '-')} {value!r}: not a Hub model id (ORG/NAME)"
    if args.target_id and args.base_model and args.target_id != args.base_model:
        return f"--target-id {args.target_id!r} and --base-model {args.base_model!r} differ"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout {args.timeout}: must be a positive number of seconds"
    if args.endpoint is not None:
        url = urlparse(args.endpoint)
        if url.scheme not in ("http", "https") or not url.netloc:
            return f"--endpoint {args.endpoint!r}: not an http(s) URL"
    return None


def main(argv: Sequence[str] | None = None, api_factory: Callable[..., Any] | None = None) -> int:
    """Validate, render the card, then print the plan (`--dry-run`) or upload. Exit status.

    `api_factory` builds the Hub client (default `huggingface_hub.HfApi`); tests pass a fake.
    """
    args = _parser().parse_args(argv)
    problem = _argument_error(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    target_id = args.target_id or args.base_model
    try:
        info = hub.validate_export(args.export_dir)
        public = hub.public_json_files(info.path, target_id)  # no local path is uploaded
    except hub.ExportError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    card = hub.render_model_card(
        info,
        repo_id=args.repo_id,
        recipe=args.recipe,
        dataset=args.dataset,
        base_model=target_id,
    )
    token = get_token()  # $HF_TOKEN first, then the cached login

    if args.dry_run:
        files = dict(hub.upload_files(info.path))
        files.update({name: len(content) for name, content in public.items()})
        files[hub.CARD_FILE] = len(card.encode("utf-8"))  # the card replaces any README.md
        print(
            f"repository: {args.repo_id} (model, {'private' if args.private else 'public'} if created)"
        )
        print(f"endpoint: {args.endpoint or constants.ENDPOINT} (timeout {args.timeout:g} s)")
        print(f"commit message: {args.commit_message}")
        print(f"token: {'found' if token else 'none found (set HF_TOKEN or run `hf auth login`)'}")
        print(f"files ({len(files)}, {_size(sum(files.values()))}):")
        for name, size in sorted(files.items()):
            print(f"  {name}  {_size(size)}" + ("  (local paths removed)" if name in public else ""))
        print(f"--- {hub.CARD_FILE} ---")
        print(card)
        return 0

    if not token:
        print(
            f"{PROG}: error: no Hugging Face token: set HF_TOKEN or run `hf auth login`",
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
            endpoint=args.endpoint,
            timeout=args.timeout,
            api_factory=api_factory,
            target_id=target_id,
        )
    except Exception as err:  # any Hub/network failure (hub.HubError: no answer in time)
        print(f"{PROG}: error: upload to {args.repo_id} failed: {hub.scrub_token(err, token)}",
              file=sys.stderr)
        return 1
    print(f"uploaded {info.path} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
