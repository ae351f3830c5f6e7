"""The notebook API's n-gram drafts: `Medusa.load(heads="ngram")` (no files),
`ngram=True|N` (merged into the drafter's tree, in `load` or per `generate`), `ngram_max` /
`ngram_min`. Bad values are one-line errors before any work; greedy output is plain
greedy's."""

import pytest

from medusa_jax import Medusa, api
from medusa_jax.decoding.tree import chain_tree
from medusa_jax.drafters import registry, resolve, shipped

PROMPTS = ["Lily had a red ball. Lily liked the ball. One day Lily", "Once upon a time"]



@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the weights are read: the arguments must be checked before."""
    def boom(*a, **k):
        raise AssertionError("the weights were read before the arguments were checked")

    monkeypatch.setattr(api, "load_pretrained", boom)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(heads="ngram", ngram_max=0), ValueError, "ngram_max must be an integer in 1..64, got 0"),
    (dict(heads="ngram", ngram_min=-1), ValueError, "ngram_min must be an integer in 1..64"),
    (dict(heads="ngram", ngram_max=65), ValueError, "got 65"),
    (dict(heads="ngram", ngram_max=2, ngram_min=3), ValueError,
     "ngram_min (3) must be at most ngram_max (2)"),
    (dict(heads="ngram", ngram=True), ValueError, "leave out ngram"),
    (dict(ngram=True), ValueError, "give heads too"),
    (dict(heads="hydra", ngram=0), ValueError, "ngram takes 1..64 chain nodes, got 0"),
    (dict(heads="hydra", ngram="3"), TypeError, "ngram must be True, False, None or a number"),
    (dict(heads="hydra", ngram_max=3), ValueError, "use them with heads ngram or ngram"),
])
def test_load_rejects(no_loading, kwargs, error, message, one_line_error):
    with pytest.raises(error) as e:
        Medusa.load(**kwargs)
    assert message in one_line_error.message(e)


def test_load_rejects_sizes_larger_than_the_context(no_loading, model_folder, one_line_error):
    d = model_folder(max_position_embeddings=32)
    with pytest.raises(ValueError) as e:
        Medusa.load(d, heads="ngram", ngram_max=40)
    msg = one_line_error.message(e)
    assert "ngram_max 40 is larger than the model's context (32 tokens)" in msg


def test_check_ngram_names_the_context():
    with pytest.raises(ValueError, match=r"--ngram-min 9 is larger than the model.s context "
                                         r"\(8 tokens\)"):
        shipped.check_ngram("ngram", None, None, 9, context=8)


def test_the_ngram_drafter_needs_no_files_and_decodes_a_chain():
    heads = registry.without_files("ngram", max_n=3)
    assert dict(heads) == {} and heads.drafter.max_n == 3 and heads.drafter.min_n == 1
    assert registry.default_tree_of(heads).name == f"chain{shipped.NGRAM_ALONE_CHAIN}"
    with pytest.raises(ValueError, match="not the n-gram drafter's own"):
        resolve.merge_ngram(heads)


@pytest.mark.slow
def test_ngram_alone_and_merged_emit_plain_greedy():
    plain = [g.token_ids for g in Medusa.load().generate(PROMPTS, max_new_tokens=40)]
    m = Medusa.load(heads="ngram", ngram_max=3)
    assert m.drafter_kind == "ngram" and m.tree().name == "chain6"
    assert [g.token_ids for g in m.generate(PROMPTS, max_new_tokens=40)] == plain
    assert [g.token_ids for g in m.generate(PROMPTS, max_new_tokens=40, tree=chain_tree(3))] \
        == plain
    with pytest.raises(ValueError, match="ngram merges n-gram drafts into another"):
        m.generate(PROMPTS, ngram=True)

    h = Medusa.load(heads="hydra")
    merged = h.generate(PROMPTS, max_new_tokens=40, ngram=2)
    assert [g.token_ids for g in merged] == plain
    assert "hydra+ngram stories260K_cpu+ngram2 greedy" in h.last_timing.line()
    alone = h.generate(PROMPTS, max_new_tokens=40)  # ngram=None: as loaded (not merged)
    assert [g.token_ids for g in alone] == plain
    assert sum(g.steps for g in merged) <= sum(g.steps for g in alone) + 2
    with pytest.raises(ValueError, match="plain decoding"):
        h.generate(PROMPTS, ngram=True, medusa=False)

    d = Medusa.load(heads="default", ngram=True)  # merged in every generate
    assert [g.token_ids for g in d.generate(PROMPTS, max_new_tokens=40)] == plain
    assert "+ngram3" in d.last_timing.line()
    assert [g.token_ids for g in d.generate(PROMPTS, max_new_tokens=40, ngram=False)] == plain
    assert "+ngram" not in d.last_timing.line()
