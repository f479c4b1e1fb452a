"""The OpenAI-compatible server on loopback, driven by the real `openai` client: answers equal
the engine's alone (plain, streamed, 32 at once), bad requests get OpenAI's error shape, a client
leaving mid-stream and a shutdown with a request in flight leave nothing broken."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from _engine_helpers import build_tiny_target, build_tokenizer, hf_greedy, tiny_draft

from dspine_train.engine import Engine
from dspine_train.serving.app import create_app
from dspine_train.serving.cli import main as serve_main
from dspine_train.serving.config import ServerConfig
from dspine_train.serving.detokenize import TextStream, final_text

MODEL = "tiny-dspine"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}w7"
NEW = 12


def _engine(root: Path, **kwargs) -> Engine:
    return Engine.from_pretrained(root / "target", root / "draft", max_batch_size=8,
                                  max_seq_len=64, **kwargs)


class Server:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, engine: Engine, **config) -> None:
        self.app = create_app(engine, ServerConfig(model_name=MODEL, **config))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target with a word-level tokenizer and chat template, a briefly trained draft
    (so rounds accept drafts), a server over one engine and a reference engine beside it."""
    from _engine_helpers import train_draft_briefly

    root = tmp_path_factory.mktemp("serve")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, eos_token_id=None)
    tokenizer = build_tokenizer(root / "target", vocab_size=200)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "target")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 9, (32,), generator=gen)]
    sequences = torch.tensor([p + hf_greedy(hf, p, 32 - len(p)) for p in prompts[:8]])
    draft = train_draft_briefly(tiny_draft(hf, 200), hf, sequences, steps=40, lr=1e-2)
    draft.save_pretrained(root / "draft")
    server = Server(_engine(root), max_batch_size=8, batch_window_ms=20)
    texts = [tokenizer.decode(p) for p in prompts]
    yield {"root": root, "server": server, "client": server.client, "ref": _engine(root),
           "texts": texts}
    server.stop()


def _alone(world, prompt: str, chat: bool = False, **kwargs):
    """The reference engine's answer for `prompt` alone, greedy."""
    kwargs.setdefault("max_new_tokens", NEW)
    return world["ref"].generate([prompt], temperature=0.0, chat=chat, **kwargs)


def _stream(client, chat: bool, **kwargs) -> tuple[str, list[int], list]:
    """Text, token ids and chunks of a streamed completion (`return_token_ids`)."""
    create = client.chat.completions.create if chat else client.completions.create
    chunks = list(create(model=MODEL, stream=True, extra_body={"return_token_ids": True},
                         **kwargs))
    with_choice = [c for c in chunks if c.choices]
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in with_choice)
    else:
        text = "".join(c.choices[0].text for c in with_choice)
    ids = [t for c in with_choice for t in c.choices[0].model_extra.get("token_ids", [])]
    return text, ids, chunks


def test_models_health_and_metrics(world):
    client = world["client"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt=world["texts"][0], max_tokens=4,
                              temperature=0)
    assert httpx.get(f"{world['server'].url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{world['server'].url}/metrics").text
    for name in ("dspine_generated_tokens_total", "dspine_tokens_per_second",
                 "dspine_acceptance_length_bucket", "dspine_queue_depth",
                 "dspine_request_latency_seconds_bucket", "dspine_batch_size_bucket",
                 'dspine_requests_total{endpoint="/v1/completions",status="200"}'):
        assert name in text, name


def test_completion_equals_the_engine_alone(world):
    prompt = world["texts"][1]
    ref = _alone(world, prompt)
    out = world["client"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
        extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == ref.texts[0] and choice.model_extra["token_ids"] == ref.token_ids[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == NEW and out.usage.prompt_tokens == len(prompt.split())
    assert out.usage.total_tokens == out.usage.prompt_tokens + NEW
    rounds = len(ref.stats.round_accepted[0])
    assert out.usage.model_extra["acceptance_length"] == pytest.approx((NEW - 1) / rounds)
    assert out.usage.model_extra["acceptance_length"] > 1  # the trained draft is accepted

    text, ids, chunks = _stream(world["client"], chat=False, prompt=prompt, max_tokens=NEW,
                                temperature=0)
    assert text == ref.texts[0] and ids == ref.token_ids[0]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == NEW


def test_chat_completion_equals_the_engine_alone(world):
    prompt = world["texts"][2]
    ref = _alone(world, prompt, chat=True)
    messages = [{"role": "user", "content": prompt}]
    out = world["client"].chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
        extra_body={"return_token_ids": True})
    assert out.choices[0].message.content == ref.texts[0]
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids[0]
    assert out.usage.prompt_tokens == len(prompt.split()) + 1  # the template adds "w7"

    text, ids, chunks = _stream(world["client"], chat=True, messages=messages, max_tokens=NEW,
                                temperature=0, stream_options={"include_usage": True})
    assert text == ref.texts[0] and ids == ref.token_ids[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def test_a_seeded_sampled_request_alone_is_the_engines_draw(world):
    prompt = world["texts"][7]
    ref = world["ref"].generate([prompt], max_new_tokens=NEW, temperature=1.0, top_p=0.9,
                                chat=False, seed=5)
    for _ in range(2):  # reproducible
        out = world["client"].completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW, temperature=1.0, top_p=0.9, seed=5,
            extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref.token_ids[0]
    greedy = _alone(world, prompt).token_ids[0]
    assert ref.token_ids[0] != greedy  # the draw is not the greedy answer


def test_stop_strings_end_the_answer_before_them(world):
    prompt = world["texts"][3]
    full = _alone(world, prompt)
    words = full.texts[0].split()
    stop = next(w for i, w in enumerate(words) if i >= 2 and w not in " ".join(words[:i]))
    ref = _alone(world, prompt, stop=[stop])
    expected = full.texts[0][: full.texts[0].index(stop)]
    assert ref.finish_reasons == ["stop"]
    out = world["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                             temperature=0, stop=stop)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(ref.token_ids[0])
    text, _, chunks = _stream(world["client"], chat=False, prompt=prompt, max_tokens=NEW,
                              temperature=0, stop=[stop, "no such words"])
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_requests_each_equal_the_engine_alone(world):
    texts = world["texts"]
    budgets = [4 + i % 9 for i in range(32)]  # per-request budgets inside shared batches

    def ask(i: int):
        out = world["client"].completions.create(
            model=MODEL, prompt=texts[i], max_tokens=budgets[i], temperature=0,
            extra_body={"return_token_ids": True})
        return out.choices[0].model_extra["token_ids"], out.choices[0].text

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    for i, (ids, text) in enumerate(answers):
        ref = _alone(world, texts[i], max_new_tokens=budgets[i])
        assert ids == ref.token_ids[0], i
        assert text == ref.texts[0], i
    sizes = httpx.get(f"{world['server'].url}/metrics").text
    count = float(next(line.split()[-1] for line in sizes.splitlines()
                       if line.startswith("dspine_batch_size_count")))
    total = float(next(line.split()[-1] for line in sizes.splitlines()
                       if line.startswith("dspine_batch_size_sum")))
    assert total / count > 1.5  # requests were batched, not run one by one


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "w1"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "w1", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "w1", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "w1", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "w1", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "w1", "max_tokens": 100}, 400, None),  # past max_seq_len
    ({"model": MODEL, "prompt": ["w1", "w2"]}, 400, "prompt"),
    ({"model": "other", "prompt": "w1"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(world, body, status, param):
    response = httpx.post(f"{world['server'].url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_requests_raise_in_the_openai_client(world):
    client = world["client"]
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.completions.create(model=MODEL, prompt="w1", n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                       max_tokens=-3)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w"}])
    bad = httpx.post(f"{world['server'].url}/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def _slow_server(world, **config) -> Server:
    """A server whose engine takes 30 ms more per token: its requests stay in flight."""
    engine = _engine(world["root"])
    generate = engine.generate

    def slow_generate(*args, on_tokens, **kwargs):
        def slow(row, tokens):
            time.sleep(0.03 * len(tokens))
            return on_tokens(row, tokens)
        return generate(*args, on_tokens=slow, **kwargs)

    engine.generate = slow_generate
    return Server(engine, **config)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith(name + " ")))


def test_a_client_leaving_mid_stream_leaves_the_server_healthy(world):
    """The abandoned request is ended at its next round; the next one is answered in full."""
    server = _slow_server(world)
    try:
        body = {"model": MODEL, "prompt": world["texts"][4], "max_tokens": 40,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            first = next(response.iter_lines())
            assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        deadline = time.monotonic() + 10
        while _metric(server, "dspine_requests_cancelled_total") < 1:
            assert time.monotonic() < deadline, "the abandoned request was not cancelled"
            time.sleep(0.01)
        assert _metric(server, "dspine_generated_tokens_total") < 40  # ended early
        body.update(stream=False)  # a client giving up on a plain request is noticed too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
        while _metric(server, "dspine_requests_cancelled_total") < 2:
            assert time.monotonic() < deadline + 10, "the abandoned request was not cancelled"
            time.sleep(0.01)
        prompt = world["texts"][5]
        out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                                temperature=0)
        assert out.choices[0].text == _alone(world, prompt).texts[0]
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert _metric(server, "dspine_running_requests") == 0
    finally:
        server.stop()


def test_shutdown_finishes_the_request_in_flight(world):
    """A server told to exit while a request runs answers it in full, then stops."""
    server = _slow_server(world, batch_window_ms=0)
    prompt = world["texts"][6]
    result: dict = {}

    def ask() -> None:
        result["out"] = server.client.completions.create(model=MODEL, prompt=prompt,
                                                         max_tokens=NEW, temperature=0)

    asker = threading.Thread(target=ask)
    asker.start()
    deadline = time.monotonic() + 10
    while server.app.state.metrics.running._value.get() == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    server.stop()
    asker.join(10)
    assert result["out"].choices[0].text == _alone(world, prompt).texts[0]
    assert result["out"].choices[0].finish_reason == "length"


class ByteTokenizer:
    """Token = one UTF-8 byte: multi-byte characters span several tokens."""

    def decode(self, tokens, skip_special_tokens=True):  # noqa: ARG002
        return bytes(tokens).decode("utf-8", errors="replace")


def test_streamed_text_never_breaks_a_character_or_shows_a_stop_string():
    tok = ByteTokenizer()
    text = "naïve € 𝄞 done"
    tokens = list(text.encode())
    stream = TextStream(tok)
    deltas = [stream.push([t]) for t in tokens] + [stream.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) == len(text)  # one character at a time, when whole

    stream = TextStream(tok, stop=["€ 𝄞", "zz"])
    deltas = [stream.push([t]) for t in tokens] + [stream.finish()]
    assert "".join(deltas) == "naïve " == final_text(tok, tokens, ["€ 𝄞", "zz"])
    assert stream.stopped


def test_cli_rejects_bad_flags_before_loading(tmp_path, capsys):
    assert serve_main(["--target", str(tmp_path), "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    assert serve_main(["--target", str(tmp_path), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size must be >= 1" in capsys.readouterr().err
