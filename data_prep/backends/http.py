"""Regeneration through OpenAI-compatible ``/v1/chat/completions`` servers (SGLang, vLLM).

Each conversation is one task in a thread pool of ``max_in_flight`` workers (its turns are
sequential; conversations run concurrently).  All workers share one ``httpx.Client`` whose
pool keeps a connection per worker and server alive, so a run opens about ``max_in_flight``
connections per server instead of one per request.  httpx applies ``timeout_s`` to connecting
and to each read, and its transport retries a failed connect once at once.  On top of that,
every attempt goes to the next URL round-robin (a retry usually lands on another server), and
timeouts, connection errors, 429 and 5xx answers are retried with exponential backoff (httpx
does not retry on a status); other 4xx answers (e.g. a prompt longer than the server's
context) and redirects fail the row at once.  Proxy environment variables are not used: the
servers are the user's own.

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
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from data_prep.backends import Reply, RowOutcome, TurnByTurn, TurnFailed
from data_prep.config import HttpBackendConfig, SamplingConfig
from data_prep.schema import Conversation

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# httpx's own retry of a refused or timed-out connect (at once, to the same server): it covers a
# server restarting or a full listen backlog without spending one of ``max_retries``.
_CONNECT_RETRIES = 1


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

    def open_client(self) -> httpx.Client:
        """The client every worker of a run shares: pooled connections, timeouts, headers.

        The pool keeps one connection per worker and server alive (a worker's retries and
        round-robin move it between servers); more workers than that never exist, so no
        request waits for a connection and none is closed only to be reopened.
        """
        size = self.config.max_in_flight * len(self.config.urls)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        transport = httpx.HTTPTransport(limits=limits, retries=_CONNECT_RETRIES)
        return httpx.Client(transport=transport, headers=self._headers,
                            timeout=httpx.Timeout(self.config.timeout_s))

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

    def _backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1, 2, ...): doubling, capped, jittered."""
        delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
        return delay * random.uniform(0.5, 1.0)  # spreads the retries of rows failing together

    def complete(self, client: httpx.Client, messages: list[dict[str, Any]],
                 row_id: str = "") -> Reply:
        """One chat completion with retries; raises :class:`TurnFailed` with the reason."""
        body = self._body(messages, row_id)
        last_error = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt and self._stop.wait(self._backoff(attempt)):
                raise _Cancelled
            url = self._next_url()
            try:
                response = client.post(url, content=body)
                if not response.is_success:
                    detail = response.content[:200].decode("utf-8", "replace")
                    last_error = f"http_{response.status_code}: {url} answered {detail!r}"
                    if response.status_code not in _RETRYABLE_STATUS:
                        raise TurnFailed(last_error)
                    continue
                return self._parse(response.content)
            except httpx.TimeoutException:
                last_error = f"timeout: no answer from {url} within {self.config.timeout_s} s"
            except httpx.TransportError as error:
                last_error = f"connection_error: {url}: {str(error) or type(error).__name__}"
            except (httpx.DecodingError, ValueError, KeyError, IndexError, TypeError) as error:
                last_error = f"bad_response: {url}: {error!r}"
        raise TurnFailed(f"{last_error} (gave up after {self.config.max_retries + 1} attempts)")

    def regenerate_row(self, client: httpx.Client, row: Conversation) -> RowOutcome:
        """All turns of one conversation, sequentially."""
        state = TurnByTurn(row)
        while state.pending:
            try:
                reply = self.complete(client, state.history, row["id"])  # type: ignore[arg-type]
                state.add_reply(reply)
            except TurnFailed as error:
                state.fail(str(error))
        return state.outcome()

    def regenerate(self, rows: Iterable[Conversation]) -> Iterator[RowOutcome]:
        """Run up to ``max_in_flight`` conversations at once; yield outcomes as they finish.

        Rows are submitted lazily (at most twice the pool size queued) so input of any size
        streams.  On an exception in the consumer (Ctrl-C) queued rows are cancelled and
        retry waits end at once; requests already on the wire end by their timeout, so the
        client is closed only when none is left (else its sockets go with the process).
        """
        self._stop.clear()
        rows = iter(rows)
        limit = self.config.max_in_flight
        client = self.open_client()
        pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="regenerate")
        running: set[Future[RowOutcome]] = set()
        try:
            while True:
                for row in itertools.islice(rows, 2 * limit - len(running)):
                    running.add(pool.submit(self.regenerate_row, client, row))
                if not running:
                    return
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield future.result()
        finally:
            self._stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
            if all(future.done() for future in running):
                client.close()
