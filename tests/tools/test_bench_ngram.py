"""`infer.bench --also-heads ngram` and `--ngram`: a row for the n-gram drafter (on its
chain), and one per drafter with n-gram drafts merged into its tree, every greedy row
identical to plain."""

import json

import pytest

from infer import bench


@pytest.mark.slow
def test_bench_rows_for_the_ngram_drafter_and_merged_drafts(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--also-heads", "ngram", "--ngram", "2", "--num-prompts", "2",
                       "--max-new-tokens", "16", "--reps", "1", "--no-transformers",
                       "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"plain jax", "medusa", "medusa+ngram", "ngram (ngram)"}
    assert rows["medusa+ngram"]["tree"] == "stories260K_cpu+ngram2"
    assert rows["ngram (ngram)"]["tree"] == "chain6"
    assert all(r["identical_to_plain"] for c, r in rows.items() if c != "plain jax")
    assert all(r["tokens_per_step"] >= 1 for r in rows.values())
