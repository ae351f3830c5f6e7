"""`python -m infer.serve`: an OpenAI-compatible server with continuous batching and Medusa.

    python -m infer.serve --heads default --slots 8 --port 8000          # embedded model
    python -m infer.serve --model DIR --heads HEADS --slots 8 --port 8000
    python -m infer.serve --slots 8 --port 8001                           # plain decoding

Then POST /v1/completions or /v1/chat/completions (the `openai` client works as it is),
GET /v1/models, /health, /metrics. Everything the engine uses is compiled before the port
opens. Ctrl-C / SIGTERM: running requests end with an error chunk, then the server exits.
"""

from __future__ import annotations

import argparse
import sys

from medusa_jax import cli, compile_cache


def _buckets(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 64,256, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(p, heads_help="Medusa heads artifact, or 'default' for the embedded "
                                      "model's shipped heads (omit for plain decoding)")
    p.add_argument("--tree", help="tree name or JSON file of paths (default: the model's tree)")
    p.add_argument("--slots", type=cli.positive_int, default=8,
                   help="requests decoded at once (the static batch)")
    p.add_argument("--steps-per-call", type=cli.positive_int, default=4,
                   help="decoding steps per engine call (tokens reach clients per call)")
    p.add_argument("--max-context", type=cli.positive_int, default=None,
                   help="KV cache length per slot (default: the model's context)")
    p.add_argument("--prefill-buckets", type=_buckets, default=None,
                   help="prompt lengths prefill is compiled for, e.g. 64,256 (default: powers "
                        "of two from 16, and the context)")
    p.add_argument("--window-block", type=cli.positive_int, default=128,
                   help="attention windows are compiled in multiples of this")
    p.add_argument("--max-queue", type=int, default=64,
                   help="waiting requests past which new ones get 429")
    p.add_argument("--served-model-name", help="the model id clients send (default: the "
                                               "model folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    compile_cache.add_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tree and not args.heads:
        ap.error("--tree needs --heads (without heads, decoding is plain and uses no tree)")
    if args.max_queue < 0:
        ap.error(f"--max-queue must be >= 0, got {args.max_queue}")
    compile_cache.enable_from_args(args)
    import uvicorn

    from medusa_jax.api import Medusa
    from medusa_jax.engine import Engine
    from medusa_jax.server import create_app

    try:
        model = Medusa.load(args.model, args.heads, param_dtype=args.dtype,
                            compute_dtype=args.dtype)
        engine = Engine(model, slots=args.slots, tree=args.tree,
                        steps_per_call=args.steps_per_call, max_context=args.max_context,
                        window_block=args.window_block, max_queue=args.max_queue,
                        buckets=args.prefill_buckets)
        engine.start()
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (model.model_dir.name if model.model_dir else "model")
    decoding = f"medusa {engine.tree.name}" if engine.medusa else "plain"
    print(f"serving {name} ({decoding}, {args.slots} slots, context {engine.capacity}) on "
          f"http://{args.host}:{args.port}; compiled in {engine.compile_seconds:.1f} s",
          file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # running requests hear first, then uvicorn stops
            engine.stop(f"the server is shutting down (signal {sig})", timeout=2.0)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean shutdown exits 0, not by the signal

    config = uvicorn.Config(create_app(engine, name), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=5)
    Server(config).run()
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
