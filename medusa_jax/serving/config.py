"""The server's and its engine's options: frozen, JAX-free dataclasses, validated once.

`EngineConfig` holds what a user chooses for the engine (`Engine(model, **options)` builds
one); `layout.Layout` derives the sizes the engine runs with from it and the model.
`ServerConfig` holds the HTTP side's. Their fields with `option` metadata are
`infer.serve`'s flags (`runtime.options.add_config_flags`, a flag's name where it is not the
field's, e.g. `--prefill-buckets` for `buckets`); the constants and flag parsers here are the
one copy those read (this module imports no JAX, so `--help` stays fast).
"""

from __future__ import annotations

import argparse
import dataclasses

from medusa_jax.constants import check_dtype
from medusa_jax.decoding.config import DecodeConfig
from medusa_jax.runtime.options import (
    int_in,
    nonnegative_float,
    option,
    positive_int,
    same_option,
)

ACCEPTANCE = ("rejection", "typical")  # how a Medusa engine's sampled rows accept a tree
WARMUPS = ("all", "background", "lazy")  # `Engine.start`: when the programs compile
MAX_STOP = 8  # stop token ids per request (EOS included), padded with -1
# the rest of a prompt after a cached prefix is padded to these or a shorter prefill bucket:
# a repeated prompt feeds one token
EXTEND_BUCKETS = (1, 4)
# On CPU a tree step over many slots is compute-bound (S slots verify S x tree rows) and
# costs more than the tokens it accepts; around this many slots plain and tree steps give
# the same throughput (docs/serving.md, "Against llama-server").
AUTO_PLAIN_ABOVE = 4
API_KEY_ENV = "MEDUSA_JAX_API_KEY"  # the API key when --api-key is not given
DEFAULT_MAX_CONTEXT = 4096  # what infer.serve serves of a model that declares more


def bucket_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers (--prefill-buckets, --slot-buckets)."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 64,256, got {text!r}")
    return out


_slot_count = int_in(0, what="a slot count, 'auto' or 'never'")


def plain_above_slots(text: str) -> int | str | None:
    """argparse type of --plain-above-slots: 'auto', 'never' (None) or a slot count >= 0."""
    if text in ("auto", "never"):
        return None if text == "never" else text
    return _slot_count(text)


def ms_or_off(text: str) -> float | None:
    """argparse type: milliseconds >= 0, 0 meaning off (None)."""
    return nonnegative_float(text) or None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What `serving.engine.Engine` takes (see its docstring for each option).

    slots: requests decoded at once; medusa: use the model's heads (None: when it has
    them); tree: a tree name, file or "dynamic:N"; steps_per_call: K; max_context: a slot's
    cache length (None: the model's context); window_block: the narrowest attention
    window (each next one twice as wide); max_queue: waiting requests at most; buckets:
    prompt lengths prefill is compiled for; acceptance: "rejection" or "typical";
    slot_buckets: slot counts a step is compiled for; plain_above: plain steps above this
    many live slots ("auto", or None: never); prefill_batch: prompts prefilled in one call at most; short_call_ms /
    overlap_ms: call sizing (None: off); prefix_cache: prefill after cached prefixes;
    ngram_shared / ngram_shared_size: a pool of n-grams shared across requests (the
    drafter's `shared_pool`) and its entries."""

    # every field but `medusa` is an `infer.serve` flag (the server's --plain-above-slots
    # default differs from a bare engine's: "auto" against None)
    slots: int = option(8, "requests decoded at once (the static batch; default {default})",
                        type=positive_int)
    medusa: bool | None = None
    tree: object = option(None, "tree name, chainN, JSON file of paths, or dynamic:N[:POOL] "
                          "(POOL e.g. deep7; default: the model's tree)", type=str,
                          metavar="TREE")
    steps_per_call: int = option(4, "decoding steps per engine call (tokens reach clients "
                                 "per call; a larger value compiles a larger step program; "
                                 "default {default})", type=positive_int)
    max_context: int | None = option(None, "KV cache length per slot, at most the model's "
                                     "context (default: the model's context up to "
                                     f"{DEFAULT_MAX_CONTEXT} tokens; the programs to compile "
                                     "grow with it)", type=positive_int, metavar="TOKENS")
    window_block: int = option(128, "the narrowest attention window; each next one is twice "
                               "as wide, up to --max-context (larger: fewer programs, more "
                               "attention work on short contexts; default {default})",
                               type=positive_int, metavar="TOKENS")
    max_queue: int = option(64, "waiting requests past which new ones get 429 "
                            "(default {default})")
    buckets: tuple[int, ...] | None = option(None, "prompt lengths prefill is compiled for, "
                                             "e.g. 64,256 (default: powers of two from 16, "
                                             "and the context; fewer: a faster start, more "
                                             "padding)", flag="--prefill-buckets",
                                             type=bucket_list, metavar="N,...")
    acceptance: str = option("rejection", "how sampled requests (temperature > 0) accept the "
                             "tree: rejection (default: lossless, plain sampling's "
                             "distribution) or typical (the Medusa paper's typical "
                             "acceptance: longer accepted spans, lossy)", choices=ACCEPTANCE)
    slot_buckets: tuple[int, ...] | None = option(None, "slot counts a step is compiled for, "
                                                  "e.g. 1,4,16 (default: powers of two "
                                                  "below --slots, and --slots): a call "
                                                  "computes the smallest that holds the slots "
                                                  "in use; fewer: a faster start, more idle "
                                                  "rows", type=bucket_list, metavar="N,...")
    plain_above: int | str | None = option(None, "with heads: plain steps while more than N "
                                           "slots are live (where a batch of trees costs "
                                           "more than it gains); 'never': always Medusa "
                                           "steps; default 'auto': 4 on CPU with more than "
                                           "4 slots (not for EAGLE-3 drafters), else never",
                                           flag="--plain-above-slots", flag_default="auto",
                                           type=plain_above_slots, metavar="N")
    prefill_batch: int = option(4, "at most N waiting requests prefilled in one call "
                                "(batches of 1, 2, 4 ... N; 1: one at a time, fewer "
                                "programs; default {default})", type=positive_int,
                                metavar="N")
    short_call_ms: float | None = option(None, "while a slot is free or a request waits, a "
                                         "call runs only as many of its --steps-per-call "
                                         "steps as fit MS milliseconds at the measured step "
                                         "time: a new request's prefill waits less, at some "
                                         "cost per token (default 0: always all)",
                                         type=ms_or_off, metavar="MS")
    overlap_ms: float | None = option(20.0, "the next call is dispatched before the current "
                                      "one is read only while calls take less than MS "
                                      "milliseconds; a longer call is read first, so a new "
                                      "request waits behind one call, not two (default "
                                      "{default:g}; 0: always overlap)", flag_default=20.0,
                                      type=ms_or_off, metavar="MS")
    prefix_cache: bool = option(True, "a prompt whose beginning a slot's cache holds, from a "
                                "live request or a finished one, is prefilled only after it "
                                "(default: on; not with EAGLE-3 heads); --no-prefix-cache: "
                                "prefill every prompt whole")
    ngram_shared: bool = option(False, "share a pool of n-grams across requests: the tokens "
                                "that followed each n-gram in finished requests (prompt and "
                                "output), drafted from where a row's own history has no "
                                "match as long; with a drafter that keeps one, e.g. the "
                                "n-gram drafter (default: off)")
    ngram_shared_size: int = option(1 << 16, "the shared n-gram pool's entries at most "
                                    "(a hashed table: a later n-gram evicts an earlier one "
                                    "at the same entry; default {default})",
                                    type=positive_int, metavar="N")

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, "
                             f"got {self.acceptance!r}")
        if (self.slots < 1 or self.steps_per_call < 1 or self.window_block < 1
                or self.max_queue < 0):
            raise ValueError(f"need slots, steps_per_call, window_block >= 1 and max_queue >= 0,"
                             f" got {self.slots}, {self.steps_per_call}, {self.window_block}, "
                             f"{self.max_queue}")
        if not isinstance(self.prefill_batch, int) or self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be an integer >= 1, "
                             f"got {self.prefill_batch!r}")
        if isinstance(self.plain_above, str) and self.plain_above != "auto":
            raise ValueError(f"plain_above must be a slot count, \"auto\" or None, "
                             f"got {self.plain_above!r}")
        if (not isinstance(self.ngram_shared_size, int) or isinstance(self.ngram_shared_size, bool)
                or self.ngram_shared_size < 1):
            raise ValueError(f"ngram_shared_size must be an integer >= 1 (entries), "
                             f"got {self.ngram_shared_size!r}")
        if self.short_call_ms is not None and not self.short_call_ms > 0:
            raise ValueError(f"short_call_ms must be > 0 (or None: always K steps), "
                             f"got {self.short_call_ms!r}")
        if self.overlap_ms is not None and not self.overlap_ms > 0:
            raise ValueError(f"overlap_ms must be > 0 (or None: always overlap), "
                             f"got {self.overlap_ms!r}")


port_number = int_in(0, 65535, "a port number", "a port is 0..65535 (0: any free one)")


def seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    value = nonnegative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def check_api_key(key: str, name: str) -> None:
    """Raise a one-line ValueError naming `name` (the flag or the variable) unless `key` is
    a key a client can send: not empty, no spaces around it (a client's Bearer token is
    read without them, so such a key would lock everyone out), printable ASCII."""
    if not key.strip():
        raise ValueError(f"{name} is empty: give a key, or leave it out for no key")
    if key != key.strip():
        raise ValueError(f"{name} has spaces around it ({key!r}): a client's key is read "
                         f"without them, so nobody could match it")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{name} must be printable ASCII characters (it is sent in an HTTP "
                         f"header), got {key!r}")


def model_name(text: str) -> str:
    """argparse type: a served model name (not blank)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the served model name must not be empty")
    return text


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's options (`infer.serve`'s flags, one per field). max_connections
    None: chosen from the descriptor limit at start-up; api_key None: $MEDUSA_JAX_API_KEY
    if set; served_model_name None: the model folder's name."""

    dtype: str = same_option(DecodeConfig, "dtype")  # the backbone's, as infer.generate's
    warmup: str = option("background", "when the programs compile: background (default: "
                         "the first request's programs first, /health 'starting' until "
                         "then, the rest while serving), lazy (each when a request first "
                         "needs it: the fastest start, a pause on each new length), all "
                         "(everything before the port opens: the slowest start, no pause "
                         "later)", choices=WARMUPS)
    max_request_bytes: int = option(1 << 20, "request bodies past this size get 413 "
                                    "(default: 1 MiB)", type=positive_int)
    request_timeout: float = option(30.0, "a request's headers and body must arrive within "
                                    "this many seconds of its connection opening (or of its "
                                    "previous answer on a kept-alive connection); else 408 "
                                    "and the connection closes (default 30)", type=seconds,
                                    metavar="SECONDS")
    max_connections: int | None = option(
        None, "open connections at most: past it a new connection closes the oldest one not "
        "running a request (idle, or still sending), or gets 503 when all run one (default: "
        "1024, or half the descriptor limit (ulimit -n) when that is less)",
        type=positive_int, metavar="N")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1/ (401 "
                                 "otherwise; /health and /metrics stay open); default: "
                                 f"${API_KEY_ENV} if set, else none", metavar="KEY")
    served_model_name: str | None = option(None, "the model id clients send (default: the "
                                           "model folder's name)", type=model_name,
                                           metavar="NAME")
    host: str = option("127.0.0.1", "the address to listen on (default {default})",
                       metavar="HOST")
    port: int = option(8000, "the port (default {default}; 0: any free one)",
                       type=port_number, metavar="PORT")

    def __post_init__(self):
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {', '.join(WARMUPS)}, "
                             f"got {self.warmup!r}")
        check_dtype(self.dtype)
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")
