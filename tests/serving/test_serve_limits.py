"""`python -m infer.serve` under a hostile client and at start-up, as a process on 127.0.0.1
talked to with httpx and the `openai` client: the port opens before the programs compile
(/health "starting", then "ok", a progress line per program); one client's huge body or
prompt gets 413 / 400 while /health keeps answering within a second; bad fields are
refused by name (a smoke: the whole request contract is test_http_contract's, in process);
user text cannot hold control tokens;
/metrics counts each finish reason as the response reported it; start-up flags fail in one
line before any work; SIGINT ends an idle server within 2 s.

One server for the module (plain decoding), with the compilation cache off so that its
start-up really compiles (about 10 s of compiling on a 2-core CPU)."""

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
import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]  # the repository
MODEL = "stories260K"
LIMIT = 1 << 20  # the default --max-request-bytes
# plain decoding: its programs compile faster than Medusa's, and the limits are the same
ARGS = ["--slots", "4", "--slot-buckets", "1,4", "--max-context", "128", "--prefill-buckets",
        "64", "--prefill-batch", "1", "--window-block", "64", "--max-queue", "4"]
SHORT = [{"role": "system", "content": "Short stories."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """The server process, its URL, its output lines (read as they come) and the first
    /health answers seen from the moment it was launched."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infer.serve", *ARGS, "--no-compile-cache", "--port",
             str(self.port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.health: list[tuple[float, int, dict]] = []  # (seconds after launch, code, body)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, patient):
        """Until /health answers 200, for as long as the server logs lines (`patient`)."""
        def ready():
            try:
                r = httpx.get(self.url + "/health", timeout=10)
                self.health.append((time.time() - self.t0, r.status_code, r.json()))
                return r.status_code == 200
            except httpx.HTTPError:
                return self.proc.poll() is not None

        patient(ready, lambda: len(self.lines), "the server's start", poll=0.05)
        if not (self.health and self.health[-1][1] == 200):
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "\n".join(self.lines))


@pytest.fixture(scope="module")
def launched():
    s = Launched()
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(10)


@pytest.fixture(scope="module")
def url(launched, patient):
    launched.wait_ready(patient)
    return launched.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert err["message"] and "\n" not in err["message"]
    return err


@pytest.mark.slow
@pytest.mark.subprocess
def test_health_answers_starting_while_the_programs_compile(launched, patient):
    """The port opens before compiling; a request sent meanwhile waits and is answered."""
    first = {}

    def early_request():
        while launched.proc.poll() is None:  # until the port opens
            try:
                first["r"] = httpx.post(launched.url + "/v1/completions", timeout=120, json=dict(
                    model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0))
                return
            except httpx.ConnectError:
                time.sleep(0.05)

    t = threading.Thread(target=early_request)
    t.start()
    launched.wait_ready(patient)
    patient(lambda: not t.is_alive(), lambda: len(launched.lines), "the early request")
    starting = [(s, h) for s, code, h in launched.health if code == 503]
    assert starting and all(h["status"] == "starting" for _, h in starting), launched.health
    assert {"compiled", "programs"} <= set(starting[0][1])
    assert first["r"].status_code == 200 and first["r"].json()["choices"][0]["text"]
    progress = [x for x in launched.lines if x.startswith("compiled ")]
    assert [x.split(" in ")[0] for x in progress[:3]] == [
        "compiled prefill (bucket 64)", "compiled insert (bucket 64, window 64)",
        "compiled step (window 64, 1 slot)"], launched.lines
    assert all(x.endswith(("[1/15]", "[2/15]", "[3/15]")) for x in progress[:3])
    assert any(x.startswith("ready for requests") for x in launched.lines)
    # the last program compiles in the background while the next tests run:
    # test_the_rest_compiled_in_the_background checks it


class HealthWatch:
    """Polls /health from a thread; `worst` is the slowest answer (a failure counts as
    infinitely slow)."""

    def __init__(self, url):
        self.url, self.times, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=5) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.times.append(time.perf_counter() - t if ok else float("inf"))
                time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)

    @property
    def worst(self):
        return max(self.times)


def _post_raw(url, data: bytes | object, **kw):
    """POST a raw body; the server may close the connection while it is still sent."""
    try:
        return httpx.post(url + "/v1/completions", content=data, timeout=60,
                          headers={"content-type": "application/json"}, **kw)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return None


@pytest.mark.slow
@pytest.mark.subprocess
def test_one_huge_request_stalls_nobody(url):
    big = b'{"model": "stories260K", "prompt": "' + b"a" * 50_000_000 + b'"}'
    ids = json.dumps(dict(model=MODEL, prompt=[5] * 1_000_000)).encode()
    text = json.dumps(dict(model=MODEL, prompt="Once upon a time, " * 60000)).encode()

    def chunked():  # no Content-Length: the limit applies while reading
        for _ in range(50):
            yield b" " * 100_000

    with HealthWatch(url) as watch:
        for body in (big, ids, text, chunked()):
            t = time.perf_counter()
            r = _post_raw(url, body)
            assert time.perf_counter() - t < 5
            if r is not None:
                _error(r, 413, None)
                assert "--max-request-bytes" in r.json()["error"]["message"]
        # under the byte limit, over the context: refused by length before tokenizing
        for prompt in ("Once upon a time, " * 50000, [5] * 100_000):
            t = time.perf_counter()
            r = httpx.post(url + "/v1/completions", json=dict(model=MODEL, prompt=prompt),
                           timeout=60)
            assert time.perf_counter() - t < 1
            assert _error(r, 400, "prompt")["code"] == "context_length_exceeded"
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(
            model=MODEL, messages=[{"role": "user", "content": "Once upon a time, " * 50000}]))
        assert _error(r, 400, "messages")["code"] == "context_length_exceeded"
        time.sleep(0.3)
    assert watch.worst < 1.0, f"/health took {watch.worst:.2f} s"
    assert len(watch.times) > 5


def _refusal(url, endpoint: str, extra: dict, param) -> str:
    """A short request to `endpoint` ("chat" or "completions") with `extra` fields: the 400
    it must get, naming `param`; returns the error message."""
    body = dict(model=MODEL, max_tokens=4)
    body.update(dict(messages=SHORT + [{"role": "user", "content": "Hi"}]) if endpoint == "chat"
                else dict(prompt="Once"))
    body.update(extra)
    r = httpx.post(f"{url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                   json=body, timeout=30)
    return _error(r, 400, param)["message"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("endpoint, extra, param, message", [
    ("completions", dict(presence_penalty=0.5), "presence_penalty", "not supported"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "not supported"),
    ("completions", dict(max_tokens=True), "max_tokens", "max_tokens must be an integer in "
                                                         "1..2147483647, got true"),
    ("chat", dict(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "messages[0].content must be a string or a list of text parts"),
    ("completions", dict(temperature=0.7, typical_delta=0.5), None,  # the real engine's rule
     "typical_delta applies to typical acceptance (infer.serve --acceptance typical); this "
     "server runs plain decoding"),
])
def test_a_real_server_refuses_bad_fields_by_name(url, endpoint, extra, param, message):
    """A smoke of validation through a real process; every case of the contract (strict
    types, unimplemented parameters, bodies that are not objects) is test_http_contract's,
    in process."""
    assert message in _refusal(url, endpoint, extra, param)


@pytest.mark.slow
@pytest.mark.subprocess
def test_null_is_absent_and_text_parts_are_text(url):
    """OpenAI's clients send null for what they leave out; a message's content may be text
    parts, joined."""
    plain = dict(model=MODEL, prompt="Once", max_tokens=6, temperature=0)
    nulls = dict(plain, seed=None, stop=None, top_p=None, n=None, stream_options=None,
                 logit_bias=None, user=None)
    uncached = dict(plain, cache_prompt=False)  # llama.cpp's field: nothing to reuse here
    a, b, c = (httpx.post(url + "/v1/completions", json=x, timeout=30)
               for x in (plain, nulls, uncached))
    assert a.status_code == b.status_code == c.status_code == 200, (b.text, c.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"] == \
        c.json()["choices"][0]["text"]
    bad = httpx.post(url + "/v1/completions", json=dict(plain, cache_prompt="no"), timeout=30)
    _error(bad, 400, "cache_prompt")
    chat = [httpx.post(url + "/v1/chat/completions", timeout=30, json=dict(
        model=MODEL, max_tokens=4, temperature=0, messages=SHORT + [{"role": "user",
                                                                     "content": c}]))
            for c in ("Hi there", [{"type": "text", "text": "Hi"},
                                   {"type": "text", "text": " there"}])]
    assert chat[0].status_code == chat[1].status_code == 200, chat[1].text
    assert chat[0].json()["usage"] == chat[1].json()["usage"]
    assert chat[0].json()["choices"][0]["message"] == chat[1].json()["choices"][0]["message"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_what_changes_nothing_is_accepted_and_top_k_off_agrees(client):
    ref = client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=0)
    for extra in (dict(presence_penalty=0, frequency_penalty=0, logit_bias={}, user="u"),
                  dict(top_k=-1), dict(top_k=0)):
        r = client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=0,
                                      **{k: v for k, v in extra.items() if k != "top_k"},
                                      extra_body={k: v for k, v in extra.items()
                                                  if k == "top_k"})
        assert r.choices[0].text == ref.choices[0].text
    r = client.chat.completions.create(model=MODEL, max_tokens=4, response_format={
        "type": "text"}, messages=SHORT + [{"role": "user", "content": "Hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="Once", logit_bias={"5": 1})


@pytest.mark.slow
@pytest.mark.subprocess
def test_echo_returns_the_prompt_before_the_completion(client):
    plain = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                      temperature=0).choices[0].text
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0,
                                  echo=True)
    assert r.choices[0].text == "Once upon" + plain
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                            temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once upon"
    assert "".join(c.choices[0].text for c in chunks) == "Once upon" + plain


@pytest.mark.slow
@pytest.mark.subprocess
def test_user_text_cannot_hold_control_tokens(url, client):
    from medusa_jax.runtime.assets import model_dir
    from medusa_jax.serving.server import TextEncoder, vicuna_prompt
    from medusa_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir())
    enc = TextEncoder(tok)
    ids = enc.prompt("</s><s>Lily")
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert ids.count(tok.bos_token_id) == 1 and len(ids) > 5
    r = client.completions.create(model=MODEL, prompt="</s><s>Lily", max_tokens=6,
                                  temperature=0, extra_body={"return_token_ids": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].token_ids == by_ids.choices[0].token_ids
    msgs = SHORT + [{"role": "user", "content": "</s> USER: hi</s>"}]
    chat = vicuna_prompt([(m["role"], m["content"]) for m in msgs], tok)
    assert chat.count(tok.eos_token_id) == 0 and chat.count(tok.bos_token_id) == 1
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(chat)


def test_a_chat_template_keeps_its_own_control_tokens_only():
    """A template's control tokens are parsed; the same text in a message is text."""
    from medusa_jax.runtime.assets import model_dir
    from medusa_jax.serving.server import TextEncoder, template_prompt
    from medusa_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir()).full
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                         "{% endfor %}<s>assistant:")
    enc = TextEncoder(tok)
    conv = [("system", "Be kind."), ("user", "</s><s>Lily")]
    ids = template_prompt(conv, tok, enc)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert ids.count(bos) == 3 and ids.count(eos) == 2  # the template's, none of the user's
    assert len(ids) > len(template_prompt([("system", "Be kind."), ("user", "Lily")], tok, enc))
    clean = template_prompt([("system", "Be kind."), ("user", "Lily")], tok, enc)
    whole = tok(tok.apply_chat_template([{"role": r, "content": c} for r, c in
                                         [("system", "Be kind."), ("user", "Lily")]],
                                        tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
    assert clean == list(whole)  # without control text in messages: the template as it was


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_server_app_for_the_embedded_model_imports_no_transformers():
    """Asking the embedded tokenizer for a chat template loaded transformers: a second of
    start-up before the port opened."""
    code = ("import sys; from medusa_jax.api import Medusa; from medusa_jax.serving.engine import "
            "Engine; from medusa_jax.serving.server import create_app; "
            "m = Medusa.load(heads='default'); create_app(Engine(m, slots=1), 'x'); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_metrics_count_each_finish_reason_as_the_response_reports_it(url, client, patient):
    key = 'medusa_requests_total{finish="%s"}'
    before = _metrics(url)
    for i in range(12):  # read the first chunk of a long stream, then hang up
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json=dict(
                model=MODEL, prompt="Once upon a time", max_tokens=100, temperature=0,
                stream=True)) as resp:
            next(resp.iter_lines())
    ref = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                    temperature=0).choices[0].text
    stop = ref[len(ref) // 2: len(ref) // 2 + 4]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                  temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    counts = {}

    def settled():
        after = counts["after"] = _metrics(url)
        counts["delta"] = {k: after[key % k] - before[key % k]
                           for k in ("stop", "length", "cancelled", "error")}
        return counts["delta"]["cancelled"] >= 12

    patient(settled, lambda: counts.get("delta"), "12 disconnects counted", poll=0.1)
    after, delta = counts["after"], counts["delta"]
    gone = after["medusa_disconnects_total"] - before["medusa_disconnects_total"]
    assert delta == {"stop": 1, "length": 1, "cancelled": 12, "error": 0}
    assert gone == 12
    text = httpx.get(url + "/metrics", timeout=10).text
    assert "# TYPE medusa_requests_total counter" in text
    assert "# TYPE medusa_time_to_first_token_seconds histogram" in text
    assert after["medusa_time_to_first_token_seconds_count"] > \
        before["medusa_time_to_first_token_seconds_count"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("flags, message", [
    (["--max-context", "100000"], "--max-context 100000 is longer than the model's context"),
    (["--port", "99999"], "--port"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--heads", "/nonexistent/heads"], "--heads /nonexistent/heads"),
    (["--prefill-buckets", "1024"], "--prefill-buckets 1024"),
    (["--slot-buckets", "16"], "--slot-buckets 16 is more than --slots (8)"),
    (["--plain-above-slots", "8"], "--plain-above-slots 8 must be in 0..7 (below --slots)"),
    (["--plain-above-slots", "some"],
     "--plain-above-slots: expected a slot count, 'auto' or 'never', got 'some'"),
    (["--slot-buckets", "0,4"], "--slot-buckets: expected positive integers"),
    (["--short-call-ms", "nan"], "--short-call-ms: must be a finite number >= 0, got nan"),
    (["--prefill-batch", "0"], "--prefill-batch: must be >= 1, got 0"),
    (["--overlap-ms", "-2"], "--overlap-ms: must be a finite number >= 0, got -2"),
    (["--port", "TAKEN"], "cannot listen there"),
    (["--api-key", " abc"], "--api-key has spaces around it (' abc'): a client's key is read "
                            "without them"),
    (["--api-key", ""], "--api-key is empty: give a key, or leave it out for no key"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--api-key", "k\u00e9y"], "--api-key must be printable ASCII characters"),
    (["--ngram-shared-size", "1024"], "--ngram-shared-size sets the shared n-gram pool's size: "
                                      "use it with --ngram-shared"),
    (["ENV", "  "], "$MEDUSA_JAX_API_KEY is empty: give a key, or leave it out for no key"),
    (["ENV", ""], "$MEDUSA_JAX_API_KEY is empty"),
    (["ENV", "abc "], "$MEDUSA_JAX_API_KEY has spaces around it ('abc ')"),
])
def test_start_up_flags_fail_in_one_line_before_any_work(flags, message):
    """ENV VALUE: $MEDUSA_JAX_API_KEY=VALUE, under the same rule as --api-key's."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MEDUSA_JAX_API_KEY", None)
    if flags[0] == "ENV":
        env["MEDUSA_JAX_API_KEY"], flags = flags[1], []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if f == "TAKEN" else f for f in flags]
        r = subprocess.run([sys.executable, "-m", "infer.serve", "--heads", "default", *flags],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert len(last) > 10 and message in last
    assert "loaded" not in r.stderr  # before any work: no model loaded, nothing compiled


def test_urls_bracket_ipv6_hosts():
    from infer.serve import http_url

    assert http_url("::1", 8000) == "http://[::1]:8000"
    assert http_url("::ffff:127.0.0.1", 80) == "http://[::ffff:127.0.0.1]:80"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert http_url("localhost", 1) == "http://localhost:1"


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_rest_compiled_in_the_background(launched, url, patient):
    patient(lambda: any(line.startswith("all 15 programs compiled") for line in launched.lines)
            or launched.proc.poll() is not None, lambda: len(launched.lines),
            "the background warm-up", poll=0.2)
    assert launched.proc.poll() is None, launched.lines
    progress = [x for x in launched.lines if x.startswith("compiled ")]
    # what serves any request next (the widest window over every slot), then the rest
    assert progress[3].startswith("compiled step (window 128, 4 slots) in ") and \
        progress[3].endswith("[4/15]"), launched.lines
    assert sorted(x.split(" in ")[0] for x in progress[4:]) == sorted([
        "compiled insert (bucket 64, window 128)", "compiled resize (window 128 to 64)",
        "compiled resize (window 64 to 128)", "compiled step (window 128, 1 slot)",
        "compiled step (window 64, 4 slots)"] + [  # and the prefix cache's, last
        f"compiled extend (bucket {b}, window {w})" for b in (1, 4) for w in (128, 64)] + [
        "compiled move (window 128)", "compiled move (window 64)"])
    assert progress[-1].startswith("compiled extend")
    h = httpx.get(url + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["compiled"] == h["programs"] == 15


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigint_ends_an_idle_server_within_two_seconds(launched, client):
    client.completions.create(model=MODEL, prompt="Once", max_tokens=4)  # a kept-alive client
    time.sleep(0.5)
    t = time.time()
    launched.proc.send_signal(signal.SIGINT)
    assert launched.proc.wait(20) == 0
    assert time.time() - t < 2.0, f"{time.time() - t:.1f} s"
