"""The trainer's upload of its final export to the Hugging Face Hub (`export.push_to_hub`).

`check_push_ready` runs before any training: a run that would train for hours and then fail
to upload for want of a token, or because the Hub is switched off ($HF_HUB_OFFLINE), stops
at once. `push_final_export` runs on the main process after the final export (and its
evaluation): it validates the export and renders the model card as `dspine-train push`
does (`dspine_train.hub`), then uploads. A failed upload keeps the export where it is and
raises a `TrainingError` naming the repository and the command that retries it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .. import hub
from .config import ExportConfig
from .errors import TrainingError

# The command that uploads an export by hand (the retry of a failed push).
PUSH_COMMAND = "dspine-train push"


def retry_command(export_dir: Path, export: ExportConfig) -> str:
    """The `dspine-train push` command line that uploads `export_dir` as this run would have."""
    args = [str(export_dir), "--repo-id", export.push_to_hub]
    if not export.push_private:
        args.append("--public")
    if export.push_target_id:
        args += ["--target-id", export.push_target_id]
    if export.push_endpoint:
        args += ["--endpoint", export.push_endpoint]
    if export.push_timeout != hub.DEFAULT_TIMEOUT_S:
        args += ["--timeout", f"{export.push_timeout:g}"]
    return f"{PUSH_COMMAND} {shlex.join(args)}"


def check_push_ready(export: ExportConfig) -> None:
    """Refuse, before training, a push that cannot happen: Hub access switched off or no token.

    `TrainingError` naming `export.push_to_hub` and what to do.
    """
    if export.push_to_hub is None:
        return
    from huggingface_hub import constants, get_token

    if constants.is_offline_mode():
        raise TrainingError(
            f"export.push_to_hub={export.push_to_hub}: the Hub is switched off in this "
            "environment (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set); unset it for the run, "
            "or drop export.push_to_hub and upload the export later with "
            f"{PUSH_COMMAND}")
    if not get_token():
        raise TrainingError(
            f"export.push_to_hub={export.push_to_hub}: no Hugging Face token: set HF_TOKEN or "
            "run `hf auth login` before training")


def push_final_export(export_dir: Path, export: ExportConfig) -> str:
    """Validate `export_dir`, write its model card and upload it to `export.push_to_hub`.

    Returns the commit URL. Whatever stops the upload (an export that does not validate, the
    Hub refusing, no answer within `export.push_timeout`) raises `TrainingError` naming the
    repository, saying the export is kept, and giving the command that retries; the token is
    never part of the message.
    """
    from huggingface_hub import get_token

    repo = export.push_to_hub
    token = get_token()
    try:
        if not token:
            raise RuntimeError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
        info = hub.validate_export(export_dir)
        card = hub.render_model_card(info, repo_id=repo, base_model=export.push_target_id)
        return hub.push_export(
            export_dir, repo, card, token=token, private=export.push_private,
            commit_message="Upload DSpine draft (dspine-train)", endpoint=export.push_endpoint,
            timeout=export.push_timeout, target_id=export.push_target_id)
    except Exception as err:  # noqa: BLE001 -- any failure leaves the export for a retry
        raise TrainingError(
            f"export.push_to_hub: uploading {export_dir} to {repo} failed: "
            f"{hub.scrub_token(err, token)}. "
            f"The export is kept at {export_dir}; retry the upload with: "
            f"{retry_command(export_dir, export)}") from err
