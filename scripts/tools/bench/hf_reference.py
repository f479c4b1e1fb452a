"""The reference rows of `bench_engine.py --compare`, run by transformers itself.

Plain decoding is `model.generate(do_sample=False)`; prompt-lookup decoding is
`model.generate(prompt_lookup_num_tokens=N)` (transformers' assisted generation with its
`PromptLookupCandidateGenerator`, no draft model). Both run one prompt at a time (transformers'
assisted generation takes a batch of one), on the same token ids as the engine.

How the target's forwards are counted: a forward pre-hook on the HF model (the top module, so
one count per call of the model, never per layer) records, for every call, the position of the
first token it is fed (`position_ids[0, 0]`, else the length of the cache it is given). The
first call reads the prompt and is the prefill; transformers' assisted generation verifies its
first candidates inside that same call, so the prefill can already produce more than one new
token: it produced `(start of the second call) - (prompt length) + 1` of them (the second call
starts at the last token the first one committed), or every new token when there is no second
call. Then, as for the engine (`GenerationStats.tau`):

    tau = (new tokens - tokens of the prefill) / (calls - 1)

the new tokens that verifications produced per verification. Plain decoding gives exactly 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Decoded:
    """What one decoding call of one prompt produced and cost.

    `verifications`: target forwards after the prefill; `verified_tokens`: the new tokens they
    produced (the new tokens less those of the prefill), so tau = verified_tokens /
    verifications; `seconds`: wall time of the call (CUDA synchronised).
    """

    tokens: list[int]
    verifications: int
    verified_tokens: int
    seconds: float


class ForwardCounter:
    """Counts an HF model's forward calls and records where each one starts (module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.starts: list[int | None] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None:
            self.starts.append(int(positions.reshape(-1)[0]))
            return
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        self.starts.append(int(cache.get_seq_length()) if cache is not None else None)

    def reset(self) -> None:
        """Forget the calls recorded so far."""
        self.starts = []

    def split(self, prompt_len: int, new_tokens: int) -> tuple[int, int]:
        """(verifications, new tokens they produced) of the calls since the last `reset`."""
        calls = len(self.starts)
        if calls <= 1:
            return 0, 0
        second = self.starts[1]
        if second is None:
            raise RuntimeError("cannot tell where the target's second forward starts: the HF "
                               "model was given neither position_ids nor a cache")
        prefill_tokens = second - prompt_len + 1
        return calls - 1, new_tokens - prefill_tokens

    def remove(self) -> None:
        """Detach the hook."""
        self._handle.remove()


class HFReference:
    """The target as transformers loads it, decoding the way transformers does."""

    def __init__(self, target: str, *, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: Sequence[int], pad_token_id: int | None) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            target, dtype=dtype, use_safetensors=True).to(device).eval()
        # The engine's end-of-sequence ids, so both stop on the same tokens.
        self.eos = list(eos_token_ids) or None
        self.pad = pad_token_id if pad_token_id is not None else (self.eos or [0])[0]
        # A neutral generation config: a checkpoint's own (repetition penalty, top-k, ...)
        # would otherwise fill every option left unset, and the engine decodes raw logits.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos,
                                                        pad_token_id=self.pad)
        self.counter = ForwardCounter(self.model)

    def generate(self, ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, prompt_lookup_tokens: int | None = None,
                 max_matching_ngram: int | None = None, logits_processor: Any = None) -> Decoded:
        """Decode one prompt: plain, or prompt lookup with `prompt_lookup_tokens` candidates
        per round (n-grams of up to `max_matching_ngram` tokens; None: transformers' default).
        `logits_processor`: a callable (input ids, scores) -> scores run on every position's
        logits (the forced replay's, `forced_replay.ForcedAnswerProcessor`)."""
        inputs = torch.tensor([ids], device=self.device)
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
            attention_mask=torch.ones_like(inputs),
        )
        if temperature > 0:
            options.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        else:
            options["do_sample"] = False
        if logits_processor is not None:
            from transformers import LogitsProcessorList

            options["logits_processor"] = LogitsProcessorList([logits_processor])
        if prompt_lookup_tokens is not None:
            options["prompt_lookup_num_tokens"] = prompt_lookup_tokens
            if max_matching_ngram is not None:
                options["max_matching_ngram_size"] = max_matching_ngram
        self.counter.reset()
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inputs, **options)
        self._sync()
        seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        verifications, verified = self.counter.split(len(ids), len(tokens))
        return Decoded(tokens, verifications, verified, seconds)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
