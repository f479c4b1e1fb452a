"""Local regeneration with a transformers model: batched ``generate`` with left padding.

Rows are taken in chunks of a few batches.  Within a chunk, generation proceeds in waves:
wave k produces the k-th assistant turn of every conversation that has one, in batches of
similar prompt length (less padding); a row is handed back as soon as its last turn is done.
Left padding keeps every prompt's last token in the same column, which batched decoding of a
causal LM needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from data_prep.backends import Reply, RowOutcome, TurnByTurn
from data_prep.config import LocalBackendConfig, SamplingConfig
from data_prep.loss_mask import TemplateError, end_of_turn_token
from data_prep.schema import Conversation, DataError

_CHUNK_BATCHES = 4  # batches of rows per chunk: enough to sort by length, small enough to stream


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on cuda, float32 elsewhere (the float32 answers of a CPU run do
    not depend on the CPU; `dspine_train.cpu_bf16.native_bf16` tells where bfloat16 would be faster)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class LocalBackend:
    """Regenerates with a local model directory (HF format)."""

    def __init__(self, config: LocalBackendConfig, sampling: SamplingConfig, *,
                 model: Any = None, tokenizer: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.sampling = sampling
        self.device = resolve_device(config.device)
        if model is None and not Path(config.model_path).exists():
            raise DataError(f"regenerate.local.model_path {config.model_path} does not exist "
                            f"(for the default target run: python -m data_prep.default_target)")
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        if not getattr(tokenizer, "chat_template", None):  # each turn is rendered as a chat
            raise DataError(f"regenerate.local.model_path {config.model_path}: the tokenizer has "
                            "no chat template (a base model?); regenerate with a chat model, or "
                            "add a chat_template to its tokenizer_config.json")
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                config.model_path, dtype=resolve_dtype(config.dtype, self.device))
        self.model = model
        self.model.to(self.device).eval()
        stop = self.model.generation_config.eos_token_id
        self.stop_ids = set(stop if isinstance(stop, list) else [stop])
        self.stop_ids.add(self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token))
        # The template's own end-of-turn token (`<|eot_id|>`, `<end_of_turn>`) ends a reply even
        # when the checkpoint's eos is another token (a base model's `<|end_of_text|>`).
        try:
            end_of_turn = end_of_turn_token(self.tokenizer, sampling.chat_template_kwargs())
        except (TemplateError, ValueError):
            end_of_turn = None  # tokenisation names the template problem, with the row
        if end_of_turn is not None:
            self.stop_ids.add(self.tokenizer.convert_tokens_to_ids(end_of_turn))
        self.stop_ids.discard(None)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.generator_seeded = False

    def _prompt_text(self, state: TurnByTurn) -> str:
        return self.tokenizer.apply_chat_template(state.history, tokenize=False,
                                                  add_generation_prompt=True,
                                                  **self.sampling.chat_template_kwargs())

    @torch.inference_mode()
    def generate_batch(self, prompts: list[str]) -> list[Reply]:
        """Generate one reply per prompt text (already chat-templated)."""
        if not self.generator_seeded:
            # Seeded once: sampled outputs are reproducible for the same rows and batch size.
            torch.manual_seed(self.sampling.seed)
            self.generator_seeded = True
        encoded = self.tokenizer(prompts, padding=True, add_special_tokens=False,
                                 return_tensors="pt").to(self.device)
        sample = self.sampling.temperature > 0
        options: dict[str, Any] = {"do_sample": sample,
                                   "max_new_tokens": self.sampling.max_new_tokens,
                                   "pad_token_id": self.tokenizer.pad_token_id,
                                   "eos_token_id": sorted(self.stop_ids)}
        if sample:
            # top_k=0 turns off transformers' default top-k of 50, which the config does not ask for
            options.update(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                           top_k=0)
        else:
            # Neutralise sampling defaults a checkpoint's generation_config may carry.
            options.update(temperature=None, top_p=None, top_k=None)
        output = self.model.generate(**encoded, **options)
        new_tokens = output[:, encoded["input_ids"].shape[1]:].tolist()  # (B, <= max_new)
        replies = []
        for tokens in new_tokens:
            end = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
            content = tokens if end is None else tokens[:end]
            text = self.tokenizer.decode(content, skip_special_tokens=False)
            generated = len(tokens) if end is None else end + 1  # the stop token counts
            replies.append(Reply(text, truncated=end is None, completion_tokens=generated))
        return replies

    def _run_wave(self, states: list[TurnByTurn]) -> Iterator[None]:
        """Generate the next turn of every state, batch by batch; yields after each batch."""
        prompts = {}
        for state in states:
            text = self._prompt_text(state)
            length = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if self.max_positions and length + self.sampling.max_new_tokens > self.max_positions:
                state.fail(f"prompt_too_long: {length} prompt tokens + max_new_tokens exceed "
                           f"the model's {self.max_positions} positions")
            else:
                prompts[id(state)] = (length, text)
        yield
        ready = sorted((s for s in states if id(s) in prompts), key=lambda s: prompts[id(s)][0])
        size = self.config.batch_size
        for start in range(0, len(ready), size):
            batch = ready[start:start + size]
            for state, reply in zip(batch, self.generate_batch([prompts[id(s)][1] for s in batch])):
                state.add_reply(reply)
            yield

    def regenerate(self, rows: Iterable[Conversation]) -> Iterator[RowOutcome]:
        """Regenerate rows chunk by chunk; a row's outcome is yielded as soon as it is done."""
        iterator = iter(rows)
        while chunk := list(islice(iterator, self.config.batch_size * _CHUNK_BATCHES)):
            states = [TurnByTurn(row) for row in chunk]
            emitted: set[int] = set()
            while pending := [state for state in states if state.pending]:
                for _ in self._run_wave(pending):
                    for state in states:
                        if not state.pending and id(state) not in emitted:
                            emitted.add(id(state))
                            yield state.outcome()
