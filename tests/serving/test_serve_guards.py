"""`python -m infer.serve` against clients that hold connections, reach it from a web page, or
leave mid-upload, and on a model that declares a long context: a process on 127.0.0.1.

One server for the module (plain decoding, lazy warm-up: only the programs the requests
need compile), on a copy of the embedded model whose config declares a context of 1,048,576
tokens, with 256 file descriptors (ulimit -n), an API key from the environment and a short
--request-timeout. The last test signals it."""

import json
import os
import resource
import shutil
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

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"  # the copied folder's name: the served model's name
KEY = "sk-test-key"
DESCRIPTORS = 256
TIMEOUT = 3  # --request-timeout
ARGS = ["--slots", "2", "--prefill-batch", "1", "--no-prefix-cache", "--warmup", "lazy",
        "--request-timeout", str(TIMEOUT), "--no-compile-cache"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _few_descriptors():
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (DESCRIPTORS, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


class Launched:
    def __init__(self, folder: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), MEDUSA_JAX_API_KEY=KEY)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infer.serve", "--model", str(folder), *ARGS, "--port",
             str(self.port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, preexec_fn=_few_descriptors)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, what: str, patient):
        """Until `predicate()`, for as long as the server logs lines or /health's compiled
        programs go up (`patient`: a loaded machine only makes it slower)."""
        def compiled():
            try:
                return httpx.get(self.url + "/health", timeout=10).json().get("compiled")
            except (httpx.HTTPError, ValueError):
                return None

        patient(lambda: self.proc.poll() is not None or predicate(),
                lambda: (len(self.lines), compiled()), what, poll=0.1)
        if self.proc.poll() is not None or not predicate():
            pytest.fail(f"{what}; the server said:\n" + "\n".join(self.lines))


@pytest.fixture(scope="module")
def server(tmp_path_factory, patient):
    from medusa_jax.runtime import assets

    folder = tmp_path_factory.mktemp("long") / MODEL
    shutil.copytree(assets.model_dir(), folder)
    conf = json.loads((folder / "config.json").read_text())
    conf["max_position_embeddings"] = 1 << 20
    (folder / "config.json").write_text(json.dumps(conf))
    s = Launched(folder)

    def ok():
        try:
            return httpx.get(s.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    s.wait_for(ok, "/health never answered 200", patient)
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client, **kw):
    return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                     temperature=0, **kw)


def _error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert err["message"] and "\n" not in err["message"]
    return err


def _half_sent(port: int, data=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(data)
    return s


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_long_declared_context_is_bounded_and_serves_at_once(server, client):
    """The model declares 1,048,576 tokens: the server serves 4096 by default, says so in
    one line, plans a bounded number of programs and answers."""
    notes = [x for x in server.lines if "of the model's 1048576" in x]
    assert len(notes) == 1 and "serving a context of 4096 tokens" in notes[0], server.lines
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["programs"] < 2000, health
    r = _complete(client)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


@pytest.mark.slow
@pytest.mark.subprocess
def test_half_sent_requests_lock_nobody_out(server, client):
    """More half-sent requests than the server has descriptors: /health and a completion
    still answer (the oldest half-sent connections are closed to make room)."""
    flood = []
    try:
        for _ in range(DESCRIPTORS + 44):
            flood.append(_half_sent(server.port))
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert _complete(client).usage.completion_tokens == 4
        closed = 0
        for s in flood:
            s.settimeout(0.01)
            try:
                data = s.recv(1000)
                closed += data == b"" or data.startswith(b"HTTP/1.1 503")
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed > 0
    finally:
        for s in flood:
            s.close()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_request_that_never_arrives_whole_gets_408(server):
    """Headers that never end, a body that never ends: both time out at once."""
    waiting = [_half_sent(server.port, data) for data in (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
        b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
        b"{\"model\"")]
    for s in waiting:
        with s:
            answer = s.recv(1000)  # the socket's own timeout (60 s) bounds the wait
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_api_key_is_required_on_v1_only(server, client):
    for key in ("none", KEY + "x"):
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                              timeout=30)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            _complete(wrong)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    r = httpx.post(server.url + "/v1/completions", json=dict(model=MODEL, prompt="Once"),
                   timeout=30)
    _error(r, 401, "invalid_api_key")
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_number_past_the_engine_stops_nobody(server, client):
    """A top_k of 2**31 (once an OverflowError in the engine thread, which stopped the engine
    for every client) and the other numeric fields past int32: a 400 naming the field; the
    next request is answered and /health stays ok."""
    auth = {"authorization": f"Bearer {KEY}"}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    once = dict(model=MODEL, prompt="Once", max_tokens=4)
    for path, body, param in [
            ("/v1/completions", dict(once, top_k=2**31, temperature=0.7), "top_k"),
            ("/v1/chat/completions", dict(chat, top_k=2**31), "top_k"),
            ("/v1/completions", dict(once, top_k=2**63 + 1), "top_k"),
            ("/v1/completions", dict(once, max_tokens=2**32 + 3), "max_tokens"),
            ("/v1/chat/completions", dict(chat, max_completion_tokens=2**31),
             "max_completion_tokens"),
            ("/v1/completions", dict(once, stop_token_ids=[2**40]), "stop_token_ids"),
            ("/v1/completions", dict(once, top_k=1.5), "top_k")]:
        r = httpx.post(server.url + path, json=body, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    r = _complete(client, extra_body={"top_k": 2**31 - 1})  # the largest: keeps every token
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert _complete(client).usage.completion_tokens == 4
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_loopback_server_answers_only_to_its_own_names(server):
    """DNS rebinding: a page on another site that resolves its name to 127.0.0.1 sends
    that name as Host."""
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        r = httpx.get(server.url + "/health", headers={"host": host}, timeout=10)
        _error(r, 403, "invalid_host")
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}",
                 f"[::1]:{server.port}", "LOCALHOST"):
        assert httpx.get(server.url + "/health", headers={"host": host},
                         timeout=10).status_code == 200, host


@pytest.mark.slow
@pytest.mark.subprocess
def test_bodies_must_be_declared_json(server):
    """text/plain, form and multipart bodies (which a web page may send anywhere without a
    CORS preflight) and bodies of no declared type are refused before they are read."""
    body = json.dumps(dict(model=MODEL, prompt="Once", max_tokens=2)).encode()
    auth = {"authorization": f"Bearer {KEY}"}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 None):
        headers = dict(auth, **({"content-type": kind} if kind else {}))
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers,
                       timeout=30)
        assert (kind or "none") in _error(r, 415, "unsupported_media_type")["message"]
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60, headers=dict(
        auth, **{"content-type": "application/json; charset=utf-8"}))
    assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_client_leaving_mid_upload_logs_one_line(server, patient):
    before = len(server.lines)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/"
            b"json\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n"
            b"\r\n{\"model\": ")
    ports = []
    for _ in range(3):
        with _half_sent(server.port, head) as s:
            ports.append(s.getsockname()[1])

    def lines_of(port):
        return [x for x in server.lines[before:] if f"127.0.0.1:{port}:" in x]

    server.wait_for(lambda: all(lines_of(p) for p in ports), "no line for a client that left",
                    patient)
    time.sleep(0.5)  # anything else it would log about them
    assert all(len(lines_of(p)) == 1 and "read whole" in lines_of(p)[0] for p in ports)
    new = server.lines[before:]
    assert not any("Traceback" in x or "ClientDisconnect" in x for x in new), new


def _hub_cache(tmp_path: Path, repo_id: str) -> Path:
    """The embedded model as huggingface_hub caches a download of `repo_id`."""
    from medusa_jax.runtime import assets

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in assets.model_dir().iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    return tmp_path / "hub"


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_cached_hub_id_is_a_model(tmp_path):
    """--model owner/name from huggingface_hub's cache, offline: read before JAX is
    imported, as every other command reads it (here its context, past which --max-context
    is refused)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(_hub_cache(tmp_path, "acme/tiny")))
    r = subprocess.run([sys.executable, "-m", "infer.serve", "--model", "acme/tiny",
                        "--max-context", "100000"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--max-context 100000 is longer than the model's context (512 tokens" in r.stderr
    r = subprocess.run([sys.executable, "-m", "infer.serve", "--model", "acme/other"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "acme/other" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_requests_sent_before_a_signal_get_an_answer_not_a_reset(server, client):
    """SIGTERM while streams run, requests wait and more were just sent: every request gets
    an HTTP answer (an error chunk, a 503), none a reset; the process exits 0. Last: it
    ends the module's server."""
    _complete(client)  # compiled
    outcomes: list[str] = []
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0)
    auth = {"authorization": f"Bearer {KEY}"}

    def one(stream: bool):
        try:
            with httpx.stream("POST", server.url + "/v1/completions", headers=auth,
                              json=dict(body, stream=stream), timeout=60) as r:
                text = r.read().decode()
            outcomes.append(f"{r.status_code} {'error' if 'error' in text else 'ok'}")
        except httpx.HTTPError as e:
            outcomes.append(f"failed: {e!r}")

    threads = [threading.Thread(target=one, args=(i < 2,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    raw = json.dumps(dict(body, max_tokens=8)).encode()
    sent = [_half_sent(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nAuthorization: Bearer "
                       + KEY.encode() + b"\r\nContent-Length: " + str(len(raw)).encode()
                       + b"\r\n\r\n" + raw) for _ in range(6)]
    server.proc.send_signal(signal.SIGTERM)
    for s in sent:
        try:
            answer = s.recv(100)
        except OSError as e:
            answer = repr(e).encode()
        s.close()
        outcomes.append(answer.decode(errors="replace")[:12])
    for t in threads:
        t.join(90)
    assert server.proc.wait(30) == 0
    assert all(o.startswith(("200", "503", "HTTP/1.1 200", "HTTP/1.1 503")) for o in outcomes), \
        outcomes


def test_health_does_not_plan_the_programs_again(medusa_default, monkeypatch):
    """`Engine.status` (each /health) counts the programs planned once, however many: a
    long context plans hundreds of thousands."""
    from medusa_jax.serving.engine import Engine
    from medusa_jax.serving.layout import Layout

    planned = []
    plan = Layout.programs
    monkeypatch.setattr(Layout, "programs", lambda self: planned.append(1) or plan(self))
    e = Engine(medusa_default, slots=2)
    n = len(e.programs.keys)
    for _ in range(5):
        assert e.status()["programs"] == n
    assert len(planned) == 1
