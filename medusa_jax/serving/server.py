"""An OpenAI-compatible HTTP API over `engine.Engine` (FastAPI; `python -m infer.serve`).

POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors have OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 for bad fields (and for parameters this
server does not implement: never accepted and ignored), 404 for an unknown model, 413 for a
body past the size limit, 429 when the request queue is full, 503 once the engine has
stopped. /health answers 503 {"status": "starting"} until the programs the first requests
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
import collections
import concurrent.futures
import json
import logging
import re
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from medusa_jax.serving.engine import Engine, QueueFull, Request
from medusa_jax.serving.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    describe,
)
from medusa_jax.text.encoder import TextEncoder
from medusa_jax.text.templates import vicuna_pieces

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
FINISH_REASONS = ("stop", "length", "cancelled", "error")


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


def _validate(model: type[GenerationRequest], data: bytes) -> GenerationRequest:
    """`data` as a `model` (pydantic parses the JSON too), or the 400 of its first error."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        message, param = describe(e, model)
        raise APIError(400, message, param) from None


# ----------------------------------------------------------------------------- text


class Detokenizer:
    """Incremental text of new tokens after a prompt: `add(token)` -> (new text, stopped).

    Each token decodes a short window, not the whole text (prefix and read offsets, as vLLM
    and TGI do): the tokens since the last point where the text was whole, after a few
    tokens of context, so that a tokenizer that drops a word's leading space at the start of
    a decode (SentencePiece) decodes every new token as it would inside the whole text. A
    window that ends inside a UTF-8 character waits for the next token."""

    CONTEXT = 5  # prompt tokens decoded before the first new one

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids = list(prompt_ids[-self.CONTEXT:])  # context, then the new tokens
        self.prefix = 0  # the window's start in `ids`
        self.read = len(self.ids)  # `ids[:read]` are in `text` (the context as nothing)
        self.prefix_text = self._dec(self.ids)  # what the window's start decodes to
        self.sent = 0  # characters of the text already handed out
        self.text = ""
        self.longest_stop = max((len(s) for s in stops), default=0)

    def _dec(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def _extend(self, whole_only: bool) -> None:
        """Append the window's new text; move the window on when it ends on a whole text."""
        window = self._dec(self.ids[self.prefix:])
        if len(window) <= len(self.prefix_text) or (whole_only and window.endswith("\ufffd")):
            return
        self.text += window[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._dec(self.ids[self.prefix:self.read])

    def _stop_at(self) -> int | None:
        start = max(0, self.sent - self.longest_stop)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def add(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self._extend(whole_only=True)
        cut = self._stop_at()
        if cut is not None:  # the text ends before the stop string
            self.text = self.text[:cut]
            return self._take(cut), True
        safe, hold = len(self.text), 0
        for s in self.stops:  # a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, safe), hold, -1):
                if self.text[safe - k:safe] == s[:k]:
                    hold = k
                    break
        return self._take(safe - hold), False

    def flush(self) -> str:
        """The rest of the text (an unfinished character too), up to a stop string."""
        self._extend(whole_only=False)
        cut = self._stop_at()
        if cut is not None:
            self.text = self.text[:cut]
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


def _chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template, if any. The embedded model's tokenizer
    (`startup.EmbeddedTokenizer`) is asked through its tokenizer_config.json: asking the
    object would load transformers (a second of start-up) to say it has none."""
    if tokenizer is None:
        return None
    from medusa_jax.text.tokenizer import EmbeddedTokenizer

    if isinstance(tokenizer, EmbeddedTokenizer):
        try:
            config = json.loads((tokenizer.path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        if not (isinstance(config, dict) and config.get("chat_template")) and \
                not (tokenizer.path / "chat_template.jinja").is_file():
            return None
    return getattr(tokenizer, "chat_template", None)


def vicuna_prompt(messages: list[tuple[str, str]], tokenizer,
                  encoder: TextEncoder | None = None) -> list[int]:
    """Token ids of a conversation in the Vicuna template, as training renders it
    (`data`), ending with "ASSISTANT:" for the answer to come. The template has no control
    tokens but BOS and the EOS after each answer; the text is tokenized as text."""
    enc = (encoder or TextEncoder(tokenizer)).text
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text, answer in vicuna_pieces(messages):
        ids += enc(text) + (eos if answer else [])
    return ids


_MARK = re.compile("\ue000(\\d+)\ue001")


def template_prompt(messages: list[tuple[str, str]], tokenizer, encoder: TextEncoder,
                    ) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template. When a message holds
    the text of a control token, the template is rendered with a marker in place of each
    message's content, so the template's text and the users' text are told apart
    (`TextEncoder.template`: the user's "</s>" stays text); otherwise the rendered text is
    tokenized whole, exactly as the tokenizer does."""
    render = lambda contents: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": r, "content": c} for (r, _), c in zip(messages, contents)], tokenize=False,
        add_generation_prompt=True)
    find = encoder._special_re
    if find is None or not any(find.search(c) for _, c in messages):
        return list(tokenizer(render([c for _, c in messages]),
                              add_special_tokens=False)["input_ids"])
    text = render([f"\ue000{i}\ue001" for i in range(len(messages))])
    found = [int(m.group(1)) for m in _MARK.finditer(text)]
    if sorted(found) == list(range(len(messages))):
        parts, pos = [], 0
        for m in _MARK.finditer(text):
            parts += [(text[pos:m.start()], True), (messages[int(m.group(1))][1], False)]
            pos = m.end()
        return encoder.template(parts + [(text[pos:], True)])
    # a template that rewrites its contents: the whole text, refused if a message holds a
    # control token (it could not be told from the template's own)
    for i, (_, content) in enumerate(messages):
        hit = encoder._special_re.search(content) if encoder._special_re else None
        if hit:
            raise APIError(400, f"messages[{i}].content holds the control token "
                                f"{hit.group()!r}, which this model's chat template cannot "
                                f"keep apart from its own", f"messages[{i}].content")
    return encoder.template([(render([c for _, c in messages]), True)])


# ----------------------------------------------------------------------------- metrics


class ServerMetrics:
    """/metrics, with prometheus_client's Counter, Gauge and Histogram objects in a registry
    of this server's own. Each finished request is counted once under the finish_reason
    its response reported ("cancelled": its client left first, which also counts as a
    disconnect); the engine's step counters are brought up to date at each scrape."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = e = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("medusa_requests", "Finished requests by the finish_reason "
                                "their response reported (cancelled: the client left first)",
                                ["finish"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish=reason)
        self.disconnects = Counter("medusa_disconnects", "Clients that left before their "
                                   "request finished", registry=r)
        self.prompt_tokens = Counter("medusa_prompt_tokens", "Prompt tokens of the requests "
                                     "queued", registry=r)
        self.generation_tokens = Counter("medusa_generation_tokens", "Tokens generated for "
                                         "the requests", registry=r)
        self._engine_counters = {
            "slot_steps": Counter("medusa_slot_steps", "Decoding steps of live slots",
                                  registry=r),
            "step_tokens": Counter("medusa_step_tokens", "Tokens those steps emitted",
                                   registry=r),
            "calls": Counter("medusa_step_calls", "Engine step calls", registry=r),
            "plain_calls": Counter("medusa_plain_step_calls", "Engine step calls of plain "
                                   "steps under load (--plain-above-slots)", registry=r),
            "resizes": Counter("medusa_cache_resizes", "Times the slots' KV cache was "
                               "resized to the next attention window", registry=r),
            "prefix_hits": Counter("medusa_prefix_cache_hits", "Prompts prefilled after a "
                                   "prefix a slot's cache held", registry=r),
            "prefix_tokens": Counter("medusa_prefix_cache_tokens", "Prompt tokens taken "
                                     "from the prefix cache", registry=r)}
        self._synced = dict.fromkeys(self._engine_counters, 0)
        self.calls_by_slots = Counter("medusa_step_calls_by_slots", "Engine step calls by "
                                      "the slot bucket they computed (the rows a call "
                                      "pays for)", ["slots"], registry=r)
        for n in e.slot_buckets:
            self.calls_by_slots.labels(slots=str(n))
        self._synced_by_slots = collections.Counter()
        self.prefills_by_batch = Counter("medusa_prefill_calls_by_batch", "Prefill calls by "
                                         "the prompts they prefilled together", ["prompts"],
                                         registry=r)
        for n in e.prefill_batches:
            self.prefills_by_batch.labels(prompts=str(n))
        self._synced_by_batch = collections.Counter()
        m = e.metrics
        Gauge("medusa_tokens_per_step", "Tokens per live slot step (accepted length + 1)",
              registry=r).set_function(lambda: m.step_tokens / max(m.slot_steps, 1))
        Gauge("medusa_queue_depth", "Waiting requests", registry=r).set_function(
            e.queue_depth)
        Gauge("medusa_slots_in_use", "Slots holding a request", registry=r).set_function(
            e.slots_in_use)
        Gauge("medusa_slots", "Slots", registry=r).set(e.slots)
        Gauge("medusa_compiled_programs", "Engine programs compiled so far",
              registry=r).set_function(lambda: e.status()["compiled"])
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("medusa_time_to_first_token_seconds", "From the request's "
                              "arrival to its first token", buckets=latency, registry=r)
        self.latency = Histogram("medusa_request_seconds", "From the request's arrival to "
                                 "its end", buckets=latency, registry=r)

    def text(self) -> str:
        from prometheus_client import generate_latest

        m = self.engine.metrics
        for name, counter in self._engine_counters.items():
            now = getattr(m, name)
            if now > self._synced[name]:
                counter.inc(now - self._synced[name])
                self._synced[name] = now
        for n, now in list(m.calls_by_slots.items()):
            if now > self._synced_by_slots[n]:
                self.calls_by_slots.labels(slots=str(n)).inc(now - self._synced_by_slots[n])
                self._synced_by_slots[n] = now
        for n, now in list(m.prefills_by_batch.items()):
            if now > self._synced_by_batch[n]:
                self.prefills_by_batch.labels(prompts=str(n)).inc(now - self._synced_by_batch[n])
                self._synced_by_batch[n] = now
        return generate_latest(self.registry).decode()


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
        self.chat_template = _chat_template(self.tokenizer)
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


# ----------------------------------------------------------------------------- connections


def _raw_error(status: int, reason: str, message: str, type_: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for a connection whose
    request never reached the app (so h11's state machine cannot answer it)."""
    body = json.dumps(error_body(message, type_, None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def guarded_protocol(request_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with a deadline on each request's arrival and a cap on open
    connections (uvicorn has neither: a connection that never finishes its headers holds
    its descriptor for ever, and `limit_concurrency` only answers 503 once headers are in).

    - A request's headers and body must have arrived `request_timeout` seconds after the
      connection opened or its previous answer was sent; else a 408 (nothing if it sent
      nothing) and the connection closes.
    - Past `max_connections` open connections, a new one closes the oldest connection
      that is not running a request (one idle, or still sending its request: that one
      gets a 503), so a new client (a /health probe) always gets in while the descriptors
      last; when every connection runs a request, the new one gets the 503 instead."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = (h11.IDLE, h11.SEND_BODY)  # a request's headers or body still to come
    busy = _raw_error(503, "Service Unavailable", f"too many open connections (the limit is "
                      f"{max_connections}, --max-connections)", "server_error",
                      "too_many_connections")
    late = _raw_error(408, "Request Timeout", f"the request did not arrive within "
                      f"{request_timeout:g} s (--request-timeout)", "invalid_request_error",
                      "request_timeout")
    opened: dict[H11Protocol, None] = {}  # open connections, oldest first

    class Guarded(H11Protocol):
        _deadline = None
        _got = False  # bytes of the awaited request have arrived

        def connection_made(self, transport):
            super().connection_made(transport)
            opened[self] = None
            if len(opened) > max_connections:
                idle = next((c for c in opened if c is not self and c._idle()), None)
                if idle is None:
                    self._close(busy)
                    return
                # an idle kept-alive connection closes silently: its client would read a
                # 503 written there as the answer to its next request
                idle._close(busy if idle._got else b"")
            self._watch()

        def connection_lost(self, exc):
            opened.pop(self, None)
            self._unarm()
            super().connection_lost(exc)

        def data_received(self, data):
            self._got = True
            super().data_received(data)
            self._watch()

        def on_response_complete(self):
            super().on_response_complete()
            self._got = False
            self._unarm()  # the next request's time starts now
            self._watch()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _watch(self):
            """The deadline runs while a request is awaited, and stops once it is in."""
            if self.transport.is_closing() or self.conn.their_state not in waiting:
                self._unarm()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout, self._expire)

        def _unarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state not in waiting:
                return
            answered = self.cycle is not None and not self.cycle.response_complete and \
                self.cycle.response_started
            self._close(late if self._got and not answered else b"")

        def _close(self, response: bytes):
            """Answer `response` (if any) and close; a request the app is reading hears
            that its client is gone."""
            if self.cycle is not None and not self.cycle.response_complete:
                if response:
                    self.cycle.response_started = self.cycle.response_complete = True
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            if response and not self.transport.is_closing():
                self.transport.write(response)
            self.transport.close()
            opened.pop(self, None)
            self._unarm()

    return Guarded


# ----------------------------------------------------------------------------- access


def loopback_hosts(host: str) -> frozenset[str] | None:
    """The Host header names a server bound to `host` answers to when `host` is a loopback
    address (a page on another site can reach a local server through DNS rebinding, but
    its requests carry that site's name); None when `host` is not loopback (no check)."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return None
    return frozenset({"localhost", "127.0.0.1", "[::1]", host if ":" not in host
                      else f"[{host}]"})


def _host_name(value: str) -> str:
    """A Host header's name without its port ("[::1]:8000" -> "[::1]")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AccessGuard:
    """ASGI middleware in front of the app: a Host check on a loopback-bound server, the
    API key on /v1/ (`Authorization: Bearer KEY`, as OpenAI's clients send it; /health and
    /metrics stay open to probes and scrapers), and JSON bodies only on POST (a browser
    page may send text/plain, form and multipart bodies to any site without asking first,
    JSON only after a CORS preflight this server never grants)."""

    def __init__(self, app, api_key: str | None = None,
                 allowed_hosts: frozenset[str] | None = None):
        self.app, self.allowed_hosts = app, allowed_hosts
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        import hmac

        headers = dict(scope["headers"])  # names arrive lower-cased
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host and _host_name(host) not in self.allowed_hosts:
                return APIError(403, f"Host {host[:100]!r} is not this server's: bound to a "
                                     f"loopback address, it answers only to "
                                     f"{', '.join(sorted(self.allowed_hosts))}",
                                type_="permission_error", code="invalid_host")
        if not scope["path"].startswith("/v1/"):
            return None
        if self.api_key is not None:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                      self.api_key):
                return APIError(401, "Incorrect or missing API key: send it as "
                                     "'Authorization: Bearer KEY' (--api-key)",
                                type_="invalid_request_error", code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1")[:100] or "none"
                return APIError(415, f"the body must be JSON with Content-Type "
                                     f"application/json (got {shown})",
                                code="unsupported_media_type")
        return None


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
        if engine._stop_reason is not None:
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
                **compiled}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(srv.metrics.text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
