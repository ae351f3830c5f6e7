"""An OpenAI-compatible HTTP API over `engine.Engine` (FastAPI; `python -m infer.serve`).

POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors have OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 for bad fields (and for parameters this
server does not implement: never accepted and ignored), 404 for an unknown model, 413 for a
body past the size limit, 429 when the request queue is full, 500 for a request that failed
in the engine (the engine runs on), 503 once the engine has stopped. /health answers 503 {"status": "starting"} until the programs the first requests
need are compiled (requests sent meanwhile wait for them).

The bodies are pydantic models (`requests`) validated by `model_validate_json` after
`read_body` rather than as FastAPI endpoint parameters: FastAPI would read the whole body
before any check (no 413 before the read) and answer errors in its own 422 format.

One request cannot stall the others: the body is read up to a limit (413 past it), a prompt
longer than the longest prefill is refused by its length in characters or ids before any
tokenizing, and tokenizing runs off the event loop. One client cannot hold the connections:
`guarded_protocol` (uvicorn's h11 protocol) gives each request's headers and body a deadline
(408) and caps open connections, closing the oldest one not running a request to let a new
one in. `AccessGuard` checks the API key on /v1/, the Host header on a loopback address
(DNS rebinding) and that POST bodies are declared JSON (415). User text is tokenized as text: a
"</s>" in a prompt or a message is those characters, not EOS; only a chat template's own
text holds control tokens.

Text is decoded incrementally (`Detokenizer`): each new token decodes a short window after
a few tokens of context, so a token costs the same however long the text is and comes out
as it does in the whole text (`Medusa.generate` decodes prompt and answer together); a
trailing incomplete UTF-8 sequence is held back, and so is any tail that could still become
a stop string.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from medusa_jax.serving.engine import Engine, QueueFull, Request
from medusa_jax.serving.errors import APIError, error_body
from medusa_jax.serving.guards import AccessGuard, guarded_protocol, loopback_hosts
from medusa_jax.serving.metrics import FINISH_REASONS, ServerMetrics
from medusa_jax.serving.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    describe,
)
from medusa_jax.serving.text import (
    Detokenizer,
    chat_template_of,
    template_prompt,
    vicuna_prompt,
)
from medusa_jax.text.encoder import TextEncoder

# what callers import from here (the server's pieces live in their own modules)
__all__ = ["APIError", "AccessGuard", "Detokenizer", "FINISH_REASONS", "Server",
           "ServerMetrics", "TextEncoder", "create_app", "error_body", "guarded_protocol",
           "loopback_hosts", "template_prompt", "vicuna_prompt"]

DEFAULT_MAX_REQUEST_BYTES = 1 << 20




def _validate(model: type[GenerationRequest], data: bytes) -> GenerationRequest:
    """`data` as a `model` (pydantic parses the JSON too), or the 400 of its first error."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        message, param = describe(e, model)
        raise APIError(400, message, param) from None


# ----------------------------------------------------------------------------- app


class Server:
    """The request handling around one engine."""

    def __init__(self, engine: Engine, model_name: str,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.engine, self.name = engine, model_name
        self.model = engine.model
        self.tokenizer = self.model.tokenizer
        self.created = int(time.time())
        self.max_request_bytes = max_request_bytes
        self.chat_template = chat_template_of(self.tokenizer)
        self.encoder = TextEncoder(self.tokenizer) if self.tokenizer is not None else None
        tree = engine.fed if engine.medusa else 0
        # the longest prompt any request can have, and (x2 for normalizers that shrink
        # text) the characters beyond which a text cannot fit in it
        self.max_prompt_tokens = max(1, min(engine.buckets[-1], engine.capacity - tree - 1))
        self.max_prompt_chars = 2 * self.max_prompt_tokens * (
            self.encoder.max_token_chars if self.encoder is not None else 1)
        self.metrics = ServerMetrics(engine)
        # tokenizing and big JSON bodies: off the event loop
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="medusa-text")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def read_body(self, http: HTTPRequest, model: type[GenerationRequest],
                        ) -> GenerationRequest:
        """The body as a `model`, read up to `max_request_bytes` (413 past it, before
        reading on) and then validated (400 naming the first bad field)."""
        limit = self.max_request_bytes
        too_big = lambda n: APIError(  # noqa: E731
            413, f"the request body ({n} bytes) is larger than this server takes ({limit} "
                 f"bytes, --max-request-bytes)", code="request_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big(int(declared))
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_big(f"over {limit}")
            chunks.append(chunk)
        data = b"".join(chunks)
        if size < 1 << 16:
            return _validate(model, data)
        return await self._off_loop(_validate, model, data)

    def _check_model(self, model: str):
        if model != self.name:
            raise APIError(404, f"The model `{model[:80]}` does not exist (this server has "
                                f"`{self.name}`)", "model", code="model_not_found")

    def _too_long(self, what: str, param: str):
        return APIError(400, f"{what}: longer than the longest prompt this server takes "
                             f"({self.max_prompt_tokens} tokens)", param,
                        code="context_length_exceeded")

    def _check_prompt(self, prompt: str | list[int]):
        """The prompt's length before any tokenizing, and token ids against the
        vocabulary (its shape is `CompletionRequest`'s)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: give token ids", "prompt")
            if len(prompt) > self.max_prompt_chars:
                raise self._too_long(f"prompt of {len(prompt)} characters", "prompt")
            return prompt
        if len(prompt) > self.max_prompt_tokens:
            raise self._too_long(f"prompt of {len(prompt)} token ids", "prompt")
        vocab = self.model.cfg.vocab_size
        for j, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise APIError(400, f"prompt[{j}] = {t} is not a token id of this model "
                                    f"(0..{vocab - 1})", "prompt")
        return prompt

    def _check_chat(self, body: ChatCompletionRequest) -> list[tuple[str, str]]:
        """The conversation's length before any tokenizing."""
        if len(body.messages) > self.max_prompt_tokens:
            raise self._too_long(f"{len(body.messages)} messages", "messages")
        conv, chars = body.conversation(), 0
        for _, text in conv:
            chars += len(text)
            if chars > self.max_prompt_chars:
                raise self._too_long(f"messages of over {chars} characters", "messages")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: chat is not available", "messages")
        return conv

    def _encode_chat(self, conv: list[tuple[str, str]]) -> list[int]:
        if self.chat_template:
            return template_prompt(conv, self.tokenizer, self.encoder)
        return vicuna_prompt(conv, self.tokenizer, self.encoder)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    async def run(self, http: HTTPRequest, chat: bool):
        """One request, held in the engine (`Engine.hold`) until its answer is sent: a
        stream releases it when it ends."""
        self.engine.hold()
        held = True
        try:
            out = await self._run(http, chat)
            held = not isinstance(out, StreamingResponse)
            return out
        finally:
            if held:
                self.engine.release()

    async def _run(self, http: HTTPRequest, chat: bool):
        t_arrive = time.perf_counter()
        body = await self.read_body(http, ChatCompletionRequest if chat else CompletionRequest)
        self._check_model(body.model)
        f = body.sampling()
        echo_text = ""
        if chat:
            conv = self._check_chat(body)
            prompt = await self._off_loop(self._encode_chat, conv)
        else:
            given = self._check_prompt(body.prompt)
            prompt = await self._off_loop(self.encoder.prompt, given) \
                if isinstance(given, str) else given
            if not prompt:
                raise APIError(400, "prompt encodes to no tokens", "prompt")
            if f["echo"]:
                echo_text = given if isinstance(given, str) else (
                    self.tokenizer.decode(given, skip_special_tokens=True)
                    if self.tokenizer is not None else "")
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
                      seed=f["seed"], stop_ids=f["stop_ids"], cache_prompt=f["cache_prompt"],
                      epsilon=f["epsilon"], delta=f["delta"])
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), type_="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from None
        self.metrics.prompt_tokens.inc(len(prompt))

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        detok = Detokenizer(self.tokenizer, prompt, f["stop"]) if self.tokenizer else None
        metrics = self.metrics
        settled = []

        def settle(reason: str):
            """Count the request once, under the finish reason its response reports."""
            if settled:
                return
            settled.append(reason)
            metrics.requests.labels(finish=reason).inc()
            if reason == "cancelled":
                metrics.disconnects.inc()
            metrics.latency.observe(time.perf_counter() - t_arrive)

        async def pieces():
            """(text, new token ids, finish_reason or None, error or None), until finished."""
            done, first = False, True
            try:
                while not done:
                    tokens, finish, error = await events.get()
                    if error is not None:
                        done = True
                        settle("error")
                        yield "", [], "error", error
                        return
                    if tokens and first:
                        first = False
                        metrics.ttft.observe(time.perf_counter() - t_arrive)
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
                    metrics.generation_tokens.inc(len(used))
                    done = finish is not None
                    if done:
                        settle(finish)  # "cancelled": the watcher saw the client leave
                    yield text, used, finish, None
            finally:
                if not done:  # the client went away
                    self.engine.cancel(req)
                    settle("cancelled")

        created = int(time.time())
        if f["stream"]:
            return StreamingResponse(self._stream(rid, created, chat, pieces(), len(prompt), f,
                                                  http, req, echo_text),
                                     media_type="text/event-stream")
        text, ids, finish = echo_text, [], None
        gen = pieces()

        watcher = asyncio.create_task(self._watch(http, req))
        try:
            async for t, used, fin, error in gen:
                if error is not None:  # 503: the engine stopped; 500: this request failed
                    raise APIError(503 if self.engine.stop_reason is not None else 500, error,
                                   type_="server_error")
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
                "usage": self.usage(len(prompt), len(ids), req.cached)}

    async def _watch(self, http: HTTPRequest, req: Request):
        """Cancel `req` when its client goes away (uvicorn drops what is sent to a closed
        connection without an error, so the response alone would not notice); the engine
        then ends it as "cancelled"."""
        while not await http.is_disconnected():
            await asyncio.sleep(0.1)
        if not req.finished:
            self.engine.cancel(req)

    async def _stream(self, rid, created, chat, pieces, prompt_tokens, f, http, req,
                      echo_text=""):
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
            if echo_text:
                yield chunk(echo_text, [], None)
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
                    "choices": [], "usage": self.usage(prompt_tokens, completion,
                                                       req.cached)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            await pieces.aclose()
            self.engine.release()


def create_app(engine: Engine, model_name: str,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, *,
               api_key: str | None = None,
               allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """The FastAPI app around a started engine (its programs may still be compiling).
    `api_key`: required on /v1/; `allowed_hosts`: the Host names answered (None: any;
    `loopback_hosts`)."""
    srv = Server(engine, model_name, max_request_bytes)
    app = FastAPI(title="medusa_jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(AccessGuard, api_key=api_key, allowed_hosts=allowed_hosts)

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

    from starlette.requests import ClientDisconnect

    @app.exception_handler(ClientDisconnect)
    async def _gone(http: HTTPRequest, _):
        """A connection closed mid-upload (its client left, or --request-timeout): one
        line, not a traceback (nobody hears the answer)."""
        client = f"{http.client.host}:{http.client.port}" if http.client else "a client"
        logging.getLogger("uvicorn.error").warning(
            "%s: the connection closed before its %s request was read whole", client,
            http.url.path)
        return JSONResponse(error_body("the client disconnected"), status_code=400)

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
        if engine.stop_reason is not None:
            return JSONResponse({"status": "stopped"}, status_code=503)
        st = engine.status()
        compiled = {"compiled": st["compiled"], "programs": st["programs"],
                    "compiling": st["compiling"]}
        if not st["ready"]:
            return JSONResponse({"status": "starting", **compiled}, status_code=503)
        return {"status": "ok", "slots": engine.slots, "slots_in_use": engine.slots_in_use(),
                "queue_depth": engine.queue_depth(),
                "decoding": (f"{engine.drafter.kind} {engine.tree.name}" if engine.medusa
                             else "plain"),
                "drafter": engine.drafter.name if engine.medusa else None,
                "shared_pool": (None if engine.pool is None else
                                {"size": engine.pool.size, "entries": engine.pool.entries}),
                **compiled}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(srv.metrics.text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
