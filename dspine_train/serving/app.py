"""The HTTP routes: OpenAI's `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(plain and streamed as server-sent events), `/health` and Prometheus' `/metrics`.

Handlers tokenize the prompt (chat messages through the tokenizer's chat template, rendered
with the engine's `chat_template_kwargs` as `Engine.generate` does), check the request
against the engine, queue it on the `Batcher` and await its events. Every error is answered in
OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspine_train.engine import Engine, GenerationInputError
from dspine_train.serving.batcher import (
    Batcher,
    BatchKey,
    Event,
    Failed,
    Finished,
    Job,
    ServerClosing,
    Tokens,
)
from dspine_train.serving.config import ServerConfig
from dspine_train.serving.detokenize import TextStream, final_text
from dspine_train.serving.metrics import ServerMetrics
from dspine_train.serving.protocol import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    new_id,
    now,
    usage,
)


class APIError(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)


DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is there


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app over `engine`; its worker starts and stops with the app's lifespan
    (shutdown finishes every queued and running request first)."""
    if engine.tokenizer is None:
        raise GenerationInputError("serving needs a tokenizer (CLI: --tokenizer DIR)")
    metrics = ServerMetrics()
    batcher = Batcher(engine, metrics, max_batch_size=config.max_batch_size,
                      window_s=config.batch_window_ms / 1e3, speculative=config.speculative,
                      num_draft_tokens=config.num_draft_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        # Uvicorn has let the in-flight requests finish; the worker drains what is queued.
        await asyncio.to_thread(batcher.close)

    app = FastAPI(title="dspine-train serve", lifespan=lifespan)
    app.state.batcher, app.state.metrics, app.state.config = batcher, metrics, config
    tokenizer = engine.tokenizer

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(error_body(err.message, err.kind, err.param, err.code),
                            status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "missing":
            message = f"missing required field {param!r}"
        elif param:
            message = f"{param}: {message}"
        metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(error_body(str(err.detail), code=code), status_code=err.status_code)

    # ------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Response:
        if batcher.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "created": 0,
                "owned_by": "dspine-train"}
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------------ generation
    def check_model(body: SamplingFields) -> None:
        """404 for a model id this server does not serve (checked before anything else)."""
        if body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (it serves "
                           f"{config.model_name!r})", "model", "model_not_found")

    def prepare(body: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> Job:
        """Check `body` and build its job (not queued yet)."""
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem[1], problem[0])
        greedy = body.temperature == 0.0
        key = BatchKey(body.temperature, 1.0 if greedy else body.top_p,
                       None if greedy else body.seed)
        budget = max_tokens if max_tokens is not None else config.default_max_tokens
        stop = body.stop_list()
        try:
            batcher.check(prompt_ids, budget, key, stop)
        except GenerationInputError as err:
            raise APIError(400, str(err)) from err
        return Job(prompt_ids, budget, stop, key, emit=lambda event: None)

    async def run(job: Job) -> asyncio.Queue[Event]:
        """Queue `job`; its events arrive on the returned queue."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event: Event) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone: nobody waits for this request
                job.cancel()

        job.emit = emit
        try:
            batcher.submit(job)
        except ServerClosing as err:
            raise APIError(503, str(err), kind="server_error", code="shutting_down") from err
        return events

    async def finished(job: Job, events: asyncio.Queue[Event], request: Request) -> Finished:
        """Await the job's end; a client gone meanwhile (checked every `DISCONNECT_POLL_S`)
        cancels it."""

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            job.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while True:
                event = await events.get()
                if isinstance(event, Finished):
                    return event
                if isinstance(event, Failed):
                    raise APIError(500, f"generation failed: {event.error}",
                                   kind="server_error")
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once finished

    def answer(endpoint: str, body: dict[str, Any]) -> JSONResponse:
        metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            ids = [int(i) for i in prompt]
            vocab = engine.target.config.vocab_size
            if not ids or not all(0 <= i < vocab for i in ids):
                raise APIError(400, f"prompt: token ids must be non-empty, in 0..{vocab - 1}",
                               "prompt")
        job = prepare(body, ids, body.max_tokens)
        events = await run(job)
        meta = dict(id=new_id("cmpl"), object="text_completion", created=now(),
                    model=config.model_name)
        if body.stream:
            return stream(job, events, body, meta, chat=False, endpoint="/v1/completions")
        end = await finished(job, events, request)
        choice = {"index": 0, "text": final_text(tokenizer, end.token_ids, job.stop),
                  "finish_reason": FINISH_REASONS[end.finish_reason], "logprobs": None}
        if body.return_token_ids:
            choice["token_ids"] = end.token_ids
        return answer("/v1/completions", {
            **meta, "choices": [choice],
            "usage": usage(len(ids), len(end.token_ids), end.acceptance_length)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "the served tokenizer has no chat template: use /v1/completions",
                           "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                **engine.chat_template_kwargs)
        except Exception as err:  # the template's own checks (roles, order) are jinja errors
            raise APIError(400, f"messages: the chat template rejected them ({err})",
                           "messages") from err
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        job = prepare(body, ids, body.max_completion_tokens or body.max_tokens)
        events = await run(job)
        meta = dict(id=new_id("chatcmpl"), object="chat.completion", created=now(),
                    model=config.model_name)
        if body.stream:
            return stream(job, events, body, dict(meta, object="chat.completion.chunk"),
                          chat=True, endpoint="/v1/chat/completions")
        end = await finished(job, events, request)
        content = final_text(tokenizer, end.token_ids, job.stop)
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "finish_reason": FINISH_REASONS[end.finish_reason], "logprobs": None}
        if body.return_token_ids:
            choice["token_ids"] = end.token_ids
        return answer("/v1/chat/completions", {
            **meta, "choices": [choice],
            "usage": usage(len(ids), len(end.token_ids), end.acceptance_length)})

    def stream(job: Job, events: asyncio.Queue[Event], body: SamplingFields,
               meta: dict[str, Any], chat: bool, endpoint: str) -> StreamingResponse:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""

        def chunk(text: str | None, finish: str | None = None, role: bool = False,
                  token_ids: list[int] | None = None) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None}
            choice["finish_reason"] = finish
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return {**meta, "choices": [choice]}

        async def body_events() -> AsyncIterator[str]:
            text = TextStream(tokenizer, job.stop)
            want_ids = body.return_token_ids
            try:
                if chat:
                    yield sse(chunk("", role=True))
                while True:
                    event = await events.get()
                    if isinstance(event, Tokens):
                        delta = text.push(event.token_ids)
                        if delta or want_ids:
                            ids = event.token_ids if want_ids else None
                            yield sse(chunk(delta, token_ids=ids))
                    elif isinstance(event, Finished):
                        rest = text.finish()
                        last = chunk((rest or None) if chat else rest,
                                     FINISH_REASONS[event.finish_reason],
                                     token_ids=[] if want_ids else None)
                        used = usage(len(job.prompt_ids), len(event.token_ids),
                                     event.acceptance_length)
                        yield sse({**last, "usage": used})
                        if body.stream_options and body.stream_options.include_usage:
                            yield sse({**meta, "choices": [], "usage": used})
                        metrics.requests.labels(endpoint, "200").inc()
                        break
                    else:
                        assert isinstance(event, Failed)
                        yield sse(error_body(f"generation failed: {event.error}",
                                             "server_error"))
                        metrics.requests.labels(endpoint, "500").inc()
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()  # the client left mid-stream: end its row; a no-op once done

        return StreamingResponse(body_events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
