"""Bad command-line input is refused before any work, with one line (issue: hostile input)."""

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


def test_distill_names_the_file_and_line_of_non_utf8_prompts(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"Once upon a time\nLily \xff\xfe went\n")
    with pytest.raises(SystemExit) as e:
        distill.main(["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")])
    assert e.value.code.startswith(f"error: {prompts}:2: not UTF-8 text (byte 0xff at offset 22")
    assert not (tmp_path / "o.jsonl").exists()


def test_breakdown_without_heads_is_one_line(tmp_path):
    import shutil

    from medusa_jax import assets

    model = shutil.copytree(assets.model_dir(), tmp_path / "model")  # not the embedded one
    with pytest.raises(SystemExit) as e:
        bench.main(["--breakdown", "--model", str(model)])
    assert e.value.code == "error: no heads: pass --heads (train some with python -m train.medusa1)"


def test_a_dynamic_tree_deeper_than_the_heads_is_one_line(tmp_path, stories, capsys):
    from medusa_jax.heads import HeadsConfig, init_heads, save_heads

    cfg, params, _ = stories
    heads = save_heads(tmp_path / "h", init_heads(cfg, params, HeadsConfig(num_heads=2)), cfg)
    assert generate.main(["--heads", str(heads.parent), "--tree", "dynamic:4",
                          "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "depth 4 but there are only 2 Medusa heads" in err[-1]


def test_heads_cost_needs_random_weights_and_times_every_projection():
    from medusa_jax.bench import heads_cost

    with pytest.raises(SystemExit) as e:
        bench.main(["--heads-cost"])
    assert e.value.code == "error: --heads-cost needs --random-weights and --shape"
    times = heads_cost(16, 64, num_heads=3, reps=2)
    assert set(times) == {"per-head", "shared", "reduced", "shared+reduced"}
    assert all(t > 0 for t in times.values())
