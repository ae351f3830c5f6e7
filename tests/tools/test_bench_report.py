"""The step curve's bound and the one-command hardware report (infer.bench), at a tiny shape
on the CPU."""

import json

import jax
import pytest

from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.tools import bench

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
            max_position_embeddings=1024)


@pytest.mark.parametrize("tied", [False, True])
def test_pass_cost_counts_the_bytes_a_pass_reads(tied):
    """Every parameter but the embedding table (only T rows are gathered) is read once; a
    tied model reads the table as its output layer; plus the cached keys and values."""
    cfg = ModelConfig(**TINY, tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    embed = params["embed"].size * 4
    read, flops = bench.pass_cost(cfg, 1, 0)
    assert read == (total if tied else total - embed)
    kv = 2 * 6 * 2 * 100 * 16 * 4  # K and V, 6 layers, 2 KV heads, 100 slots, head_dim 16
    assert bench.pass_cost(cfg, 1, 100)[0] == read + kv
    assert bench.pass_cost(cfg, 5, 0)[1] > 5 * flops * 0.99  # 5 tokens: 5x the products


@pytest.mark.slow
def test_hardware_report_runs_and_extrapolates(tmp_path, monkeypatch):
    from infer.bench import main

    monkeypatch.setitem(bench.SHAPES, "tiny-test", TINY)
    out = tmp_path / "r.json"
    assert main(["--hardware-report", "--shape", "tiny-test", "--dtype", "float32",
                 "--report-layers", "1,2", "--report-contexts", "32,64", "--reps", "2",
                 "--report-tokens", "1,5,17",
                 "--num-prompts", "2", "--max-new-tokens", "16", "--json", str(out),
                 "--plot", str(tmp_path / "r.png")]) == 0
    r = json.loads(out.read_text())
    assert r["platform"] == "cpu" and r["layers"] == 6 and r["extrapolated"]
    assert r["bandwidth_gb_per_s"] > 0.1 and r["peak_tflop_per_s"] > 0.001
    assert set(r["compile_seconds"]) == {"1", "17"} and r["loop_iteration_us"] > 0
    rows = r["rows"]
    assert [(x["context"], x["tokens"]) for x in rows] == \
        [(c, t) for c in (32, 64) for t in (1, 5, 17)]
    for x in rows:
        assert x["ms"] > 0 and x["bound_ms"] > 0
        assert x["vs_bound"] == pytest.approx(x["ms"] / x["bound_ms"])
    pred = r["predicted"]
    assert [p["tree_nodes"] for p in pred] == [4, 8, 16] * 2  # 32, 64 need T > 17
    for p in pred:
        assert 1 <= p["tokens_per_step"] <= 6
        assert p["predicted_speedup"] == pytest.approx(p["tokens_per_step"] / p["step_vs_plain"])
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.slow
def test_step_curve_prints_the_bound(capsys):
    from infer.bench import main

    assert main(["--step-curve", "--tree-sizes", "0,4", "--prefix", "32", "--reps", "2",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [x["tokens_fed"] for x in r["rows"]] == [1, 5]
    assert all(x["vs_bound"] == pytest.approx(x["ms"] / x["bound_ms"]) for x in r["rows"])
    assert r["bandwidth_gb_per_s"] > 0.1


@pytest.mark.slow
def test_compare_layouts_gives_identical_tokens(capsys):
    from infer.bench import main

    assert main(["--compare-layouts", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["identical"] and r["layers"] == 5 and r["new_tokens"] > 0
    assert set(r["rows"]) == {"stacked scan", "decoding layout"}


@pytest.mark.slow
def test_breakdown_leaves_each_stage_out_of_the_whole_step(capsys, monkeypatch):
    """--breakdown: each stage's row is the step without it, its cost what the whole step
    costs more; every stage left out compiles to fewer kernels than the whole step."""
    import functools

    from infer.bench import main
    from medusa_jax.tools.bench import MEDUSA_STAGES

    # what is checked holds at any loop length (the kernel counts, each row's arithmetic):
    # 20 steps a timed loop instead of 200
    monkeypatch.setattr(bench, "step_breakdown", functools.partial(bench.step_breakdown,
                                                                   iters=20))
    assert main(["--breakdown", "--max-new-tokens", "16", "--reps", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    medusa = [r for r in rows if r["config"].startswith("medusa")]
    assert [r["stage"] for r in medusa] == (["whole step"] + [f"- {s}" for s in MEDUSA_STAGES]
                                            + ["backbone pass alone"])
    whole = medusa[0]
    for r in medusa[1:-1]:
        assert r["stage_ms"] == pytest.approx(whole["ms"] - r["ms"])
        assert r["kernels"] < whole["kernels"]
    assert medusa[-1]["kernels"] < min(r["kernels"] for r in medusa[:-1])
    plain = {r["stage"]: r for r in rows if r["config"] == "plain"}
    assert plain["whole step"]["vs_plain_step"] == 1.0
    assert plain["- sampling, bookkeeping"]["kernels"] < plain["whole step"]["kernels"]
