"""Decoding on the real stories260K: Medusa greedy == plain greedy, oracle heads, stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from medusa_jax.api import Medusa
from medusa_jax.decoding.decode import (
    CACHE_BLOCK,
    MAX_CACHE_PHASES,
    cache_phases,
    generate,
    medusa_generate,
    pad_prompts,
    run_phases,
)
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.model.backbone import KVCache
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.weights import default_model_dir

PROMPTS = [
    "Once upon a time", "Lily", "Tom had a red ball.", "The sun was hot and",
    "One day, a little bird named Tweet flew to", "Sam and his mom went to the store to buy",
    "There was a big tree in the garden.", "The cat", "Max the dog liked to run. One day he saw",
    "Mia found a shiny rock near the river and she wanted to show it to her friend",
    "It was a rainy day.", "Ben wanted to fly a kite, but the wind was", "A small boy",
    "The princess lived in a tall castle with her father, the king. Every morning she",
    "Once there was a", "Timmy was sad because", "The little fish swam", "Anna and Ben",
    "Spot was a happy puppy who loved to dig holes in the yard. One day",
    "The old man had a big garden full of flowers and vegetables.", "Sue", "Bob the bear",
    "In a small town, there lived a kind girl named Amy. She",
    "The car went fast down the hill and",
]
MAX_NEW = 40
TREE = Tree.load("mc_sim_7b_63")


def _ids(tok):
    return [tok.encode(p) for p in PROMPTS]


def _rows(out):
    return [np.asarray(out.tokens[i, : int(out.num_new[i])]).tolist() for i in range(len(out.num_new))]


def _run(fn, prompts, batch, **kw):
    rows = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        tokens, lengths = pad_prompts(chunk)
        rows += _rows(fn(tokens=tokens, lengths=lengths, key=jax.random.key(0), **kw))[: len(chunk)]
    return rows


@pytest.fixture(scope="module")
def plain_rows(stories):
    cfg, params, tok = stories
    return _run(lambda **kw: generate(params, cfg, **kw), _ids(tok), 4,
                max_new_tokens=MAX_NEW, eos=(2,))


def _perturbed_heads(cfg, params, scale):
    heads = init_heads(cfg, params, HeadsConfig(num_heads=4))
    keys = jax.random.split(jax.random.key(7), 3)
    return {k: v + scale * jax.random.normal(kk, v.shape) for (k, v), kk in zip(heads.items(), keys)}


@pytest.mark.slow
def test_plain_greedy_matches_transformers_golden_story(stories):
    cfg, params, tok = stories
    tokens, lengths = pad_prompts([[1]])
    out = generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=256, eos=(2,))
    ours = _rows(out)[0]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([[1]]), max_new_tokens=256, do_sample=False,
                             eos_token_id=2, pad_token_id=0)[0, 1:].tolist()
    assert ours == ref
    text = tok.decode(ours, skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily. She loved to "
                           "play outside in the park.")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("head_noise", [0.0, 0.05])
def test_medusa_greedy_equals_plain_greedy(stories, plain_rows, batch, head_noise):
    cfg, params, tok = stories
    heads = _perturbed_heads(cfg, params, head_noise)
    rows = _run(lambda **kw: medusa_generate(params, heads, cfg, **kw), _ids(tok), batch,
                tree=TREE, max_new_tokens=MAX_NEW, eos=(2,))
    assert len(rows) == len(PROMPTS) >= 20
    for i, (a, b) in enumerate(zip(rows, plain_rows)):
        assert a == b, f"prompt {i} {PROMPTS[i]!r} differs"


def _greedy_future(stories, prompts, n):
    """Each prompt followed by its plain greedy continuation, as a [B, len+n] table."""
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(prompts)
    out = generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=n)
    width = max(len(p) for p in prompts) + n + 16
    table = np.zeros((len(prompts), width), np.int32)
    for i, (p, new) in enumerate(zip(prompts, _rows(out))):
        table[i, : len(p) + len(new)] = p + new
    return jnp.asarray(table)


def _table_heads(sign):
    """Head k proposes table[b, lengths[b] + k] (sign=+1: the truth) or ranks the true token
    last (sign=-1: always wrong)."""

    def head_fn(heads, hidden, lengths):
        table, vocab, k = heads["table"], heads["vocab"].shape[0], heads["k"].shape[0]
        idx = lengths[None, :] + jnp.arange(1, k + 1)[:, None]  # [K, B]
        truth = jnp.take_along_axis(table[None], idx[..., None], axis=2)[..., 0]
        return sign * 10.0 * jax.nn.one_hot(truth, vocab)

    return head_fn


@pytest.mark.slow
def test_oracle_heads_accept_the_full_depth(stories):
    cfg, params, tok = stories
    prompts = _ids(tok)[:4]
    n = 43
    heads = {"table": _greedy_future(stories, prompts, n + 8), "vocab": jnp.zeros(cfg.vocab_size),
             "k": jnp.zeros(4)}
    tokens, lengths = pad_prompts(prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                          max_new_tokens=n, head_fn=_table_heads(+1))
    d = TREE.depth + 1
    assert np.all(np.asarray(out.num_new) == n)
    assert np.all(np.asarray(out.steps) == -(-n // d))  # every step but the last emits depth + 1
    hist = np.asarray(out.accept_hist)
    assert np.all(hist[:, d] == n // d) and np.all(hist[:, n % d] == 1)
    assert np.all((hist * np.arange(d + 1)).sum(1) == n)  # the histogram counts kept tokens
    future = np.asarray(heads["table"])
    for i, p in enumerate(prompts):
        assert _rows(out)[i] == future[i, len(p): len(p) + n].tolist()


@pytest.mark.slow
def test_wrong_heads_give_one_token_per_step(stories):
    cfg, params, tok = stories
    prompts = _ids(tok)[:4]
    heads = {"table": _greedy_future(stories, prompts, 40), "vocab": jnp.zeros(cfg.vocab_size),
             "k": jnp.zeros(4)}
    tokens, lengths = pad_prompts(prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                          max_new_tokens=30, head_fn=_table_heads(-1))
    assert np.all(np.asarray(out.steps) == 30) and np.all(np.asarray(out.num_new) == 30)


@pytest.mark.slow
def test_eos_inside_an_accepted_chunk_truncates_the_row(stories):
    cfg, params, tok = stories
    prompts = _ids(tok)[:2]
    table = _greedy_future(stories, prompts, 60)
    heads = {"table": table, "vocab": jnp.zeros(cfg.vocab_size), "k": jnp.zeros(4)}
    # pretend the 8th new token of row 0 is an end-of-sequence token
    stop = int(table[0, len(prompts[0]) + 7])
    row0 = np.asarray(table[0, len(prompts[0]):]).tolist()
    expect = row0[: row0.index(stop) + 1]
    tokens, lengths = pad_prompts(prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                          max_new_tokens=50, eos=(stop,), head_fn=_table_heads(+1))
    plain = generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=50, eos=(stop,))
    assert _rows(out)[0] == expect == _rows(plain)[0]
    assert _rows(out)[1] == _rows(plain)[1]


@pytest.mark.slow
def test_rows_do_not_depend_on_each_other(stories):
    cfg, params, tok = stories
    heads = _perturbed_heads(cfg, params, 0.05)
    ids = _ids(tok)
    together = _run(lambda **kw: medusa_generate(params, heads, cfg, **kw), ids[:4], 4,
                    tree=TREE, max_new_tokens=25, eos=(2,))
    swapped = _run(lambda **kw: medusa_generate(params, heads, cfg, **kw),
                   [ids[0], ids[9], ids[13], ids[5]], 4, tree=TREE, max_new_tokens=25, eos=(2,))
    assert together[0] == swapped[0]


@pytest.mark.slow
def test_new_prompt_lengths_in_a_bucket_do_not_recompile(stories):
    cfg, params, tok = stories
    heads = _perturbed_heads(cfg, params, 0.0)
    kw = dict(tree=TREE, max_new_tokens=12, eos=(2,))
    before = medusa_generate._cache_size()
    for prompt in (["Lily"], ["The sun was hot and it"], ["One day, a little bird flew"]):
        tokens, lengths = pad_prompts([tok.encode(p) for p in prompt])
        medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), **kw)
    assert medusa_generate._cache_size() == before + 1


@pytest.mark.slow
def test_api_limits_and_errors(stories):
    cfg, params, tok = stories
    m = Medusa(cfg, params, tok, heads=init_heads(cfg, params, HeadsConfig(num_heads=4)))
    out = m.generate(["Lily", "Once upon a time"], max_new_tokens=9, batch_size=4)
    assert [g.new_tokens for g in out] == [9, 9] and all(len(g.token_ids) == 9 for g in out)
    assert all(g.tokens_per_step >= 1 for g in out)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 512"):
        m.generate(["Lily"], max_new_tokens=450)  # 2 + 450 + 64 tree tokens > 512
    with pytest.raises(ValueError, match="depth 4 but there are only 2 Medusa heads"):
        Medusa(cfg, params, tok, heads=init_heads(cfg, params, HeadsConfig(num_heads=2))).generate(
            ["Lily"], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        m.generate(["Lily"], max_new_tokens=0)
    with pytest.raises(ValueError, match="mode 'beam' is not one of"):
        m.generate(["Lily"], mode="beam")


@pytest.mark.parametrize("start,final,per_step", [(16, 17, 1), (16, 145, 1), (16, 273, 1),
                                                  (32, 166, 5), (32, 438, 5), (16, 337, 64),
                                                  (64, 1089, 1)])
def test_cache_phases_cover_the_decode(start, final, per_step):
    caps = cache_phases(start, final, per_step)
    assert caps[-1] == final and list(caps) == sorted(set(caps)) and caps[0] > start
    assert len(caps) <= MAX_CACHE_PHASES
    if final - start > 2 * CACHE_BLOCK:
        assert len(caps) >= 2  # long decodes do attend over a smaller cache first
    for a, b in zip((start,) + caps, caps):
        assert b - a >= min(CACHE_BLOCK, final - start) // 2 and b - a >= min(per_step, b - start)


def test_bad_cache_phases_are_one_line_errors(stories):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts([[1, 2, 3]])
    with pytest.raises(ValueError, match="max_cache_phases must be an int >= 1, got 0"):
        generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=4,
                 max_cache_phases=0)


def test_run_phases_widens_the_window_only_when_a_step_would_not_fit():
    from flax import struct

    @struct.dataclass
    class State:
        cache: KVCache
        done: jax.Array
        log: jax.Array  # [20, 2]: (length before the step, window) of each step

    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64)
    traced = []

    def step(s, window):  # feeds 3 tokens a step; logs the window it ran under
        traced.append((window, s.cache.capacity))
        i = jnp.sum(s.log[:, 1] > 0)
        log = s.log.at[i].set(jnp.array([s.cache.lengths[0], window]))
        cache = s.cache.advance(jnp.array([3]))
        return s.replace(cache=cache, done=cache.lengths >= 40, log=log)

    cache = KVCache.init(cfg, 1, 45).replace(lengths=jnp.array([4]))
    state = State(cache=cache, done=jnp.zeros((1,), bool), log=jnp.zeros((20, 2), jnp.int32))
    out = jax.jit(lambda s: run_phases(step, s, (16, 28, 45), 3))(state)
    # one compiled step per phase, its loop carrying only the window's slots of the cache
    # (a narrower read of the loop's own buffer would make XLA copy it at every step)
    assert traced == [(16, 16), (28, 28), (45, 45)] and out.cache.capacity == 45
    log = np.asarray(out.log)[: int(np.sum(np.asarray(out.log)[:, 1] > 0))]
    assert log[:, 0].tolist() == list(range(4, 40, 3))
    # each step ran in the narrowest window its 3 new tokens fit in
    assert log[:, 1].tolist() == [16 if n + 3 <= 16 else 28 if n + 3 <= 28 else 45
                                  for n in log[:, 0]]


@pytest.mark.slow
def test_medusa_greedy_equals_plain_greedy_across_cache_phases(stories, medusa_default):
    """A long decode runs in several cache phases (the cache grows between them); the
    tokens must not notice."""
    cfg, params, tok = stories
    m = medusa_default  # Medusa.load(heads="default")
    n = 300
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    tokens, lengths = pad_prompts(prompts)
    tree = m.tree()
    assert len(cache_phases(tokens.shape[1], tokens.shape[1] + n + tree.num_nodes + 1,
                            tree.num_nodes)) >= 2
    plain = generate(m.params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=n)
    med = medusa_generate(m.params, m.heads, cfg, tokens, lengths, jax.random.key(0),
                          tree=tree, max_new_tokens=n)
    assert np.all(np.asarray(med.num_new) == n)
    assert _rows(med) == _rows(plain)
