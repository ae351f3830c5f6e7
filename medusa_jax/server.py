"""An OpenAI-compatible HTTP API over `engine.Engine` (FastAPI; `python -m infer.serve`).

POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors have OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 for bad fields, 404 for an unknown
model, 429 when the request queue is full, 503 once the engine has stopped.

Text is decoded incrementally (`Detokenizer`): the prompt and the new tokens are decoded
together, as `Medusa.generate` does, a trailing incomplete UTF-8 sequence is held back, and
so is any tail that could still become a stop string.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from medusa_jax.data import VICUNA_SYSTEM
from medusa_jax.engine import Engine, QueueFull, Request

MAX_STOP_STRINGS = 4  # as OpenAI


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


def error_body(message, type_="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ----------------------------------------------------------------------------- fields


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and math.isfinite(x))


def _field(body: dict, name: str, check, what: str, default=None):
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if not check(value):
        raise APIError(400, f"{name} must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def sampling_fields(body: dict, max_tokens_names: tuple[str, ...]) -> dict:
    """The generation fields both endpoints share, checked."""
    n = _field(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise APIError(400, f"n must be 1 (this server returns one choice), got {n}", "n")
    for name in ("best_of",):
        if body.get(name) not in (None, 1):
            raise APIError(400, f"{name} is not supported", name)
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "logprobs is not supported", "logprobs")
    max_tokens = None
    for name in max_tokens_names:
        value = _field(body, name, lambda x: _is_int(x) and x >= 1, "an integer >= 1")
        max_tokens = value if value is not None else max_tokens
    temperature = _field(body, "temperature", lambda x: _is_num(x) and 0 <= x <= 2,
                         "a number in [0, 2]", 1.0)
    top_p = _field(body, "top_p", lambda x: _is_num(x) and 0 < x <= 1, "a number in (0, 1]", 1.0)
    top_k = _field(body, "top_k", lambda x: _is_int(x) and x >= -1, "an integer >= 0", 0)
    seed = _field(body, "seed", lambda x: _is_int(x) and -2**63 <= x < 2**63,
                  "a 64-bit integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    stop_ids = _field(body, "stop_token_ids",
                      lambda x: isinstance(x, list) and all(_is_int(t) for t in x),
                      "a list of integers", [])
    stream = _field(body, "stream", lambda x: isinstance(x, bool), "a boolean", False)
    opts = _field(body, "stream_options", lambda x: isinstance(x, dict), "an object", {})
    include_usage = bool(opts.get("include_usage", False))
    token_ids = _field(body, "return_token_ids", lambda x: isinstance(x, bool), "a boolean",
                       False)
    return dict(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                top_k=max(0, top_k), seed=seed, stop=stop, stop_ids=tuple(stop_ids),
                stream=stream, include_usage=include_usage, return_token_ids=token_ids)


# ----------------------------------------------------------------------------- text


class Detokenizer:
    """Incremental text of new tokens after a prompt: `add(token)` -> (new text, stopped)."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.tok, self.prompt, self.stops = tokenizer, list(prompt_ids), stops
        self.ids: list[int] = []
        self.head = self._dec(self.prompt)
        self.sent = 0  # characters of the text already handed out
        self.text = ""

    def _dec(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def _full(self) -> str:
        full = self._dec(self.prompt + self.ids)
        return full[len(self.head):] if full.startswith(self.head) else self._dec(self.ids)

    def add(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self.text = text = self._full()
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:  # the text ends before the stop string
            self.text = text = text[:min(hits)]
            return self._take(len(text)), True
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":  # an incomplete character
            safe -= 1
        hold = 0
        for s in self.stops:  # a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, safe), hold, -1):
                if text[safe - k:safe] == s[:k]:
                    hold = k
                    break
        return self._take(safe - hold), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


def vicuna_prompt(messages: list[tuple[str, str]], tokenizer) -> list[int]:
    """Token ids of a conversation in the Vicuna template, as training renders it
    (`data`), ending with "ASSISTANT:" for the answer to come."""
    enc = lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"]) if t else []  # noqa: E731
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    system = " ".join(t for r, t in messages if r == "system") or VICUNA_SYSTEM
    pending = system + " "
    for role, text in messages:
        if role == "system":
            continue
        if role == "user":
            pending += f"USER: {text} ASSISTANT:"
            continue
        ids += enc(pending) + enc(" " + text) + eos
        pending = ""
    return ids + enc(pending)


# ----------------------------------------------------------------------------- app


class Server:
    """The request handling around one engine."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.name = engine, model_name
        self.model = engine.model
        self.tokenizer = self.model.tokenizer
        self.created = int(time.time())
        self.chat_template = getattr(self.tokenizer, "chat_template", None) \
            if self.tokenizer is not None else None
        self.disconnects = 0

    def _check_model(self, body: dict):
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model must be a string naming a model of GET /v1/models",
                           "model")
        if model != self.name:
            raise APIError(404, f"The model `{model}` does not exist (this server has "
                                f"`{self.name}`)", "model", code="model_not_found")

    def _encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: give token ids", "prompt")
            return self.model.encode(prompt)
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            try:
                return self.model.encode(prompt, "prompt")
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), "prompt") from None
        if isinstance(prompt, list) and len(prompt) > 1:
            raise APIError(400, "prompt: one prompt per request (a batch is not supported)",
                           "prompt")
        raise APIError(400, "prompt must be a string or a list of token ids", "prompt")

    def _encode_chat(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                                 "assistant"):
                raise APIError(400, f"messages[{i}] must be an object with role system, user "
                                    f"or assistant", f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # text parts
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string",
                               f"messages[{i}].content")
            role = "system" if m["role"] == "developer" else m["role"]
            conv.append((role, content))
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: chat is not available", "messages")
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in conv], tokenize=False,
                add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return vicuna_prompt(conv, self.tokenizer)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def run(self, http: HTTPRequest, chat: bool):
        try:
            body = await http.json()
        except Exception:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        self._check_model(body)
        f = sampling_fields(body, ("max_tokens", "max_completion_tokens") if chat
                            else ("max_tokens",))
        if chat:
            prompt = self._encode_chat(body.get("messages"))
        else:
            if "prompt" not in body:
                raise APIError(400, "prompt is required", "prompt")
            prompt = self._encode_prompt(body["prompt"])
        max_tokens = f["max_tokens"]
        if max_tokens is None:  # OpenAI: 16 for completions; chat: what fits
            max_tokens = 16 if not chat else max(1, self.engine.capacity - len(prompt)
                                                 - (self.engine.fed if self.engine.medusa
                                                    else 0))
        try:
            self.engine.check(len(prompt), max_tokens)
        except ValueError as e:
            too_long = (len(prompt) > self.engine.buckets[-1]
                        or len(prompt) + self.engine.fed >= self.engine.capacity)
            raise APIError(400, str(e), ("messages" if chat else "prompt") if too_long
                           else "max_tokens", code="context_length_exceeded") from None
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in f["stop_ids"]):
            raise APIError(400, f"stop_token_ids must be token ids (0..{vocab - 1})",
                           "stop_token_ids")

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(tokens, finish, error):
            loop.call_soon_threadsafe(events.put_nowait, (tokens, finish, error))

        req = Request(prompt=prompt, max_tokens=max_tokens, on_event=on_event,
                      temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                      seed=f["seed"], stop_ids=f["stop_ids"])
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), type_="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from None

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        detok = Detokenizer(self.tokenizer, prompt, f["stop"]) if self.tokenizer else None

        async def pieces():
            """(text, new token ids, finish_reason or None, error or None), until finished."""
            done = False
            try:
                while not done:
                    tokens, finish, error = await events.get()
                    if error is not None:
                        done = True
                        yield "", [], "error", error
                        return
                    text, used = "", []
                    for t in tokens:
                        used.append(t)
                        if detok is not None:
                            delta, stopped = detok.add(t)
                            text += delta
                            if stopped:
                                finish = "stop"
                                self.engine.cancel(req)
                                break
                    if finish is not None and detok is not None:
                        text += detok.flush()
                    done = finish is not None
                    yield text, used, finish, None
            finally:
                if not done:  # the client went away
                    self.engine.cancel(req)

        created = int(time.time())
        if f["stream"]:
            return StreamingResponse(self._stream(rid, created, chat, pieces(), len(prompt), f,
                                                  http, req),
                                     media_type="text/event-stream")
        text, ids, finish = "", [], None
        gen = pieces()

        watcher = asyncio.create_task(self._watch(http, req))
        try:
            async for t, used, fin, error in gen:
                if error is not None:
                    raise APIError(503, error, type_="server_error")
                text += t
                ids += used
                finish = fin
        finally:
            watcher.cancel()
            await gen.aclose()
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if f["return_token_ids"]:
            choice["token_ids"] = ids
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.name, "choices": [choice],
                "usage": self.usage(len(prompt), len(ids))}

    async def _watch(self, http: HTTPRequest, req: Request):
        """Cancel `req` when its client goes away (uvicorn drops what is sent to a closed
        connection without an error, so the response alone would not notice)."""
        while not await http.is_disconnected():
            await asyncio.sleep(0.1)
        if not req.finished:
            self.disconnects += 1
            self.engine.cancel(req)

    async def _stream(self, rid, created, chat, pieces, prompt_tokens, f, http, req):
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if f["include_usage"] else {}

        def chunk(delta_text, ids, finish, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text or finish is None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text, "logprobs": None,
                          "finish_reason": finish}
            if f["return_token_ids"] and not first:
                choice["token_ids"] = ids
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                          "model": self.name, "choices": [choice],
                                          **usage_field}) + "\n\n"

        completion = 0
        watcher = asyncio.create_task(self._watch(http, req))
        try:
            if chat:
                yield chunk("", [], None, first=True)
            async for text, ids, finish, error in pieces:
                if error is not None:
                    yield "data: " + json.dumps(error_body(error, "server_error")) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                completion += len(ids)
                if text or ids or finish:
                    yield chunk(text, ids, finish)
            if f["include_usage"]:
                yield "data: " + json.dumps({
                    "id": rid, "object": obj, "created": created, "model": self.name,
                    "choices": [], "usage": self.usage(prompt_tokens, completion)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            await pieces.aclose()

    def metrics_text(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            SummaryMetricFamily)

        e, m, srv = self.engine, self.engine.metrics, self

        class Collector:
            def collect(self_inner):
                c = CounterMetricFamily("medusa_requests", "Finished requests", labels=["finish"])
                for reason in ("stop", "length", "cancelled", "error"):
                    c.add_metric([reason], m.requests[reason])
                yield c
                yield CounterMetricFamily("medusa_disconnects", "Clients that left before "
                                          "their request finished", value=srv.disconnects)
                yield CounterMetricFamily("medusa_prompt_tokens", "Prompt tokens",
                                          value=m.prompt_tokens)
                yield CounterMetricFamily("medusa_generation_tokens", "Generated tokens",
                                          value=m.generation_tokens)
                yield CounterMetricFamily("medusa_slot_steps", "Decoding steps of live slots",
                                          value=m.slot_steps)
                yield CounterMetricFamily("medusa_step_tokens", "Tokens those steps emitted",
                                          value=m.step_tokens)
                yield CounterMetricFamily("medusa_step_calls", "Engine step calls",
                                          value=m.calls)
                yield GaugeMetricFamily("medusa_tokens_per_step", "Tokens per live slot step "
                                        "(accepted length + 1)",
                                        value=m.step_tokens / max(m.slot_steps, 1))
                yield GaugeMetricFamily("medusa_queue_depth", "Waiting requests",
                                        value=e.queue_depth())
                yield GaugeMetricFamily("medusa_slots_in_use", "Slots holding a request",
                                        value=e.slots_in_use())
                yield GaugeMetricFamily("medusa_slots", "Slots", value=e.slots)
                yield SummaryMetricFamily("medusa_time_to_first_token_seconds",
                                          "Time from submit to the first token",
                                          count_value=m.ttft_count, sum_value=m.ttft_sum)

        reg = CollectorRegistry()
        reg.register(Collector())
        return generate_latest(reg).decode()


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app around a started engine."""
    srv = Server(engine, model_name)
    app = FastAPI(title="medusa_jax", docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def _http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await srv.run(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await srv.run(http, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.name, "object": "model",
                                            "created": srv.created, "owned_by": "medusa_jax"}]}

    @app.get("/health")
    async def health():
        if engine._stop_reason is not None:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok", "slots": engine.slots, "slots_in_use": engine.slots_in_use(),
                "queue_depth": engine.queue_depth(),
                "decoding": f"medusa {engine.tree.name}" if engine.medusa else "plain"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(srv.metrics_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
