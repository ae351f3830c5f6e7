"""The n-gram flags of the decoding commands: `--heads ngram`, `--ngram [N]`, `--ngram-max`,
`--ngram-min`. Bad ones are refused before any work, with one line; greedy output through
`infer.generate`'s main is identical to plain greedy."""

import json

import pytest

from infer import bench, generate

PROMPT = "Lily had a red ball. Lily liked the ball. One day Lily"


@pytest.mark.parametrize("main", [generate.main, bench.main])
@pytest.mark.parametrize("argv, message", [
    (["--heads", "ngram", "--ngram-max", "0"], "--ngram-max must be an integer in 1..64, got 0"),
    (["--heads", "ngram", "--ngram-min", "-2"], "--ngram-min must be an integer in 1..64, got -2"),
    (["--heads", "ngram", "--ngram-max", "65"], "--ngram-max must be an integer in 1..64, got 65"),
    (["--heads", "ngram", "--ngram-max", "2", "--ngram-min", "3"],
     "--ngram-min (3) must be at most --ngram-max (2)"),
    (["--heads", "ngram", "--ngram"], "leave out --ngram"),
    (["--heads", "hydra", "--ngram", "0"], "--ngram takes 1..64 chain nodes, got 0"),
    (["--heads", "hydra", "--ngram-max", "3"], "use them with --heads ngram or --ngram"),
    (["--heads", "ngram", "--ngram-max", "x"], "expected an integer, got 'x'"),
])
def test_bad_ngram_flags_exit_2_with_one_line(main, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in line for line in err)


def test_ngram_without_a_drafter_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(["--ngram"])
    assert e.value.code == 2
    assert "--ngram merges n-gram drafts into a drafter's tree: give --heads too" in \
        capsys.readouterr().err


def test_heads_ngram_beside_a_folder_of_that_name_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ngram").mkdir()
    with pytest.raises(SystemExit) as e:
        generate.main(["--heads", "ngram"])
    assert e.value.code == 2
    assert "give ./ngram for that one" in capsys.readouterr().err.strip().splitlines()[-1]


def _greedy(argv, capsys) -> tuple[list[int], str]:
    assert generate.main(argv + ["--prompt", PROMPT, "--max-new-tokens", "40", "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[0])["token_ids"], err.strip().splitlines()[-1]


@pytest.mark.slow
def test_ngram_greedy_output_is_plain_greedy(capsys):
    plain, _ = _greedy([], capsys)
    alone, line = _greedy(["--heads", "ngram", "--ngram-max", "3"], capsys)
    assert alone == plain and "ngram chain6 greedy" in line
    merged, line = _greedy(["--heads", "hydra", "--ngram", "2"], capsys)
    assert merged == plain and "hydra+ngram stories260K_cpu+ngram2 greedy" in line
