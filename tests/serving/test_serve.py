"""`python -m infer.serve` as a process on 127.0.0.1, talked to with the `openai` client and
plain HTTP: greedy completions and chat (streamed or not) give `Medusa.generate`'s tokens,
concurrent requests beyond the slots too; max_tokens / stop strings / stop tokens inside an
accepted span; usage; sampled requests reproducible and distributed as plain sampling;
OpenAI-shaped errors; a disconnect frees its slot; SIGTERM ends in-flight streams with an
error chunk and the process exits. One server for the whole module (the engine shapes of
test_engine, so its compiled programs come from the shared cache)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from medusa_jax.runtime import assets

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]  # the repository
SLOTS, CONTEXT, NEW, QUEUE = 4, 128, 24, 4
MODEL = "stories260K"
SYSTEM = [{"role": "system", "content": "Short stories."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(_started, offline, patient):
    """(process, url) of the running server; the offline references are computed while it
    compiles."""
    proc, url = _started
    _wait_ready(proc, url, patient)
    return proc, url


def _launch(heads: str = "default", slots: int = SLOTS, buckets: str = "16,64",
            warmup: str = "background"):
    """`python -m infer.serve --heads HEADS` with the engine shapes of test_engine (and a
    16-token bucket, which the rest of a prompt after a cached prefix takes):
    (process, url)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.serve", "--heads", heads, "--slots", str(slots),
         "--max-context", str(CONTEXT), "--prefill-buckets", buckets, "--window-block", "64",
         "--max-queue", str(QUEUE), "--warmup", warmup, "--port", str(port)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _health(url) -> tuple[int | None, dict]:
    try:
        r = httpx.get(url + "/health", timeout=10)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return None, {}


def _wait_ready(proc, url, patient):
    """Until /health answers 200, for as long as the programs compiled go up (`patient`:
    a loaded machine only makes it slower)."""
    patient(lambda: proc.poll() is not None or _health(url)[0] == 200,
            lambda: _health(url)[1].get("compiled"), "the server's start", poll=0.2)
    if proc.poll() is not None:
        pytest.fail(f"the server did not start:\n{proc.stdout.read()}")


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def _started():
    proc, url = _launch()
    yield proc, url
    _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(medusa_default):
    return medusa_default  # Medusa.load(heads="default"), shared by the session


PROMPTS = assets.heldout_prompts()[:8]
LONG = "Once upon a time"  # its greedy story runs past 100 tokens (no EOS)
CHAT = SYSTEM + [{"role": "user", "content": "Tell me about a cat."}]


@pytest.fixture(scope="module")
def offline(model):
    """prompt ids -> `Medusa.generate`'s greedy result (NEW tokens) for PROMPTS and the
    chat prompt, decoded in one batch (one compile)."""
    from medusa_jax.serving.server import vicuna_prompt

    chat = vicuna_prompt([(m["role"], m["content"]) for m in CHAT], model.tokenizer)
    ids = [model.encode(p) for p in PROMPTS] + [chat]
    table = {tuple(i): g for i, g in zip(ids, model.generate(ids, max_new_tokens=NEW,
                                                                batch_size=len(ids)))}
    return lambda ids_list: [table[tuple(i)] for i in ids_list]


def _sse(response) -> list:
    """The `data:` payloads of an event stream (JSON, or the string "[DONE]")."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            body = line[len("data: "):]
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_greedy_completions_match_offline_streamed_or_not(client, server, model, offline):
    refs = offline([model.encode(p) for p in PROMPTS[:3]])
    for prompt, ref in zip(PROMPTS[:3], refs):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                      temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.token_ids == ref.token_ids and choice.text == ref.text
        assert choice.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(model.encode(prompt)),
                                                                      NEW)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == "length"
    # token ids as the prompt, plain HTTP, the usage chunk just before [DONE]
    ids = model.encode(PROMPTS[0])
    with httpx.stream("POST", server[1] + "/v1/completions", timeout=60, json=dict(
            model=MODEL, prompt=ids, max_tokens=NEW, temperature=0, stream=True,
            stream_options={"include_usage": True}, return_token_ids=True)) as resp:
        events = _sse(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    # the same prompt was served already, but its cached prefix pays only once the
    # background warm-up has compiled the prefix cache's programs (the last ones)
    cached = events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached in (0, len(ids) - 1)
    assert events[-2]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": NEW,
                                   "total_tokens": len(ids) + NEW,
                                   "prompt_tokens_details": {"cached_tokens": cached}}
    assert sum((e["choices"][0]["token_ids"] for e in events[:-2]), []) == refs[0].token_ids
    assert all(e["usage"] is None for e in events[:-2])


@pytest.mark.slow
@pytest.mark.subprocess
def test_chat_matches_offline_on_the_vicuna_template(client, model, offline):
    from medusa_jax.serving.server import vicuna_prompt

    msgs = CHAT
    ids = vicuna_prompt([(m["role"], m["content"]) for m in msgs], model.tokenizer)
    assert ids[0] == model.tokenizer.bos_token_id and len(ids) < 40
    ref = offline([ids])[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=NEW,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == NEW
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs,
                                                 max_completion_tokens=NEW, temperature=0,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == NEW and not chunks[-1].choices


@pytest.mark.slow
@pytest.mark.subprocess
def test_staggered_concurrent_requests_beyond_the_slots(client, model, offline):
    prompts = PROMPTS[:SLOTS + QUEUE]
    refs = offline([model.encode(p) for p in prompts])
    got = [None] * len(prompts)

    def one(i):
        stream = i % 2 == 0
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=NEW,
                                      temperature=0, stream=stream)
        got[i] = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.005 * (i % 3))
    for t in threads:
        t.join(60)
    assert got == [r.text for r in refs]


@pytest.mark.slow
@pytest.mark.subprocess
def test_max_tokens_stop_strings_and_stop_tokens_inside_accepted_spans(client, model, offline):
    prompt = PROMPTS[1]
    ref = offline([model.encode(prompt)])[0]
    for n in (1, 2, 3, 5):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == ref.token_ids[:n]
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", n)
    # a stop string that starts inside a token and ends inside a later one
    text = ref.text
    stop = text[len(text) // 3 + 1: len(text) // 3 + 6]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                      stop=[stop, "never in this text"], stream=stream)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    j = 4  # a stop token (as EOS would be) inside a span: kept, and the end
    tok = ref.token_ids[j]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                  extra_body={"stop_token_ids": [tok], "return_token_ids": True})
    first = ref.token_ids.index(tok)
    assert r.choices[0].token_ids == ref.token_ids[:first + 1]
    assert r.choices[0].finish_reason == "stop"


def test_utf8_text_is_never_split(model):
    """Multi-byte characters the tokenizer spells as byte tokens come out whole."""
    from medusa_jax.serving.server import Detokenizer

    tok = model.tokenizer
    prompt = tok.encode("Once")
    text = " café ☃ naïve"
    ids = tok.encode("Once" + text)[len(prompt):]
    assert len(ids) > len(text.split())  # really byte-level pieces
    d = Detokenizer(tok, prompt, [])
    parts = [d.add(t)[0] for t in ids]
    parts.append(d.flush())
    assert all("\ufffd" not in p for p in parts) and "".join(parts) == model._continuation(
        prompt, ids)
    d = Detokenizer(tok, prompt, ["ï"])  # a stop string that is one character of two bytes
    out = ""
    for t in ids:
        delta, stopped = d.add(t)
        out += delta
        if stopped:
            break
    assert stopped and out == model._continuation(prompt, ids).split("ï")[0]


@pytest.mark.slow
@pytest.mark.subprocess
def test_seeded_sampling_is_reproducible_and_distributed_as_plain_sampling(server, model,
                                                                           exact_pairs,
                                                                           chi_square_ok):
    from medusa_jax.decoding.acceptance import Sampling

    url = server[1] + "/v1/completions"
    prompt = model.encode(PROMPTS[0])
    body = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=1.0, top_k=3,
                return_token_ids=True)
    n = 240

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            sem = asyncio.Semaphore(SLOTS + QUEUE)

            async def one(seed):
                async with sem:
                    r = await c.post(url, json=dict(body, seed=seed))
                    return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(s) for s in range(n)))

    outs = asyncio.run(run())
    again = httpx.post(url, json=dict(body, seed=7, max_tokens=NEW), timeout=60).json()
    assert httpx.post(url, json=dict(body, seed=7, max_tokens=NEW), timeout=60).json()[
        "choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    v = model.cfg.vocab_size
    counts = np.zeros((v, v))
    for a, b in outs:
        counts[a, b] += 1
    exact = exact_pairs(model, prompt, Sampling(mode="rejection", temperature=1.0, top_k=3))
    ok, ratio = chi_square_ok(counts.ravel(), exact.ravel())
    assert ok, f"not plain sampling's distribution: chi2/critical = {ratio:.2f}"


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("body, status, param", [
    (dict(prompt="Hi", temperature="hot"), 400, "temperature"),
    (dict(prompt="Hi", max_tokens=-1), 400, "max_tokens"),
    (dict(prompt="Hi", max_tokens=2.5), 400, "max_tokens"),
    (dict(prompt=123), 400, "prompt"),
    (dict(prompt="Hi", n=2), 400, "n"),
    (dict(prompt="Hi", model="gpt-9"), 404, "model"),
    (dict(prompt="Hi", stream="yes"), 400, "stream"),
    (dict(prompt=[5] * 70, max_tokens=8), 400, "prompt"),  # longer than prefill's 64
    (dict(prompt="Once upon a time", max_tokens=120), 400, "max_tokens"),  # past the context
    (dict(prompt=[600]), 400, "prompt"),  # not a token id
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, param):
    r = httpx.post(server[1] + "/v1/completions", json=dict(dict(model=MODEL), **body),
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["message"] and "\n" not in err["message"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_openai_client_sees_the_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=SYSTEM, n=2)
    r = httpx.post(server[1] + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_full_queue_answers_429(server):
    url = server[1] + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(url, json=dict(
                model=MODEL, prompt=PROMPTS[i % 8], max_tokens=90, temperature=0))
                for i in range(6 * (SLOTS + QUEUE))))
        return rs

    rs = asyncio.run(run())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(200) >= SLOTS + QUEUE
    err = next(r for r in rs if r.status_code == 429).json()["error"]
    assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.slow
@pytest.mark.subprocess
def test_disconnects_free_their_slots(server, client, model, offline, patient):
    url = server[1]
    before = _metric(url, 'medusa_requests_total{finish="cancelled"}')
    for _ in range(SLOTS):  # read the first chunk of a long stream, then hang up
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json=dict(
                model=MODEL, prompt=LONG, max_tokens=100, temperature=0,
                stream=True)) as resp:
            next(resp.iter_lines())
    in_use = lambda: _health(url)[1].get("slots_in_use")  # noqa: E731
    patient(lambda: in_use() == 0, in_use, "the slots freed", poll=0.05)
    assert _metric(url, 'medusa_requests_total{finish="cancelled"}') > before
    ref = offline([model.encode(PROMPTS[2])])[0]  # the freed slots serve the next request
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=NEW, temperature=0)
    assert r.choices[0].text == ref.text


def _all_compiled(url, patient):
    def compiled():
        h = _health(url)[1]
        return h.get("compiled") is not None and h["compiled"] >= h["programs"]

    patient(compiled, lambda: _health(url)[1].get("compiled"), "every program compiled",
            poll=0.5)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_repeated_prompt_and_a_next_turn_start_after_their_cached_prefix(client, server,
                                                                         model, offline,
                                                                         patient):
    """usage's cached_tokens says how many prompt tokens a slot's cache held, /metrics
    counts them, and the tokens are offline decoding's."""
    from medusa_jax.serving.server import vicuna_prompt

    _all_compiled(server[1], patient)
    hits = _metric(server[1], "medusa_prefix_cache_hits_total")
    ids = vicuna_prompt([(m["role"], m["content"]) for m in CHAT], model.tokenizer)
    answers = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW,
                                              temperature=0) for _ in range(2)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content \
        == offline([ids])[0].text
    assert answers[1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    # the next turn, as token ids: the prompt, the answer and more (the answer's last
    # token is the one the slot's cache does not hold)
    first = model.encode(PROMPTS[1])
    answer = client.completions.create(model=MODEL, prompt=first, max_tokens=NEW, temperature=0,
                                       extra_body={"return_token_ids": True})
    turn = first + answer.choices[0].token_ids + model.encode(PROMPTS[2])[1:8]
    r = client.completions.create(model=MODEL, prompt=turn, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == model.generate([turn], max_new_tokens=8)[0].token_ids
    assert r.usage.prompt_tokens_details.cached_tokens == len(first) + NEW - 1
    assert _metric(server[1], "medusa_prefix_cache_hits_total") >= hits + 2
    assert _metric(server[1], "medusa_prefix_cache_tokens_total") >= len(ids)


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_serve_reports_each_level(server, capsys):
    from infer.bench_serve import main

    assert main(["--url", server[1], "--concurrency", "1,2", "--num-requests", "4",
                 "--max-tokens", "16", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in rows] == [(1, 4, 0),
                                                                             (2, 4, 0)]
    assert all(r["accepted"] > 1.3 and r["ttft_med"] > 0 and r["tpot_med"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.subprocess
def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server[1] + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["slots"] == SLOTS and h["decoding"].startswith("medusa")
    text = httpx.get(server[1] + "/metrics", timeout=10).text
    for name in ("medusa_requests_total", "medusa_generation_tokens_total",
                 "medusa_tokens_per_step", "medusa_queue_depth", "medusa_slots_in_use",
                 "medusa_time_to_first_token_seconds_count"):
        assert name in text
    assert _metric(server[1], "medusa_tokens_per_step") > 1.3  # the heads do speculate
    assert _metric(server[1], 'medusa_requests_total{finish="length"}') > 10


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_ends_streams_with_an_error_and_exits(server):
    proc, url = server
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json=dict(
            model=MODEL, prompt=LONG, max_tokens=100, temperature=0,
            stream=True)) as resp:
        lines = resp.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(x[6:]) if x != "data: [DONE]" else x[6:]
                for x in lines if x.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert "shutting down" in rest[-2]["error"]["message"], rest[-3:]
    t0 = time.time()
    assert proc.wait(20) == 0
    assert time.time() - t0 < 2  # within 2 s of the last stream


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_eagle3_server_gives_plain_greedy_tokens(patient):
    """`--heads eagle` (the shipped EAGLE-3 drafter): /health names it, and concurrent
    greedy completions give plain greedy decoding's tokens."""
    from medusa_jax.api import Medusa

    proc, url = _launch("eagle", slots=2, buckets="64", warmup="lazy")  # its programs only
    try:
        plain = Medusa.load().generate(PROMPTS[:3], max_new_tokens=NEW, medusa=False,
                                       batch_size=3)
        _wait_ready(proc, url, patient)
        assert httpx.get(url + "/health").json()["decoding"].startswith("eagle3 ")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = {}

        def ask(i):
            r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=NEW,
                                          temperature=0, extra_body={"return_token_ids": True})
            out[i] = r.choices[0].token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [out.get(i) for i in range(3)] == [g.token_ids for g in plain]
    finally:
        _stop(proc)
