"""Regeneration through OpenAI-compatible ``/v1/chat/completions`` servers (SGLang, vLLM).

Each conversation is one task in a thread pool of ``max_in_flight`` workers (its turns are
sequential; conversations run concurrently).  Every attempt goes to the next URL round-robin,
so a retry after a failure usually lands on another server.  Timeouts, connection errors, 429
and 5xx answers are retried with exponential backoff; other 4xx answers (e.g. a prompt longer
than the server's context) fail the row at once.  Only the standard library is used.

Thinking: ``enable_thinking`` is sent as ``chat_template_kwargs`` (both servers pass it to the
template).  When a server's reasoning parser splits the reply, ``reasoning_content`` is put
back as ``<think>\\n...\\n</think>\\n\\n`` before the answer, which is the text Qwen3 generated.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from http.client import HTTPException
from typing import Any

from data_prep.backends import Reply, RowOutcome, TurnByTurn, TurnFailed
from data_prep.config import HttpBackendConfig, SamplingConfig
from data_prep.schema import Conversation

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


def completions_url(url: str) -> str:
    """Accept ``http://host:port``, ``.../v1`` or the full endpoint URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class _Cancelled(Exception):
    pass


class HttpBackend:
    """Concurrent, retrying client for one or more chat-completions servers."""

    def __init__(self, config: HttpBackendConfig, sampling: SamplingConfig) -> None:
        self.config = config
        self.sampling = sampling
        self._urls = itertools.cycle([completions_url(u) for u in config.urls])
        self._url_lock = threading.Lock()
        self._stop = threading.Event()
        token = os.environ.get(config.api_key_env) if config.api_key_env else None
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def _next_url(self) -> str:
        with self._url_lock:
            return next(self._urls)

    def _body(self, messages: list[dict[str, Any]], row_id: str) -> bytes:
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": self.sampling.max_new_tokens,
        }
        if self.sampling.temperature > 0:
            # A per-row seed keeps a rerun of a failed row reproducible on servers that honour it.
            digest = hashlib.sha256(f"{self.sampling.seed}:{row_id}".encode()).digest()
            body["seed"] = int.from_bytes(digest[:4], "big") >> 1
        if kwargs := self.sampling.chat_template_kwargs():
            body["chat_template_kwargs"] = kwargs
        return json.dumps(body).encode("utf-8")

    @staticmethod
    def _parse(payload: bytes) -> Reply:
        data = json.loads(payload)
        choice = data["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            text = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{text.lstrip(chr(10))}"
        tokens = (data.get("usage") or {}).get("completion_tokens") or 0
        return Reply(text, truncated=choice.get("finish_reason") == "length",
                     completion_tokens=int(tokens))

    def complete(self, messages: list[dict[str, Any]], row_id: str = "") -> Reply:
        """One chat completion with retries; raises :class:`TurnFailed` with the reason."""
        body = self._body(messages, row_id)
        last_error = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
                # Jitter spreads the retries of many rows that failed together.
                if self._stop.wait(delay * random.uniform(0.5, 1.0)):
                    raise _Cancelled
            url = self._next_url()
            request = urllib.request.Request(url, data=body, headers=self._headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                    return self._parse(response.read())
            except urllib.error.HTTPError as error:
                detail = error.read()[:200].decode("utf-8", "replace")
                last_error = f"http_{error.code}: {url} answered {detail!r}"
                if error.code not in _RETRYABLE_STATUS:
                    raise TurnFailed(last_error) from None
            except TimeoutError:
                last_error = f"timeout: no answer from {url} within {self.config.timeout_s} s"
            except (urllib.error.URLError, HTTPException, ConnectionError) as error:
                last_error = f"connection_error: {url}: {error}"
            except (ValueError, KeyError, IndexError, TypeError) as error:
                last_error = f"bad_response: {url}: {error!r}"
        raise TurnFailed(f"{last_error} (gave up after {self.config.max_retries + 1} attempts)")

    def regenerate_row(self, row: Conversation) -> RowOutcome:
        """All turns of one conversation, sequentially."""
        state = TurnByTurn(row)
        while state.pending:
            try:
                state.add_reply(self.complete(state.history, row["id"]))  # type: ignore[arg-type]
            except TurnFailed as error:
                state.fail(str(error))
        return state.outcome()

    def regenerate(self, rows: Iterable[Conversation]) -> Iterator[RowOutcome]:
        """Run up to ``max_in_flight`` conversations at once; yield outcomes as they finish.

        Rows are submitted lazily (at most twice the pool size queued) so input of any size
        streams.  On an exception in the consumer (Ctrl-C) queued rows are cancelled and
        retry waits end at once; requests already on the wire end by their timeout.
        """
        self._stop.clear()
        rows = iter(rows)
        limit = self.config.max_in_flight
        pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="regenerate")
        running: set[Future[RowOutcome]] = set()
        try:
            while True:
                for row in itertools.islice(rows, 2 * limit - len(running)):
                    running.add(pool.submit(self.regenerate_row, row))
                if not running:
                    return
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield future.result()
        finally:
            self._stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
