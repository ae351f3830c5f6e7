"""Bad command-line input is refused before any work, with one line."""

import pytest

from infer import bench, generate, search_tree
from train import distill


@pytest.mark.parametrize("main, argv, message", [
    (search_tree.main, ["--sizes", "0,-3"], "every value must be >= 1, got 0"),
    (bench.main, ["--batch-size", "0"], "every value must be >= 1, got 0"),
    (bench.main, ["--num-prompts", "0"], "must be >= 1, got 0"),
    (generate.main, ["--batch-size", "0"], "must be >= 1, got 0"),
    (generate.main, ["--tree", "no-such-tree"], "--tree needs --heads"),
    (distill.main, ["--prompts", "p.txt", "--output", "."], "is a directory"),
])
def test_bad_flags_exit_2_with_one_line(main, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in line for line in err)


def test_search_tree_refuses_an_output_it_cannot_write(tmp_path, capsys):
    with pytest.raises(SystemExit):
        search_tree.main(["--out", str(tmp_path)])
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("heads", ["eagle", "hydra"])
def test_search_tree_takes_a_path_conditional_drafter(monkeypatch, tmp_path, heads):
    """The search measures any kind through the drafter protocol: a Hydra or EAGLE-3
    drafter is not refused, the model loads."""
    from medusa_jax import cli

    def loaded(*a, **k):
        raise RuntimeError("loaded")

    monkeypatch.setattr(cli, "load_with_heads", loaded)
    with pytest.raises(RuntimeError, match="loaded"):
        search_tree.main(["--heads", heads, "--out", str(tmp_path / "t.json")])


@pytest.mark.slow
@pytest.mark.parametrize("heads, what, cmd", [("eagle", "an EAGLE-3 drafter", "train.eagle"),
                                              ("hydra", "Hydra heads", "train.hydra")])
def test_medusa2_init_refuses_another_drafter_before_any_work(monkeypatch, tmp_path, capsys,
                                                              heads, what, cmd):
    from medusa_jax.runtime import assets
    from medusa_jax.training import trainer
    from train import medusa2

    def tripwire(*a, **k):
        raise AssertionError("data was prepared before --init's drafter kind was checked")

    monkeypatch.setattr(trainer, "prepare_data", tripwire)
    init, run = assets.shipped_heads_dir(heads), tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        medusa2.command.main(["--init", str(init), "--steps", "2", "--output-dir", str(run)])
    err = f"{e.value.code}\n{capsys.readouterr().err}".strip().splitlines()
    assert f"error: --init {init}: holds {what}; train.medusa2 fine-tunes the backbone with " \
           f"Medusa heads (train {what} with python -m {cmd})" in err
    assert not any("Traceback" in line for line in err) and not run.exists()


def test_distill_names_the_file_and_line_of_non_utf8_prompts(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"Once upon a time\nLily \xff\xfe went\n")
    with pytest.raises(SystemExit) as e:
        distill.main(["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")])
    assert e.value.code.startswith(f"error: {prompts}:2: not UTF-8 text (byte 0xff at offset 22")
    assert not (tmp_path / "o.jsonl").exists()


def test_breakdown_without_heads_is_one_line(tmp_path):
    import shutil

    from medusa_jax.runtime import assets

    model = shutil.copytree(assets.model_dir(), tmp_path / "model")  # not the embedded one
    with pytest.raises(SystemExit) as e:
        bench.main(["--breakdown", "--model", str(model)])
    assert e.value.code == "error: no heads: pass --heads (train some with python -m train.medusa1)"


def test_a_dynamic_tree_deeper_than_the_heads_is_one_line(tmp_path, stories, capsys):
    from medusa_jax.drafters.formats import save_heads
    from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads

    cfg, params, _ = stories
    heads = save_heads(tmp_path / "h", init_heads(cfg, params, HeadsConfig(num_heads=2)), cfg)
    assert generate.main(["--heads", str(heads.parent), "--tree", "dynamic:4",
                          "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "depth 4 but there are only 2 Medusa heads" in err[-1]


@pytest.mark.slow
def test_heads_cost_needs_random_weights_and_times_every_projection():
    from medusa_jax.tools.bench import heads_cost

    with pytest.raises(SystemExit) as e:
        bench.main(["--heads-cost"])
    assert e.value.code == "error: --heads-cost needs --random-weights and --shape"
    times = heads_cost(16, 64, num_heads=3, reps=2)
    assert set(times) == {"per-head", "shared", "reduced", "shared+reduced"}
    assert all(t > 0 for t in times.values())


# ---- checked against the model before any measurement


@pytest.mark.parametrize("main, argv, message", [
    (bench.main, ["--trees", "dynamic:4,,stories260K_cpu"], "empty entry"),
    (generate.main, ["--seed", "99999999999999999999999"], "--seed: must be in -2**63..2**63-1"),
])
def test_more_bad_flags_exit_2_with_one_line(main, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in line for line in err)


def test_generate_top_k_beyond_the_vocabulary_is_one_line(capsys):
    assert generate.main(["--top-k", "100000", "--mode", "rejection", "--max-new-tokens",
                          "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: top_k must be at most the vocabulary size (512), got 100000"]


def test_search_tree_refuses_sizes_that_cannot_fit_the_context(monkeypatch, tmp_path, capsys):
    from medusa_jax.tools import tree_search

    def tripwire(*a, **k):
        raise AssertionError("measuring started before the sizes were checked")

    monkeypatch.setattr(tree_search, "head_rank_accuracy", tripwire)
    out = tmp_path / "t.json"
    with pytest.raises(SystemExit) as e:
        search_tree.main(["--sizes", "4,1000", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--sizes 1000: prompt (" in err and "tree (1001 tokens)" in err
    assert "exceeds the model's context of 512" in err and not out.exists()


def _long_prompt_file(tmp_path, tokenizer, n_tokens):
    words = ("Once upon a time there was a little girl named Lily who liked to play in the "
             "park with her dog ").split()
    text, i = "", 0
    while len(tokenizer.encode(text)) < n_tokens:
        text += words[i % len(words)] + " "
        i += 1
    f = tmp_path / "p.txt"
    f.write_text(text.strip() + "\n")
    return f, len(tokenizer.encode(text.strip()))


def test_distill_checks_the_prompts_length_not_its_padded_bucket(tmp_path, stories, capsys):
    _, _, tok = stories
    prompts, n = _long_prompt_file(tmp_path, tok, 300)  # padded to a bucket of 512
    assert 256 < n + 1 and n + 100 + 1 <= 512
    out = tmp_path / "o.jsonl"
    distill.main(["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "100",
                  "--temperature", "0", "--template", "plain"])
    assert len(out.read_text().splitlines()) == 1
    long_prompts, m = _long_prompt_file(tmp_path, tok, 600)
    with pytest.raises(SystemExit) as e:
        distill.main(["--prompts", str(long_prompts), "--output", str(tmp_path / "x.jsonl"),
                      "--max-new-tokens", "10", "--template", "plain"])
    assert e.value.code.startswith(f"error: prompt ({m} tokens) + max_new_tokens (10)")
