"""Tiny Llama-3-style and Gemma-3-style targets whose tokenizers use every vocabulary id.

Built locally (nothing downloaded): a random `LlamaForCausalLM` / `Gemma3ForCausalLM` of
`VOCAB` rows and a word-level tokenizer of exactly `VOCAB` tokens laid out as the real ones
are: Llama-3 puts its specials and `<|reserved_special_token_N|>` above the words, Gemma puts
`<unusedN>` near the bottom. The special tokens are *added tokens flagged special* only (not
named bos/eos/additional specials), as in some real tokenizer files, so `all_special_tokens`
does not list the end-of-turn token.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 256
HIDDEN = 64

LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }}<|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn> {{ 'model' if m['role'] == 'assistant' else "
    "m['role'] }} {{ m['content'] }}<end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)
ROLE_WORDS = ["user", "assistant", "model", "system"]


def _layout(family: str) -> tuple[list[str], list[str]]:
    """(words, specials) in id order for `family`; together exactly `VOCAB` tokens."""
    if family == "llama":
        named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|reserved_special_token_2|>", "<|eot_id|>"]
        named += [f"<|reserved_special_token_{i}|>" for i in range(3, 11)]
        words = ROLE_WORDS + [f"w{i}" for i in range(VOCAB - len(named) - len(ROLE_WORDS))]
        return words, named
    named = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]"]
    named += [f"<unused{i}>" for i in range(8)] + ["<start_of_turn>", "<end_of_turn>"]
    words = ROLE_WORDS + [f"w{i}" for i in range(VOCAB - len(named) - len(ROLE_WORDS))]
    return words, named


def special_ids(family: str) -> dict[str, int]:
    """Token -> id of the family's special tokens."""
    words, named = _layout(family)
    start = len(words) if family == "llama" else 0
    return {token: start + i for i, token in enumerate(named)}


def word_ids(family: str) -> list[int]:
    """Ids of the plain words (`w0`, ...): what text tokenises to."""
    words, named = _layout(family)
    start = 0 if family == "llama" else len(named)
    return [start + i for i, word in enumerate(words) if word.startswith("w")]


def build_full_vocab_tokenizer(path: Path, family: str) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly `VOCAB` tokens with a chat template, saved to `path`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words, named = _layout(family)
    order = words + named if family == "llama" else named + words
    vocab = {token: i for i, token in enumerate(order)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        chat_template=LLAMA_TEMPLATE if family == "llama" else GEMMA_TEMPLATE,
    )
    assert len(fast) == VOCAB
    fast.save_pretrained(path)
    return fast


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny config of the family, with head_dim != hidden/heads (as Gemma-3's)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, max_position_embeddings=256, tie_word_embeddings=True,
                  initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        common["rope_parameters"] = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        common.update(overrides)
        return transformers.LlamaConfig(**common)
    common["layer_types"] = ["sliding_attention", "full_attention"] * 2
    common["sliding_window"] = 16
    common.update(overrides)
    return transformers.Gemma3TextConfig(**common)


def build_full_vocab_target(path: Path, family: str, seed: int = 0,
                            **overrides) -> transformers.PreTrainedModel:
    """Save a tiny random target with its full-vocabulary tokenizer at `path`; return it."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if family == "gemma":
        # With a tied head, the sqrt(H)-scaled embedding of the last token outweighs random
        # layers and greedy decoding repeats it; strong post-norms give varied continuations.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".post_" in name:
                    param.add_(torch.randn_like(param) * 0.5 + 30.0)
    model.save_pretrained(path)
    build_full_vocab_tokenizer(path, family)
    return model
