"""Typed configuration of the data pipeline, registered with Hydra's ConfigStore.

``DataConfig`` is the schema of the ``data`` config group (``recipes/data/*.yaml`` only
override it): where prompts come from (``source``), how the target regenerates answers
(``regenerate``) and how conversations become token ids and loss masks (``tokenize``).
Because the group node is typed, a YAML or command-line key that the schema lacks is an error
naming that key.  ``DataPrepJob`` is the primary config of the ``data_prep`` CLIs::

    python -m data_prep.regenerate data=default_target_humaneval data.regenerate.backend=http
    python -m data_prep.tokenize   data=default_target_humaneval data.tokenize.num_proc=2

Value checks that the types cannot express run in ``__post_init__``, i.e. when the composed
config is turned into these dataclasses with ``OmegaConf.to_object``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

from dspine_train.py_compat import StrEnum
from dspine_train.recipe_files import RECIPES_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_target_dir() -> Path:
    """Where ``python -m data_prep.default_target`` puts the assembled default target.

    ``$DSPINE_CACHE/default_target`` when ``DSPINE_CACHE`` is set, else
    ``artifacts/default_target`` under the repository root.
    """
    cache = os.environ.get("DSPINE_CACHE")
    return (Path(cache) if cache else REPO_ROOT / "artifacts") / "default_target"


# ``${default_target_dir:}`` lets recipes point at the assembled target without a path.
if not OmegaConf.has_resolver("default_target_dir"):
    OmegaConf.register_new_resolver("default_target_dir", lambda: str(default_target_dir()))


class BuiltinSource(StrEnum):
    """Prompt sets shipped as packages in the ``demo`` extra."""

    sharegpt = "sharegpt"
    humaneval = "humaneval"


class SourcePart(StrEnum):
    """Which side of the stable held-out split a stage uses."""

    train = "train"
    heldout = "heldout"
    all = "all"


class BackendKind(StrEnum):
    """Where regeneration runs."""

    local = "local"
    http = "http"


class Truncation(StrEnum):
    """What happens to a tokenised row longer than ``max_length``."""

    right = "right"  # keep the first max_length tokens
    drop = "drop"  # drop the row (counted as ``too_long``)


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ValueError(f"data config: {key}: {message}")


class HubPreset(StrEnum):
    """Named Hub datasets the DSpine/DFlash/DSpark recipes train on (see ``HUB_PRESETS``)."""

    sharegpt = "sharegpt"
    ultrachat_200k = "ultrachat_200k"
    open_perfectblend = "open_perfectblend"
    nemotron_v1_chat = "nemotron_v1_chat"


# Where each preset's repository id, split and columns were checked: SpecForge's
# scripts/prepare_data.py (sgl-project/SpecForge: ultrachat, sharegpt, perfectblend loaders and
# their row processors), the dataset cards' ``dataset_info`` (HuggingFaceH4/ultrachat_200k:
# splits train_sft/test_sft/train_gen/test_gen, ``prompt_id`` + ``messages`` of role/content;
# nvidia/Nemotron-Post-Training-Dataset-v1: splits chat/code/math/stem/tool_calling, ``uuid`` +
# ``messages`` of role/content) and the repository listing of mlabonne/open-perfectblend
# (data/train-0000N-of-00006.parquet, ``conversations`` of from/value, no id column).
HUB_PRESETS: dict[HubPreset, dict[str, Any]] = {
    # ShareGPT V4.3 (the EAGLE / SpecForge copy): id + conversations of from/value; some turns
    # name the assistant chatgpt/bing/bard.
    HubPreset.sharegpt: {"name": "Aeala/ShareGPT_Vicuna_unfiltered", "split": "train",
                         "messages_field": "conversations", "id_field": "id",
                         "roles": {"chatgpt": "assistant", "bing": "assistant",
                                   "bard": "assistant"}},
    HubPreset.ultrachat_200k: {"name": "HuggingFaceH4/ultrachat_200k", "split": "train_sft",
                               "messages_field": "messages", "id_field": "prompt_id"},
    HubPreset.open_perfectblend: {"name": "mlabonne/open-perfectblend", "split": "train",
                                  "messages_field": "conversations"},
    # The chat split (747k rows, ~3.8 GB); code/math/stem/tool_calling are other splits.
    HubPreset.nemotron_v1_chat: {"name": "nvidia/Nemotron-Post-Training-Dataset-v1",
                                 "split": "chat", "messages_field": "messages",
                                 "id_field": "uuid"},
}

_ROLE_NAMES = ("system", "user", "assistant")


@dataclass
class HubSourceConfig:
    """One dataset on the Hugging Face Hub, read with ``datasets.load_dataset``.

    Each row becomes a conversation from a column of turns (``messages_field``; turns of
    role/content or from/value, as in local files) or from text columns (``prompt_field``,
    optional ``response_field`` and ``system_field``).  A ``preset`` fills every field left
    unset; ``roles`` adds role names to the built-in ones (human/gpt/user/assistant/system).
    """

    preset: HubPreset | None = None
    name: str | None = None  # repository id, e.g. HuggingFaceH4/ultrachat_200k
    config: str | None = None  # the dataset's configuration (subset), if it has several
    split: str | None = None  # default: train
    revision: str | None = None  # branch, tag or commit; default: main
    messages_field: str | None = None  # column of turns; default: messages, else conversations
    prompt_field: str | None = None  # or a single-turn row from text columns
    response_field: str | None = None
    system_field: str | None = None
    id_field: str | None = None  # column holding the row id; default: id (else a content hash)
    roles: dict[str, str] = field(default_factory=dict)  # extra role name -> user/assistant/system
    max_rows: int | None = None  # read at most this many rows (a seeded sample of the split)

    def resolved(self, key: str) -> HubSourceConfig:
        """This entry with its preset's values filled in, checked; errors name ``key``."""
        preset = HUB_PRESETS[HubPreset(self.preset)] if self.preset is not None else {}
        values = {name: getattr(self, name) for name in (
            "name", "config", "split", "revision", "messages_field", "prompt_field",
            "response_field", "system_field", "id_field", "max_rows")}
        for name, value in preset.items():
            if name != "roles" and values.get(name) is None and not (
                    name == "messages_field" and self.prompt_field is not None):
                values[name] = value
        entry = HubSourceConfig(preset=self.preset, roles={**preset.get("roles", {}),
                                                           **dict(self.roles)}, **values)
        entry.split = entry.split if entry.split is not None else "train"
        _check(bool(entry.name), f"{key}.name",
               f"set a repository id (org/name) or {key}.preset "
               f"({', '.join(p.value for p in HubPreset)})")
        try:
            from huggingface_hub.utils import HFValidationError, validate_repo_id
            validate_repo_id(entry.name)
        except HFValidationError as error:
            raise ValueError(f"data config: {key}.name: {error}") from None
        _check(bool(entry.split), f"{key}.split", "must not be empty")
        _check(entry.max_rows is None or entry.max_rows > 0, f"{key}.max_rows", "must be > 0")
        _check(entry.prompt_field is None or entry.messages_field is None, f"{key}.prompt_field",
               "set either messages_field (a column of turns) or prompt_field, not both")
        for name in ("response_field", "system_field"):
            _check(getattr(entry, name) is None or entry.prompt_field is not None,
                   f"{key}.{name}", "needs prompt_field (it builds a row from text columns)")
        for name, role in entry.roles.items():
            _check(role in _ROLE_NAMES, f"{key}.roles.{name}",
                   f"{role!r} is not one of {', '.join(_ROLE_NAMES)}")
        return entry


@dataclass
class SourceConfig:
    """Input rows: a packaged prompt set, local files and/or Hub datasets, and the subset."""

    builtin: BuiltinSource | None = None  # packaged prompts (needs the demo extra)
    paths: list[str] = field(default_factory=list)  # local JSON/JSONL/datasets inputs
    hub: list[HubSourceConfig] = field(default_factory=list)  # datasets on the Hugging Face Hub
    format: str = "auto"  # container format: auto | jsonl | json | datasets
    split: str = "train"  # split to read from a datasets DatasetDict / data directory
    strict: bool = False  # fail on the first bad row (naming file and line) instead of skipping
    heldout_fraction: float = 0.0  # share of rows held out by a stable hash of their id
    part: SourcePart = SourcePart.train  # train (not held out), heldout, or all rows
    max_rows: int | None = None  # stable subset of at most this many rows of the chosen part
    seed: int = 0  # salt of the id hash behind the held-out split and the subset

    def __post_init__(self) -> None:
        _check(self.builtin is not None or bool(self.paths) or bool(self.hub), "source",
               "set source.builtin, source.paths or source.hub")
        _check(0.0 <= self.heldout_fraction < 1.0, "source.heldout_fraction", "must be in [0, 1)")
        _check(self.max_rows is None or self.max_rows > 0, "source.max_rows", "must be > 0")
        self.hub = [entry.resolved(f"source.hub[{index}]") for index, entry in enumerate(self.hub)]


@dataclass
class SamplingConfig:
    """How the target samples each regenerated assistant turn."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    enable_thinking: bool | None = None  # chat-template kwarg; None = leave it to the template
    seed: int = 0  # local backend sampling seed (HTTP servers get it per request)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, "regenerate.sampling.temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "regenerate.sampling.top_p", "must be in (0, 1]")
        _check(self.max_new_tokens > 0, "regenerate.sampling.max_new_tokens", "must be > 0")

    def chat_template_kwargs(self) -> dict[str, Any]:
        """Extra chat-template variables (only those that are set)."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


@dataclass
class LocalBackendConfig:
    """A transformers model generating in batches on this machine."""

    model_path: str = "${default_target_dir:}"
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    batch_size: int = 8

    def __post_init__(self) -> None:
        _check(self.batch_size > 0, "regenerate.local.batch_size", "must be > 0")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               "regenerate.local.dtype", "must be auto, float32, bfloat16 or float16")


def _is_http_url(url: Any) -> bool:
    """Whether ``url`` is ``http(s)://host[:port][/path]`` (with a valid port, if any)."""
    if not isinstance(url, str) or any(c.isspace() for c in url):
        return False
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


@dataclass
class HttpBackendConfig:
    """One or more OpenAI-compatible ``/v1/chat/completions`` servers (SGLang, vLLM)."""

    urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:30000"])
    model: str = "default"  # the served model name sent in each request
    max_in_flight: int = 64  # conversations generating concurrently (one request each)
    timeout_s: float = 600.0  # per request (connect and each read)
    max_retries: int = 4  # extra attempts after a timeout, connection error, 429 or 5xx
    backoff_s: float = 1.0  # first retry delay; doubles each retry
    max_backoff_s: float = 30.0
    api_key_env: str | None = None  # environment variable holding a bearer token, if any

    def __post_init__(self) -> None:
        _check(bool(self.urls), "regenerate.http.urls", "needs at least one URL")
        for index, url in enumerate(self.urls):
            _check(_is_http_url(url), f"regenerate.http.urls[{index}]",
                   f"{url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:30000)")
        _check(self.max_in_flight > 0, "regenerate.http.max_in_flight", "must be > 0")
        _check(self.timeout_s > 0, "regenerate.http.timeout_s", "must be > 0")
        _check(self.max_retries >= 0, "regenerate.http.max_retries", "must be >= 0")


@dataclass
class RegenerateConfig:
    """Regeneration of every assistant turn by the target, into resumable JSONL shards."""

    backend: BackendKind = BackendKind.local
    local: LocalBackendConfig = field(default_factory=LocalBackendConfig)
    http: HttpBackendConfig = field(default_factory=HttpBackendConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    output_dir: str = "artifacts/data/regenerated"
    shard_size: int = 256  # rows per output shard
    flush_interval_s: float = 120.0  # also write a shard this often, bounding work lost to kill -9

    def __post_init__(self) -> None:
        _check(self.shard_size > 0, "regenerate.shard_size", "must be > 0")


@dataclass
class TokenizeConfig:
    """Chat template + loss masks -> a ``datasets`` Arrow DatasetDict (train/eval)."""

    tokenizer_path: str = II("..regenerate.local.model_path")
    input_paths: list[str] = field(default_factory=list)  # empty = the regeneration output
    output_dir: str = "artifacts/data/tokenized"
    max_length: int = 2048
    truncation: Truncation = Truncation.right
    min_supervised_run: int = 2  # drop rows without this many consecutive supervised tokens
    eval_fraction: float = 0.02  # share of rows (stable hash of the id) in the eval split
    seed: int = 0
    num_proc: int = 1
    enable_thinking: bool | None = II("..regenerate.sampling.enable_thinking")

    def __post_init__(self) -> None:
        _check(self.max_length > 1, "tokenize.max_length", "must be > 1")
        _check(self.min_supervised_run >= 1, "tokenize.min_supervised_run", "must be >= 1")
        _check(0.0 <= self.eval_fraction < 1.0, "tokenize.eval_fraction", "must be in [0, 1)")
        _check(self.num_proc >= 1, "tokenize.num_proc", "must be >= 1")


@dataclass
class DataConfig:
    """Schema of the ``data`` config group: the whole ``data_prep`` stage."""

    source: SourceConfig = MISSING
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)


@dataclass
class DataPrepJob:
    """Primary config of ``python -m data_prep.regenerate`` / ``python -m data_prep.tokenize``."""

    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"data": "default_target_humaneval"}])
    data: DataConfig = MISSING


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="data_prep_job", node=DataPrepJob)
    store.store(group="data", name="data_schema", node=DataConfig)


register_configs()

# The recipes' directory (a checkout's `recipes/` or the installed package's copy), absolute.
RECIPES_PATH = str(RECIPES_DIR)


def to_data_config(node: Any) -> DataConfig:
    """Validate a composed ``data`` node against the schema and build the dataclasses.

    Re-merging onto the structured schema catches keys that a ``+key=value`` override forced
    past Hydra's struct check; ``to_object`` then runs the ``__post_init__`` value checks.
    """
    plain = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), plain)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
