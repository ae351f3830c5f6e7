"""What the serving engine checks of a request before it queues one (`Engine.submit`,
`Engine.check`): each in one line naming the field, so that nothing a caller sends can fail
later in the engine thread (where the engine's int32 / float32 rows would wrap, truncate or
misread a value, or a conversion would raise for every client).

The HTTP layer (`requests`) bounds its fields the same way and answers 400 first; these
are the engine's own, for every caller of `Engine.submit`."""

from __future__ import annotations

from medusa_jax.decoding import sampling
from medusa_jax.decoding.sampling import Sampling, check_integer
from medusa_jax.serving.config import MAX_STOP

SEED_RANGE = (-2**63, 2**64)  # a request's PRNG stream takes 64 bits of its seed


def _token_ids(name: str, ids, vocab: int):
    for j, t in enumerate(ids):
        if not (sampling.is_integer(t) and 0 <= t < vocab):
            raise ValueError(f"{name}[{j}] = {repr(t)[:40]} is not a token id of this model "
                             f"(0..{vocab - 1})")


def check_request(engine, req) -> None:
    """Raise a one-line ValueError naming the first field of `req` (a `scheduler.Request`)
    that `engine` (an `engine.Engine`: its eos, cfg.vocab_size, medusa and acceptance)
    cannot run as it is."""
    eos, vocab = engine.eos, engine.cfg.vocab_size
    medusa, acceptance = engine.medusa, engine.acceptance
    if not isinstance(req.prompt, list):
        raise ValueError(f"prompt must be a list of token ids, got {type(req.prompt).__name__}")
    _token_ids("prompt", req.prompt, vocab)
    check_integer("max_tokens", req.max_tokens, 1)
    if not sampling.is_number(req.temperature):
        raise ValueError(f"temperature must be a number, got {req.temperature!r}")
    if not 0 <= req.temperature <= sampling.FLOAT32_MAX:  # NaN would pass as greedy
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), "
                         f"got {req.temperature}")
    if req.seed is not None and not (sampling.is_integer(req.seed)
                                     and SEED_RANGE[0] <= req.seed < SEED_RANGE[1]):
        raise ValueError(f"seed must be a 64-bit integer or None, got {req.seed!r}")
    _token_ids("stop_ids", req.stop_ids, vocab)
    if len(set(eos) | set(req.stop_ids)) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP - len(eos)} stop token ids")
    for name, value in (("typical_epsilon", req.epsilon), ("typical_delta", req.delta)):
        if value is not None and not (medusa and acceptance == "typical"):
            how = "plain decoding" if not medusa else f"{acceptance} acceptance"
            raise ValueError(f"{name} applies to typical acceptance (infer.serve "
                             f"--acceptance typical); this server runs {how}")
    sampled = req.temperature > 0
    d = Sampling()
    sampling.check(acceptance if sampled else "greedy", req.temperature if sampled else 1.0,
                   req.top_k, req.top_p, d.epsilon if req.epsilon is None else req.epsilon,
                   d.delta if req.delta is None else req.delta)


def check_fits(prompt_len: int, max_tokens: int, *, longest_prompt: int, capacity: int,
               tree: int) -> None:
    """Raise a one-line ValueError when a prompt of `prompt_len` tokens and `max_tokens`
    new ones cannot fit a slot of `capacity` tokens that verifies `tree` tokens a step."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prompt_len < 1:
        raise ValueError("the prompt is empty")
    if prompt_len > longest_prompt:
        raise ValueError(f"the prompt ({prompt_len} tokens) is longer than the longest "
                         f"prompt this server prefills ({longest_prompt} tokens)")
    need = prompt_len + max_tokens + tree
    if need > capacity:
        extra = f" + tree ({tree} tokens)" if tree else ""
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}){extra} "
                         f"= {need} exceeds the context of {capacity} tokens; "
                         f"shorten the prompt or lower max_tokens")
