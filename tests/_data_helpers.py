"""Shared helpers for the data_prep tests: fixture tokenizers, a tiny model, a fake server."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dspine_train.training.tiny_assets import tiny_target_config

FIXTURES = Path(__file__).parent / "fixtures" / "data"
QWEN25_TEMPLATE = (FIXTURES / "qwen25_chat_template.jinja").read_text()
QWEN3_TEMPLATE = (FIXTURES / "qwen3_chat_template.jinja").read_text()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added but not special, as in Qwen3
_PIECE = r"\n|\w+|[^\s\w]"


def word_level_tokenizer(chat_template: str, texts: Iterable[str]):
    """A tiny word-level fast tokenizer with Qwen's special tokens and ``chat_template``.

    Words, single punctuation marks and newlines are tokens; spaces are dropped, so every
    token is readable in a golden test.  The vocabulary holds every piece of ``texts`` and of
    the template's literal strings.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    corpus = " ".join([*texts, chat_template.replace("\\n", "\n")])
    for token in SPECIAL_TOKENS + THINK_TOKENS:
        corpus = corpus.replace(token, " ")
    pieces = sorted(set(re.findall(_PIECE, corpus)))
    vocab = {token: index for index, token in enumerate(["[UNK]", *pieces])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE), behavior="removed", invert=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None)
    tokenizer.chat_template = chat_template
    return tokenizer


def marked(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> str:
    """Tokens joined by spaces, supervised ones in brackets, newlines shown as ``\\n``."""
    out = []
    for token, flag in zip(tokenizer.convert_ids_to_tokens(input_ids), loss_mask):
        token = token.replace("\n", "\\n")
        out.append(f"[{token}]" if flag else token)
    return " ".join(out)


def tiny_qwen3(tokenizer: Any, path: Path, *, seed: int = 0, never_stop: bool = True) -> Path:
    """Save a tiny random Qwen3 causal LM matching ``tokenizer`` (and the tokenizer) to ``path``.

    With ``never_stop`` the generation config suppresses the stop tokens, so every reply runs
    to max_new_tokens: deterministic lengths for the tests.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = tiny_target_config(num_hidden_layers=2, vocab_size=len(tokenizer),
                                initializer_range=0.02, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    stop = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config = GenerationConfig(eos_token_id=stop,
                                               pad_token_id=tokenizer.pad_token_id,
                                               suppress_tokens=stop if never_stop else None)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    """Write rows (dicts, or raw strings/bytes taken as a line) to a JSONL file."""
    with open(path, "wb") as handle:
        for row in rows:
            if isinstance(row, bytes):
                handle.write(row.rstrip(b"\n") + b"\n")
            elif isinstance(row, str):
                handle.write(row.encode("utf-8") + b"\n")
            else:
                handle.write(json.dumps(row).encode("utf-8") + b"\n")
    return path


def chat_row(row_id: str, *turns: str) -> dict[str, Any]:
    """An OpenAI-style row alternating user/assistant turns."""
    roles = ["user", "assistant"]
    return {"id": row_id, "messages": [{"role": roles[i % 2], "content": text}
                                       for i, text in enumerate(turns)]}


class FakeChatServer:
    """An OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1, in a thread.

    HTTP/1.1 with keep-alive, as SGLang and vLLM serve.  The reply is deterministic:
    ``reply <k> to <last user content>``, k = assistant turns so far.
    ``faults(content, attempt) -> action`` injects failures for the request whose last user
    message is ``content`` (``attempt`` counts from 0 per content): ``"500"``, ``"400"``,
    ``"stall"`` (sleep ``stall_s`` before answering), ``"reset"`` (drop the connection with a
    TCP reset, no answer), ``"garbage"`` (200 with a body that is not JSON) or None; it may
    also block (e.g. on a barrier).  ``delay_s`` slows every answer.  ``connections`` counts
    accepted TCP connections, ``peak_in_flight`` the most requests handled at once.
    """

    def __init__(self, faults: Callable[[str, int], str | None] | None = None, *,
                 delay_s: float = 0.0, stall_s: float = 2.0) -> None:
        self.faults = faults or (lambda content, attempt: None)
        self.delay_s = delay_s
        self.stall_s = stall_s
        self.attempts: Counter[str] = Counter()
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.peak_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a pooling client reuses connections

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server.connections += 1

            def handle(self) -> None:
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError, TimeoutError):
                    pass  # the client dropped the connection (its timeout); nothing to do

            def do_POST(self) -> None:
                with server._lock:
                    server._in_flight += 1
                    server.peak_in_flight = max(server.peak_in_flight, server._in_flight)
                try:
                    self._answer()
                finally:
                    with server._lock:
                        server._in_flight -= 1

            def _answer(self) -> None:
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                messages = body["messages"]
                content = [m for m in messages if m["role"] == "user"][-1]["content"]
                with server._lock:
                    attempt = server.attempts[content]
                    server.attempts[content] += 1
                    server.requests.append(body)
                action = server.faults(content, attempt)
                if action == "stall":
                    time.sleep(server.stall_s)
                elif action in ("500", "400"):
                    self._send(int(action), {"error": f"injected {action}"})
                    return
                elif action == "reset":
                    # SO_LINGER 0: close() sends RST instead of FIN, as a crashed server does
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                elif action == "garbage":
                    self._send(200, b"<html>not json")
                    return
                time.sleep(server.delay_s)
                turn = sum(m["role"] == "assistant" for m in messages)
                self._send(200, {
                    "id": "x", "object": "chat.completion",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant",
                                             "content": f"reply {turn} to {content}"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})

            def _send(self, status: int, payload: dict[str, Any] | bytes) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (timeout)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128  # listen backlog: many workers connect at once

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


# llama.cpp tensor names of a qwen2 model, from the transformers names.
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_qwen2_gguf(path: Path, seed: int = 0):
    """Write a tiny random qwen2 model as an F32 GGUF with a byte-level BPE tokenizer.

    Returns the transformers model the GGUF was made from.
    """
    import gguf
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "he", "ll", "hell", "Ġw", *SPECIAL_TOKENS]
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=len(tokens),
                         tie_word_embeddings=False, max_position_embeddings=128)
    model = Qwen2ForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])  # 3 = control token
    writer.add_token_merges(["h e", "l l", "he ll", "Ġ w"])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN25_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_LAYER['.'.join(rest)]}"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
