"""The HTTP contract of `medusa_jax.serving.server`, in process: the app (`create_app`) over
a stub engine (conftest's `StubEngine`: no model, nothing compiled, answers computable by
hand) through httpx's ASGI transport. Request validation names the field (types strict,
unimplemented parameters refused by name, null is absent), errors are OpenAI's one-line
envelope, 413 past the body limit, 415 for a body not declared JSON, 401 without the API
key, 403 for a foreign Host, 404 for an unknown model, 429 on a full queue, 503 once the
engine stops; completions and chat, streamed or not, with usage; /v1/models, /health,
/metrics. The real server process (a real model, sockets, signals) is test_serve*.py's."""

import asyncio
import contextlib
import json

import httpx
import pytest

from medusa_jax.serving.server import create_app, loopback_hosts, vicuna_prompt

pytestmark = pytest.mark.anyio

MODEL = "stub-model"
SHORT = [{"role": "system", "content": "Short stories."}]
ONCE = 5  # "Once": BOS and 4 bytes, so the stub answers from "f"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def serve(engine, base_url="http://127.0.0.1:8000", **kw):
    """An AsyncClient talking to `create_app(engine, MODEL, **kw)` in process."""
    app = create_app(engine, MODEL, **kw)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url=base_url, timeout=30) as c:
            yield c
    finally:
        app.state.server.pool.shutdown(wait=False)


def error(r, status, param=..., code=...) -> dict:
    """The error envelope of `r`: exactly OpenAI's four fields, a one-line message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def events(r) -> list:
    """A streamed response's `data:` payloads (JSON, or "[DONE]")."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [x for x in r.text.split("\n\n") if x]
    assert all(x.startswith("data: ") and "\n" not in x for x in lines), lines
    return [x[6:] if x[6:] == "[DONE]" else json.loads(x[6:]) for x in lines]


def completion(**extra) -> dict:
    return dict(dict(model=MODEL, prompt="Once", max_tokens=4), **extra)


def chat(**extra) -> dict:
    return dict(dict(model=MODEL, max_tokens=4,
                     messages=SHORT + [{"role": "user", "content": "Hi"}]), **extra)


# ----------------------------------------------------------------------------- validation


async def refusal(engine, endpoint: str, extra: dict, param) -> str:
    """A short request to `endpoint` ("chat" or "completions") with `extra` fields: the 400
    it must get, naming `param`; the engine is never asked. Returns the message."""
    body = chat(**extra) if endpoint == "chat" else completion(**extra)
    async with serve(engine) as c:
        r = await c.post("/v1/chat/completions" if endpoint == "chat" else "/v1/completions",
                         json=body)
    assert engine.submitted == []
    return error(r, 400, param)["message"]


@pytest.mark.parametrize("endpoint, extra, param, message", [
    ("completions", dict(presence_penalty=0.5), "presence_penalty", "not supported"),
    ("completions", dict(presence_penalty=-3), "presence_penalty", "in [-2, 2]"),
    ("chat", dict(frequency_penalty=1), "frequency_penalty", "not supported"),
    ("chat", dict(frequency_penalty=2.5), "frequency_penalty", "in [-2, 2]"),
    ("completions", dict(logit_bias={"5": 10}), "logit_bias", "not supported"),
    ("chat", dict(logit_bias={"5": -100}), "logit_bias", "not supported"),
    ("completions", dict(suffix=" The end."), "suffix", "not supported"),
    ("completions", dict(best_of=2), "best_of", "not supported"),
    ("completions", dict(logprobs=1), "logprobs", "not supported"),
    ("chat", dict(logprobs=True), "logprobs", "not supported"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "not supported"),
    ("chat", dict(tool_choice="auto"), "tool_choice", "not supported"),
    ("chat", dict(response_format={"type": "json_object"}), "response_format",
     "not supported"),
    ("chat", dict(modalities=["audio"]), "modalities", "not supported"),
    ("chat", dict(audio={"voice": "x"}), "audio", "not supported"),
    ("chat", dict(echo=True), "echo", "unrecognized request argument"),
    ("completions", dict(n=2), "n", "n must be 1"),
    ("completions", dict(top_k=-2), "top_k", "-1"),
    ("completions", dict(prompt=[1.0, 2.5]), "prompt", "prompt[0] must be an integer token id"),
    ("completions", dict(prompt=[438, 2.5]), "prompt", "prompt[1] must be an integer token id"),
    ("completions", dict(prompt=["a", "b"]), "prompt", "one prompt per request"),
    ("completions", dict(prompt=""), "prompt", "prompt is empty"),
    ("completions", dict(frobnicate=1), "frobnicate", "unrecognized request argument"),
])
async def test_unimplemented_parameters_are_refused_by_name(stub_engine, endpoint, extra,
                                                            param, message):
    assert message in await refusal(stub_engine, endpoint, extra, param)


@pytest.mark.parametrize("endpoint, extra, param, message", [
    ("completions", dict(max_tokens=True), "max_tokens", "max_tokens must be an integer in "
                                                         "1..2147483647, got true"),
    ("completions", dict(max_tokens=2.5), "max_tokens", "max_tokens must be an integer in 1.."),
    ("completions", dict(max_tokens=-1), "max_tokens", "max_tokens must be an integer in 1.."),
    ("completions", dict(n=True), "n", "n must be an integer, got true"),
    ("completions", dict(temperature=True), "temperature", "must be a number in [0, 2]"),
    ("completions", dict(temperature="hot"), "temperature", "must be a number in [0, 2]"),
    ("completions", dict(seed="7"), "seed", 'seed must be a 64-bit integer, got "7"'),
    ("completions", dict(seed=2**63), "seed", "seed must be a 64-bit integer"),
    ("completions", dict(top_p=0), "top_p", "top_p must be a number in (0, 1], got 0"),
    ("completions", dict(stream="yes"), "stream", "stream must be a boolean"),
    ("completions", dict(prompt=123), "prompt", "prompt must be a string or a list of token"),
    ("completions", dict(typical_epsilon=-1), "typical_epsilon",
     "typical_epsilon must be a number in [0, 3.4e+38], got -1"),
    ("completions", dict(stop_token_ids=[1, True]), "stop_token_ids",
     "stop_token_ids[1] must be an integer in 0..2147483647, got true"),
    ("completions", dict(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 non-empty"),
    ("completions", dict(stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage", "stream_options.include_usage must be a boolean, got 1"),
    ("completions", dict(model=None), "model", "model is required"),
    ("chat", dict(messages=[{"role": "user"}]), "messages[0].content",
     "messages[0].content is required"),
    ("chat", dict(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "messages[0].content must be a string or a list of text parts"),
    ("chat", dict(messages=[{"role": "robot", "content": "Hi"}]), "messages[0].role",
     'messages[0].role must be '),
    ("chat", dict(messages=SHORT + [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), "messages[1].content[0].type",
     "only text parts are supported"),
    ("chat", dict(messages=[{"role": "user", "content": "Hi", "name": "Lily"}]),
     "messages[0].name", "unrecognized request argument: messages[0].name"),
    ("chat", dict(messages=[]), "messages", "messages must be a non-empty list"),
    ("chat", dict(max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens must be an integer in 1..2147483647, got 0"),
    ("chat", dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata",
     "metadata takes at most 16 keys"),
    ("completions", dict({f"k{i}": 1 for i in range(50_000)}), "k0",
     "unrecognized request argument: k0"),  # one error, not 50,000
    ("completions", {"a\nb": 1}, "a\\nb", "unrecognized request argument: a\\nb"),  # one line
])
async def test_types_are_strict_and_errors_name_the_field(stub_engine, endpoint, extra, param,
                                                          message):
    """A bool is not an integer nor a number, a string is not an integer; a nested field is
    named by its path."""
    assert message in await refusal(stub_engine, endpoint, extra, param)


INT32 = "an integer in 1..2147483647"


@pytest.mark.parametrize("endpoint, extra, param, message", [
    # past what the engine's int32 / float32 rows hold: refused here, never sent on
    ("completions", dict(max_tokens=2**31), "max_tokens",
     f"max_tokens must be {INT32}, got 2147483648"),
    ("completions", dict(max_tokens=2**64 + 3), "max_tokens", f"max_tokens must be {INT32}"),
    ("chat", dict(max_tokens=2**31), "max_tokens", f"max_tokens must be {INT32}"),
    ("chat", dict(max_completion_tokens=2**31), "max_completion_tokens",
     f"max_completion_tokens must be {INT32}, got 2147483648"),
    ("completions", dict(top_k=2**31), "top_k",
     f"top_k must be {INT32}, or 0 or -1 for no top-k, got 2147483648"),
    ("chat", dict(top_k=2**32 + 1), "top_k", f"top_k must be {INT32}, or 0 or -1"),
    ("completions", dict(temperature=2.5), "temperature", "must be a number in [0, 2]"),
    ("completions", dict(top_p=1.5), "top_p", "top_p must be a number in (0, 1]"),
    ("completions", dict(typical_epsilon=1e39), "typical_epsilon",
     "typical_epsilon must be a number in [0, 3.4e+38], got 1e+39"),
    ("chat", dict(typical_delta=1e300), "typical_delta", "typical_delta must be a number in"),
    ("completions", dict(seed=2**64), "seed", "seed must be a 64-bit integer"),
    ("completions", dict(seed=-2**63 - 1), "seed", "seed must be a 64-bit integer"),
    ("completions", dict(stop_token_ids=[2**31]), "stop_token_ids",
     "stop_token_ids[0] must be an integer in 0..2147483647, got 2147483648"),
    ("completions", dict(stop_token_ids=[-1]), "stop_token_ids",
     "stop_token_ids[0] must be an integer in 0..2147483647, got -1"),
    ("completions", dict(presence_penalty=1e300), "presence_penalty", "in [-2, 2]"),
    ("completions", dict(n=2**70), "n", "n must be 1"),
    # of the wrong type: never truncated, converted or read as a number
    ("completions", dict(max_tokens="5"), "max_tokens", f'max_tokens must be {INT32}, got "5"'),
    ("chat", dict(max_completion_tokens=4.0), "max_completion_tokens",
     f"max_completion_tokens must be {INT32}, got 4.0"),
    ("chat", dict(max_completion_tokens=False), "max_completion_tokens",
     f"max_completion_tokens must be {INT32}, got false"),
    ("completions", dict(top_k=1.5), "top_k", f"top_k must be {INT32}, or 0 or -1"),
    ("completions", dict(top_k="5"), "top_k", f"top_k must be {INT32}, or 0 or -1"),
    ("completions", dict(top_k=True), "top_k", f"top_k must be {INT32}, or 0 or -1"),
    ("chat", dict(temperature="0.5"), "temperature", "temperature must be a number in [0, 2]"),
    ("completions", dict(top_p="1"), "top_p", "top_p must be a number in (0, 1]"),
    ("completions", dict(top_p=False), "top_p", "top_p must be a number in (0, 1]"),
    ("completions", dict(typical_epsilon="0.1"), "typical_epsilon",
     "typical_epsilon must be a number in [0, 3.4e+38]"),
    ("completions", dict(typical_delta=True), "typical_delta", "typical_delta must be a number"),
    ("completions", dict(seed=1.5), "seed", "seed must be a 64-bit integer, got 1.5"),
    ("completions", dict(seed=True), "seed", "seed must be a 64-bit integer, got true"),
    ("completions", dict(stop_token_ids=[2.0]), "stop_token_ids",
     "stop_token_ids[0] must be an integer in 0..2147483647, got 2.0"),
    ("completions", dict(stop_token_ids="2"), "stop_token_ids",
     "stop_token_ids must be a list of integers"),
    ("completions", dict(presence_penalty="0"), "presence_penalty", "in [-2, 2]"),
    ("completions", dict(n=1.0), "n", "n must be an integer, got 1.0"),
])
async def test_numbers_are_bounded_by_what_the_engine_holds(stub_engine, endpoint, extra, param,
                                                            message):
    """Each numeric field, too large or of the wrong type: a 400 naming it, the engine never
    asked (a top_k of 2**31 once stopped the engine for every client)."""
    assert message in await refusal(stub_engine, endpoint, extra, param)


async def test_the_largest_numbers_the_engine_holds_pass(stub_engine):
    """At the bounds: accepted and passed on as they are (the stub answers; max_tokens past
    the context is the engine's 400, not the request's)."""
    async with serve(stub_engine) as c:
        r = await c.post("/v1/completions", json=completion(
            top_k=2**31 - 1, seed=2**63 - 1, typical_epsilon=None, stop_token_ids=[258]))
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json=completion(max_tokens=2**31 - 1))
    assert "exceeds the context" in error(r, 400, "max_tokens")["message"]
    assert stub_engine.submitted[0].top_k == 2**31 - 1


async def test_what_the_engine_refuses_is_a_400_in_the_same_envelope(stub_engine):
    """A ValueError of `Engine.submit` (here: typical thresholds on a plain engine)."""
    async with serve(stub_engine) as c:
        r = await c.post("/v1/completions", json=completion(temperature=0.7, typical_delta=0.5))
    assert error(r, 400, None)["message"] == (
        "typical_delta applies to typical acceptance (infer.serve --acceptance typical); this "
        "server runs plain decoding")


@pytest.mark.parametrize("data, message", [
    (b"[1, 2]", "must be a JSON object"), (b"null", "must be a JSON object"),
    (b"5", "must be a JSON object"), (b'"Once"', "must be a JSON object"),
    (b"", "not valid JSON"), (b"{not json", "not valid JSON"), (b"[" * 10_000, "not valid JSON"),
    (b'{"model": "stub-model", "prompt": "Once"', "not valid JSON"),
])
async def test_a_body_that_is_not_an_object_is_refused(stub_engine, data, message):
    async with serve(stub_engine) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await c.post(path, content=data, headers={"content-type": "application/json"})
            assert message in error(r, 400, None, None)["message"]


async def test_null_is_absent_and_text_parts_are_text(stub_engine):
    """OpenAI's clients send null for what they leave out; a message's content may be text
    parts, joined."""
    nulls = dict(seed=None, stop=None, top_p=None, n=None, stream_options=None,
                 logit_bias=None, user=None, temperature=None, max_tokens=None)
    async with serve(stub_engine) as c:
        plain = await c.post("/v1/completions", json=completion(max_tokens=None))
        null = await c.post("/v1/completions", json=completion(**nulls))
        texts = [await c.post("/v1/chat/completions", json=chat(
            messages=SHORT + [{"role": "user", "content": content}]))
            for content in ("Hi there", [{"type": "text", "text": "Hi"},
                                         {"type": "text", "text": " there"}])]
    assert plain.status_code == null.status_code == 200, null.text
    assert plain.json()["choices"] == null.json()["choices"]
    assert null.json()["choices"][0]["text"] == stub_engine.answer_text(ONCE, 16)  # default 16
    a, b = stub_engine.submitted[:2]
    assert (a.temperature, a.top_p, a.seed, a.stop_ids) == (b.temperature, b.top_p, b.seed,
                                                             b.stop_ids) == (1.0, 1.0, None, ())
    assert texts[0].status_code == texts[1].status_code == 200, texts[1].text
    assert texts[0].json()["usage"] == texts[1].json()["usage"]
    assert texts[0].json()["choices"] == texts[1].json()["choices"]
    assert stub_engine.submitted[2].prompt == stub_engine.submitted[3].prompt


# ----------------------------------------------------------------------------- refusals


async def test_a_body_past_the_limit_gets_413_before_it_is_read(stub_engine):
    limit = 1000
    body = json.dumps(completion(prompt="a" * 2000)).encode()

    async def chunked():  # no Content-Length: the limit applies while reading
        for _ in range(50):
            yield b" " * 100

    async with serve(stub_engine, max_request_bytes=limit) as c:
        for content in (body, chunked()):
            r = await c.post("/v1/completions", content=content,
                             headers={"content-type": "application/json"})
            err = error(r, 413, None, "request_too_large")
            assert "--max-request-bytes" in err["message"] and str(limit) in err["message"]
        exact = json.dumps(completion()).encode()
        exact += b" " * (limit - len(exact))  # at the limit: read and answered
        r = await c.post("/v1/completions", content=exact,
                         headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert len(stub_engine.submitted) == 1


async def test_bodies_must_be_declared_json(stub_engine):
    body = json.dumps(completion()).encode()
    async with serve(stub_engine) as c:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     None):
            headers = {"content-type": kind} if kind else {}
            r = await c.post("/v1/completions", content=body, headers=headers)
            err = error(r, 415, None, "unsupported_media_type")
            assert (kind or "none") in err["message"]
        assert stub_engine.submitted == []
        r = await c.post("/v1/completions", content=body,
                         headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200, r.text


async def test_an_api_key_is_required_on_v1_only(stub_engine):
    key = "sk-test"
    async with serve(stub_engine, api_key=key) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key},
                        {"authorization": f"Basic {key}"}):
            for r in (await c.get("/v1/models", headers=headers),
                      await c.post("/v1/completions", json=completion(), headers=headers)):
                err = error(r, 401, None, "invalid_api_key")
                assert "API key" in err["message"]
        assert stub_engine.submitted == []
        for scheme in ("Bearer", "bearer"):
            r = await c.post("/v1/completions", json=completion(),
                             headers={"authorization": f"{scheme} {key}"})
            assert r.status_code == 200, r.text
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_a_loopback_server_answers_only_to_its_own_names(stub_engine):
    async with serve(stub_engine, allowed_hosts=loopback_hosts("127.0.0.1")) as c:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            r = await c.get("/health", headers={"host": host})
            error(r, 403, None, "invalid_host")
        for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000",
                     "LOCALHOST"):
            assert (await c.get("/health", headers={"host": host})).status_code == 200, host


@pytest.mark.parametrize("bound", ["::ffff:127.0.0.1", "::ffff:7f00:1", "::ffff:127.0.0.2",
                                   "::1", "127.0.0.5", "0:0:0:0:0:0:0:1"])
async def test_every_spelling_of_a_loopback_address_is_guarded(stub_engine, bound):
    """An IPv4-mapped loopback address (which Python's `is_loopback` does not know) is
    loopback too: the Host check is on, and the address itself is one of the names."""
    hosts = loopback_hosts(bound)
    assert hosts is not None and (f"[{bound}]" if ":" in bound else bound) in hosts
    async with serve(stub_engine, allowed_hosts=hosts) as c:
        r = await c.get("/health", headers={"host": "evil.example.com"})
        error(r, 403, None, "invalid_host")
        assert (await c.get("/health", headers={"host": "localhost:8000"})).status_code == 200


def test_other_addresses_have_no_host_check():
    for bound in ("0.0.0.0", "::", "192.168.1.7", "::ffff:192.168.1.7", "example.com"):
        assert loopback_hosts(bound) is None, bound


async def test_unknown_models_and_paths_are_404(stub_engine):
    async with serve(stub_engine) as c:
        r = await c.post("/v1/completions", json=completion(model="gpt-9"))
        assert "does not exist" in error(r, 404, "model", "model_not_found")["message"]
        r = await c.post("/v1/chat/completions", json=chat(model="gpt-9"))
        error(r, 404, "model", "model_not_found")
        r = await c.get("/v1/nothing")
        assert error(r, 404, None, None)["type"] == "not_found_error"
    assert stub_engine.submitted == []


async def test_what_does_not_fit_is_refused_before_the_engine(stub_engine):
    """The stub's context: prompts of up to 64 tokens, 128 in all."""
    async with serve(stub_engine) as c:
        cases = [
            (completion(prompt=[5] * 65), "prompt", "context_length_exceeded",
             "prompt of 65 token ids"),
            # past 2 x 64 tokens x 6 characters ("<0xFF>", the longest piece): by its
            # length, before tokenizing
            (completion(prompt="a" * 769), "prompt", "context_length_exceeded",
             "prompt of 769 characters"),
            (completion(prompt="a" * 70), "prompt", "context_length_exceeded",
             "the prompt (71 tokens)"),
            (completion(prompt="Once", max_tokens=124), "max_tokens", "context_length_exceeded",
             "= 129 exceeds the context of 128 tokens"),
            (completion(prompt=[stub_engine.tokenizer.vocab_size]), "prompt", None,
             "prompt[0] = 259 is not a token id"),
            (completion(stop_token_ids=[259]), "stop_token_ids", None, "(0..258)"),
            (chat(messages=[{"role": "user", "content": "a" * 200}]), "messages",
             "context_length_exceeded", "longer than the longest prompt"),
        ]
        for body, param, code, message in cases:
            r = await c.post("/v1/chat/completions" if "messages" in body else "/v1/completions",
                             json=body)
            assert message in error(r, 400, param, code)["message"]
        r = await c.post("/v1/completions", json=completion(prompt="Once", max_tokens=123))
        assert r.status_code == 200, r.text  # 5 + 123 = 128: it fits
    assert len(stub_engine.submitted) == 1


async def test_a_full_queue_answers_429(stub_engine):
    stub_engine.pause()
    async with serve(stub_engine) as c:
        held = [asyncio.create_task(c.post("/v1/completions", json=completion()))
                for _ in range(stub_engine.max_queue)]
        for _ in range(10_000):  # until both wait in the engine
            if len(stub_engine.waiting) == stub_engine.max_queue:
                break
            await asyncio.sleep(0.001)
        r = await c.post("/v1/completions", json=completion())
        err = error(r, 429, None, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]
        stub_engine.resume()
        for r in await asyncio.gather(*held):
            assert r.json()["choices"][0]["text"] == "fghi"


async def test_a_stopped_engine_ends_requests_with_503_and_an_error_chunk(stub_engine):
    stub_engine.pause()
    async with serve(stub_engine) as c:
        plain = asyncio.create_task(c.post("/v1/completions", json=completion()))
        stream = asyncio.create_task(c.post("/v1/completions", json=completion(stream=True)))
        for _ in range(10_000):
            if len(stub_engine.waiting) == 2:
                break
            await asyncio.sleep(0.001)
        stub_engine.stop("the server is shutting down")
        err = error(await plain, 503, None, None)
        assert err["type"] == "server_error" and "shutting down" in err["message"]
        ev = events(await stream)
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["type"] == "server_error"
        assert set(ev[-2]["error"]) == {"message", "type", "param", "code"}
        r = await c.post("/v1/completions", json=completion())
        assert "stopped" in error(r, 503, None, None)["message"]
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "stopped"})


async def test_a_request_that_fails_in_the_engine_gets_500_and_the_rest_go_on(stub_engine):
    """The engine ends one request with an error and runs on (`Engine` fails a request
    alone): that request gets a 500 (or an error chunk), the next is answered and /health
    stays ok."""
    stub_engine.failing_seeds = {666}
    async with serve(stub_engine) as c:
        err = error(await c.post("/v1/completions", json=completion(seed=666)), 500, None, None)
        assert err["type"] == "server_error" and "OverflowError" in err["message"]
        ev = events(await c.post("/v1/completions", json=completion(seed=666, stream=True)))
        assert ev[-1] == "[DONE]" and "OverflowError" in ev[-2]["error"]["message"]
        r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fghi"
        assert (await c.get("/health")).json()["status"] == "ok"


# ----------------------------------------------------------------------------- answers


async def test_a_completion_with_usage(stub_engine):
    async with serve(stub_engine) as c:
        r = await c.post("/v1/completions", json=completion(
            temperature=0, top_k=-1, top_p=0.5, seed=7, stop_token_ids=[9], cache_prompt=False,
            user="u", presence_penalty=0, frequency_penalty=0, logit_bias={}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                "text": "fghi"}]
    assert body["usage"] == {"prompt_tokens": ONCE, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    req = stub_engine.submitted[0]  # what reached the engine
    assert req.prompt == [1, 3 + ord("O"), 3 + ord("n"), 3 + ord("c"), 3 + ord("e")]
    assert (req.max_tokens, req.temperature, req.top_k, req.top_p, req.seed, req.stop_ids,
            req.cache_prompt) == (4, 0.0, 0, 0.5, 7, (9,), False)


async def test_max_tokens_eos_stop_strings_and_stop_ids_end_an_answer(stub_engine):
    letters = stub_engine.answer_text(ONCE, stub_engine.ANSWER_LEN)
    assert letters == "fghijklmnopqrstuvwxy"
    cases = [  # (extra, text, finish, completion tokens)
        (dict(max_tokens=None), letters[:16], "length", 16),  # OpenAI's default: 16
        (dict(max_tokens=50), letters, "stop", 21),  # EOS: counted, not text
        (dict(max_tokens=50, stop="jk"), "fghi", "stop", 6),  # the token that completed it
        (dict(max_tokens=50, stop=["zz", "hij"]), "fg", "stop", 5),
        (dict(max_tokens=50, stop_token_ids=[3 + ord("h")]), None, "stop", 3),
        (dict(max_tokens=8, stop="xyz"), letters[:8], "length", 8),
        (dict(max_tokens=4, echo=True), "Oncefghi", "length", 4),
        (dict(max_tokens=4, prompt=[1, 2, 3]), "defg", "length", 4),  # token ids
    ]
    async with serve(stub_engine) as c:
        for extra, text, finish, n in cases:
            r = await c.post("/v1/completions", json=completion(return_token_ids=True, **extra))
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            assert (choice["finish_reason"], usage["completion_tokens"]) == (finish, n), extra
            assert len(choice["token_ids"]) == n
            if text is not None:
                assert choice["text"] == text, extra
    assert choice["token_ids"] == stub_engine.answer(3)[:4]


async def test_a_streamed_completion_is_the_same_answer_in_chunks(stub_engine):
    async with serve(stub_engine) as c:
        whole = (await c.post("/v1/completions", json=completion(max_tokens=10))).json()
        r = await c.post("/v1/completions", json=completion(
            max_tokens=10, stream=True, stream_options={"include_usage": True},
            return_token_ids=True))
        bare = await c.post("/v1/completions", json=completion(max_tokens=10, stream=True))
    ev = events(r)
    assert ev[-1] == "[DONE]"
    chunks, usage = ev[:-2], ev[-2]
    assert len(chunks) == 4  # the stub's 3 tokens per event
    assert all(x["object"] == "text_completion" and x["model"] == MODEL and x["usage"] is None
               and x["id"] == chunks[0]["id"] for x in chunks)
    assert "".join(x["choices"][0]["text"] for x in chunks) == whole["choices"][0]["text"] \
        == "fghijklmno"
    assert [x["choices"][0]["finish_reason"] for x in chunks] == [None] * 3 + ["length"]
    assert sum((x["choices"][0]["token_ids"] for x in chunks), []) == stub_engine.answer(ONCE)[:10]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    plain = events(bare)
    assert plain[-1] == "[DONE]" and "usage" not in plain[0] and len(plain) == 5
    assert "token_ids" not in plain[0]["choices"][0]


async def test_a_chat_completion_streamed_or_not(stub_engine):
    messages = SHORT + [{"role": "user", "content": "Hi"}]
    prompt = vicuna_prompt([(m["role"], m["content"]) for m in messages], stub_engine.tokenizer)
    n = len(prompt)
    async with serve(stub_engine) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=None))
        s = await c.post("/v1/chat/completions", json=chat(
            max_tokens=None, stream=True, stream_options={"include_usage": True}))
        short = await c.post("/v1/chat/completions", json=chat(max_completion_tokens=3,
                                                               max_tokens=50))
    assert stub_engine.submitted[0].prompt == prompt
    assert stub_engine.submitted[0].max_tokens == 128 - n  # chat's default: what fits
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    answer = stub_engine.answer_text(n, stub_engine.ANSWER_LEN)
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                "message": {"role": "assistant", "content": answer}}]
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 21,
                             "total_tokens": n + 21, "prompt_tokens_details": {"cached_tokens": 0}}
    ev = events(s)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"] == body["usage"]
    chunks = ev[:-2]
    assert all(x["object"] == "chat.completion.chunk" for x in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(x["choices"][0]["delta"].get("content", "") for x in chunks) == answer
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert short.json()["choices"][0]["message"]["content"] == answer[:3]  # max_completion_tokens


async def test_the_openai_client_reads_the_answers_and_the_errors(stub_engine):
    openai = pytest.importorskip("openai")
    app = create_app(stub_engine, MODEL)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=30)
    async with openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none",
                                  max_retries=0, http_client=http) as client:
        r = await client.completions.create(model=MODEL, prompt="Once", max_tokens=4)
        assert r.choices[0].text == "fghi" and r.usage.total_tokens == 9
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat()["messages"], max_tokens=4, stream=True)
        text = "".join([x.choices[0].delta.content or "" async for x in stream])
        assert len(text) == 4
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.completions.create(model="nope", prompt="Hi")
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            await client.chat.completions.create(model=MODEL, messages=chat()["messages"], n=2)
    app.state.server.pool.shutdown(wait=False)


# ----------------------------------------------------------------------------- the rest


async def test_models(stub_engine):
    async with serve(stub_engine) as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert {k: model[k] for k in ("id", "object", "owned_by")} == {
        "id": MODEL, "object": "model", "owned_by": "medusa_jax"}
    assert isinstance(model["created"], int)


async def test_health_says_starting_then_ok(stub_engine):
    stub_engine.ready = False
    async with serve(stub_engine) as c:
        r = await c.get("/health")
        assert r.status_code == 503
        assert r.json() == {"status": "starting", "compiled": 1, "programs": 3,
                            "compiling": "step"}
        stub_engine.ready = True
        r = await c.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "slots": 4, "slots_in_use": 0, "queue_depth": 0,
                        "decoding": "plain", "drafter": None, "shared_pool": None,
                        "compiled": 3, "programs": 3, "compiling": None}


async def test_metrics_count_each_finish_reason(stub_engine):
    async with serve(stub_engine) as c:
        await c.post("/v1/completions", json=completion(max_tokens=4))  # length
        await c.post("/v1/completions", json=completion(max_tokens=50, stop="jk"))  # stop
        await c.post("/v1/completions", json=completion(max_tokens=50))  # EOS: stop
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = dict(line.rsplit(" ", 1) for line in r.text.splitlines()
                  if line and not line.startswith("#"))
    assert float(values['medusa_requests_total{finish="length"}']) == 1
    assert float(values['medusa_requests_total{finish="stop"}']) == 2
    assert float(values['medusa_requests_total{finish="cancelled"}']) == 0
    assert float(values["medusa_prompt_tokens_total"]) == 3 * ONCE
    assert float(values["medusa_generation_tokens_total"]) == 4 + 6 + 21
    assert float(values["medusa_slots"]) == 4
    assert "# TYPE medusa_time_to_first_token_seconds histogram" in r.text

