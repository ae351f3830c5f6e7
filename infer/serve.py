"""`python -m infer.serve`: an OpenAI-compatible server with continuous batching and Medusa.

    python -m infer.serve --heads default --slots 8 --port 8000          # embedded model
    python -m infer.serve --model DIR --heads HEADS --slots 8 --port 8000
    python -m infer.serve --slots 8 --port 8001                           # plain decoding

Then POST /v1/completions or /v1/chat/completions (the `openai` client works as it is),
GET /v1/models, /health, /metrics. Ctrl-C / SIGTERM: running requests end with an error
chunk, then the server exits.

Start-up: the flags, paths and the address are checked first (before JAX is imported),
the port opens as soon as the model is loaded, and the engine's programs compile while it
is open (--warmup): one prefill and insert per prompt bucket and prefill batch (waiting
requests are prefilled together, --prefill-batch), one step per attention window and slot
bucket (a call computes only the leading slots in use), a line each with its time.
/health answers 503 {"status": "starting"} until the programs a short first request needs
are in, then 200 {"status": "ok"}; a request that needs a program not compiled yet waits
for it. What trades start-up for coverage: fewer --prefill-buckets, --prefill-batch or
--slot-buckets and a larger --window-block mean fewer programs (more padding, wider
attention per step, more idle rows per call); a smaller --max-context means fewer of both;
--warmup all compiles everything before the port opens (no waiting later). The persistent
compilation cache turns a later start's compiles into loads. A model that declares more
than 4096 tokens of context is served 4096 unless --max-context says otherwise.

Connections: a request's headers and body must arrive within --request-timeout (else 408),
and past --max-connections a new connection closes the oldest one not running a request,
so half-sent requests cannot use up the file descriptors. --api-key (or
$MEDUSA_JAX_API_KEY) requires `Authorization: Bearer KEY` on /v1/; POST bodies must be
application/json; bound to a loopback address, the server answers only to the Host names
localhost, 127.0.0.1 and [::1] (a web page cannot reach it through DNS rebinding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path

from medusa_jax import cli
from medusa_jax.kernels import flags as kernel_flags
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import assets, compile_cache, hub, options
from medusa_jax.serving.config import (
    API_KEY_ENV,
    DEFAULT_MAX_CONTEXT,
    EngineConfig,
    ServerConfig,
    check_api_key,
)

MAX_CONNECTIONS = 1024
DRAIN_S = 0.5  # after SIGINT / SIGTERM: requests already sent are read and answered 503


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(p, heads_help=cli.drafter_help("omit for plain decoding"))
    cli.add_ngram_flags(p)
    # the engine's options as `EngineConfig` declares them (help and checks written once)
    options.add_config_flags(p, EngineConfig)
    options.add_config_flags(p, ServerConfig)
    compile_cache.add_flag(p)
    kernel_flags.add_flag(p)
    return p


def _model_context(model: str | None) -> int | None:
    """max_position_embeddings from the model folder's config.json (stdlib only; a hub id
    is its cached snapshot, resolved by `check_args` already), or None when it cannot be
    read here (the loader then names the problem)."""
    folder = assets.model_dir() if model is None else Path(hub.local(model, "--model"))
    try:
        cfg = json.loads((folder / "config.json").read_text())
        value = cfg.get("max_position_embeddings", cfg.get("text_config", {}).get(
            "max_position_embeddings"))
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _descriptor_limit() -> int | None:
    """The process's soft limit on open file descriptors, or None where there is none."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def http_url(host: str, port: int) -> str:
    """The server's URL: an IPv6 address in brackets (http://[::1]:8000), as URLs write it."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def engine_config(args) -> EngineConfig:
    """The engine's options from the flags (ValueError names a bad value)."""
    return options.config_from_flags(EngineConfig, args)


def check_args(ap: argparse.ArgumentParser, args) -> socket.socket:
    """Everything that can be checked before JAX is imported; returns the bound socket
    (so a taken port or a foreign address fails now, not after the model is loaded)."""
    if args.tree and not args.heads:
        ap.error("--tree needs --heads (without heads, decoding is plain and uses no tree)")
    if args.max_queue is not None and args.max_queue < 0:
        ap.error(f"--max-queue must be >= 0, got {args.max_queue}")
    try:  # validated once, here (`Engine` and the server take them as they are)
        args.engine = engine_config(args)
        args.server = options.config_from_flags(ServerConfig, args)
    except ValueError as e:
        ap.error(str(e))
    cli.check_ngram_flags(ap, args)
    if args.ngram_shared_size is not None and not args.engine.ngram_shared:
        ap.error("--ngram-shared-size sets the shared n-gram pool's size: use it with "
                 "--ngram-shared")
    if args.engine.ngram_shared and not args.heads:
        ap.error("--ngram-shared needs a drafter that keeps a pool (--heads ngram); plain "
                 "decoding drafts nothing")
    eng = args.engine
    slots = eng.slots
    try:  # folders or hub ids (found in huggingface_hub's cache), as every command takes them
        check_model_paths(args.model, cli.heads_to_check(args.heads), tokenizer=False)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if args.heads in assets.SHIPPED_HEADS and args.model is not None:
        ap.error(f"--heads {args.heads} is only defined for the embedded model (no --model)")
    context = _model_context(args.model)
    if context is not None and eng.max_context is not None and eng.max_context > context:
        ap.error(f"--max-context {eng.max_context} is longer than the model's context "
                 f"({context} tokens, max_position_embeddings in its config.json)")
    limit = eng.max_context or (min(context, DEFAULT_MAX_CONTEXT) if context else None)
    if limit is not None and eng.buckets and max(eng.buckets) > limit:
        ap.error(f"--prefill-buckets {max(eng.buckets)} is longer than the context "
                 f"({limit} tokens)")
    if isinstance(eng.plain_above, int) and not 0 <= eng.plain_above < slots:
        ap.error(f"--plain-above-slots {eng.plain_above} must be in 0..{slots - 1} "
                 f"(below --slots)")
    if isinstance(eng.plain_above, int) and args.heads is None:
        ap.error("--plain-above-slots needs --heads (a plain server's steps are plain already)")
    if eng.slot_buckets and max(eng.slot_buckets) > slots:
        ap.error(f"--slot-buckets {max(eng.slot_buckets)} is more than --slots ({slots})")
    soft, srv = _descriptor_limit(), args.server
    if srv.max_connections is None:
        srv = dataclasses.replace(srv, max_connections=min(MAX_CONNECTIONS, max(1, soft // 2))
                                  if soft else MAX_CONNECTIONS)
    elif soft and srv.max_connections > soft - 64:
        ap.error(f"--max-connections {srv.max_connections} leaves too few of the process's "
                 f"{soft} file descriptors (ulimit -n) for the model and the server: at most "
                 f"{max(1, soft - 64)}")
    if srv.api_key is None and API_KEY_ENV in os.environ:  # the same rule as --api-key's
        try:
            check_api_key(os.environ[API_KEY_ENV], f"${API_KEY_ENV}")
        except ValueError as e:
            ap.error(str(e))
        srv = dataclasses.replace(srv, api_key=os.environ[API_KEY_ENV])
    args.server = srv
    try:
        infos = socket.getaddrinfo(srv.host, srv.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        ap.error(f"--host {srv.host}: not an address or host name ({e})")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        ap.error(f"--host {srv.host} --port {srv.port}: cannot listen there "
                 f"({e.strerror or e})")
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    t_launch = time.perf_counter()
    ap = build_parser()
    args = ap.parse_args(argv)
    sock = check_args(ap, args)
    try:
        return _serve(args, sock, t_launch)
    except KeyboardInterrupt:  # Ctrl-C before the server was up
        print("interrupted", file=sys.stderr)
        return 130


def _serve(args, sock: socket.socket, t_launch: float) -> int:
    def log(msg: str):  # one write per line: the compile thread logs too
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    srv = args.server
    kernel_flags.apply_flag(args)
    compile_cache.enable_from_args(args)
    import uvicorn

    from medusa_jax.api import Medusa
    from medusa_jax.serving.engine import Engine
    from medusa_jax.serving.guards import guarded_protocol, loopback_hosts
    from medusa_jax.serving.server import create_app

    try:
        model = Medusa.load(args.model, args.heads, param_dtype=args.server.dtype,
                            compute_dtype=args.server.dtype, heads_dtype=args.heads_dtype,
                            ngram=args.ngram, ngram_max=args.ngram_max,
                            ngram_min=args.ngram_min)
        own = model.cfg.max_position_embeddings
        max_context = args.engine.max_context or min(own, DEFAULT_MAX_CONTEXT)
        if max_context < own:
            log(f"serving a context of {max_context} tokens of the model's {own} "
                f"(--max-context; each longer window adds programs to compile)")
        engine = Engine(model, args.engine, max_context=max_context, log=log)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = srv.served_model_name or (model.model_dir.name if model.model_dir else "model")
    decoding = f"{engine.drafter.name} {engine.tree.name}" if engine.medusa else "plain"
    if engine.plain_above is not None:
        decoding += f", plain steps above {engine.plain_above} live slots"
    if engine.prefix_cache:
        decoding += ", prefix cache"
    port = sock.getsockname()[1]
    n = len(engine.programs.keys)
    log(f"loaded {name} ({decoding}, {engine.slots} slots, context {engine.capacity}) in "
        f"{time.perf_counter() - t_launch:.1f} s; {n} programs to compile (--warmup "
        f"{srv.warmup}; --prefill-buckets, --prefill-batch, --slot-buckets, --window-block and "
        f"--max-context set how many)")

    def ready_note():
        engine.wait_ready()
        if engine.stop_reason is None:
            log(f"ready for requests {time.perf_counter() - t_launch:.1f} s after launch")
        engine.wait_compiled()
        if engine.stop_reason is None:
            log(f"all {n} programs compiled ({engine.compile_seconds:.1f} s compiling)")

    if srv.warmup == "all":
        engine.start("all")
        log(f"serving {name} on {http_url(srv.host, port)}; compiled in "
            f"{engine.compile_seconds:.1f} s")

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if srv.warmup != "all":  # compiling starts once the port is open
                import threading

                engine.start(srv.warmup)
                threading.Thread(target=ready_note, daemon=True).start()
                log(f"serving {name} on {http_url(srv.host, port)} (/health says 'starting' "
                    f"until the first programs are compiled)")

        drain_until = None

        def handle_exit(self, sig, frame):
            """Running requests hear first (an error chunk, a 503); the server goes on
            reading for DRAIN_S so that requests already sent get that 503 too, not a reset
            of a connection closed unread. A second signal stops it at once."""
            if self.drain_until is None:
                engine.stop(f"the server is shutting down (signal {sig})", timeout=0.5)
                self.drain_until = time.monotonic() + DRAIN_S
            else:
                super().handle_exit(sig, frame)
                self._captured_signals.clear()  # a clean shutdown exits 0, not by the signal

        async def on_tick(self, counter):
            if self.drain_until is not None and time.monotonic() >= self.drain_until:
                self.should_exit = True
            return await super().on_tick(counter)

    hosts = loopback_hosts(sock.getsockname()[0])
    app = create_app(engine, name, srv.max_request_bytes, api_key=srv.api_key,
                     allowed_hosts=hosts)
    config = uvicorn.Config(app, host=srv.host, port=port, log_level="warning",
                            timeout_graceful_shutdown=1, ws="none",  # no WebSocket routes
                            http=guarded_protocol(srv.request_timeout, srv.max_connections))
    log(f"connections: at most {srv.max_connections} open, a request's headers and body "
        f"within {srv.request_timeout:g} s; "
        + ("an API key required on /v1/" if srv.api_key else "no API key (--api-key)")
        + (f"; Host must be one of {', '.join(sorted(hosts))}" if hosts else ""))
    Server(config).run(sockets=[sock])
    engine.stop(timeout=1.0)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit now: interpreter shutdown would spend about a second tearing JAX down, and a
    # background compile still running cannot be interrupted (nor should shutdown meet it
    # mid-call). Nothing is left to write: the compilation cache writes each entry as it
    # compiles.
    os._exit(rc)
