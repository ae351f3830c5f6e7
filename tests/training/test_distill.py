"""Self-distillation at several temperatures: how the samples split, the draws deterministic
from the seed, one temperature unchanged, and the run directory recording how its data was
drawn."""

import json

import pytest

from medusa_jax.training import distill
from medusa_jax.training.config import Medusa1Config


def test_samples_split_evenly_and_greedy_answers_each_prompt_once():
    assert distill.split_samples(10, [0.8, 1.0], 137) == [5, 5]
    assert distill.split_samples(10, [0.3, 0.8, 1.0], 137) == [4, 3, 3]
    assert distill.split_samples(640, [0.0, 0.8], 137) == [137, 320]
    assert distill.split_samples(7, [0.0], 3) == [3]


@pytest.fixture(scope="module")
def embedded():
    from medusa_jax.model import weights

    cfg, params = weights.load_pretrained(None)
    return params, cfg, weights.load_tokenizer(None)


PROMPTS = ["Lily went", "Tom saw", "The sun"]


def _mixed(embedded, temps, n, seed=0):
    params, cfg, tok = embedded
    return distill.generate_mixed(params, cfg, tok, PROMPTS, temperatures=temps,
                                  num_samples=n, template="plain", max_new_tokens=6,
                                  batch_size=2, seed=seed, progress=False)


@pytest.mark.slow
def test_draws_are_the_seeds_and_one_temperature_is_generate_answers(embedded):
    params, cfg, tok = embedded
    recs, stats = _mixed(embedded, [0.0, 1.0], 6)
    again, _ = _mixed(embedded, [0.0, 1.0], 6)
    other, _ = _mixed(embedded, [0.0, 1.0], 6, seed=1)
    answers = lambda rs: [r["conversations"][1]["value"] for r in rs]  # noqa: E731
    assert answers(recs) == answers(again)
    assert answers(recs)[:3] == answers(other)[:3]  # greedy: the seed does not matter
    assert answers(recs)[3:] != answers(other)[3:]
    assert [r["id"] for r in recs] == [f"distill-{i}" for i in range(6)]
    assert [(p["temperature"], p["samples"]) for p in stats["by_temperature"]] == \
        [(0.0, 3), (1.0, 3)]
    assert stats["samples"] == 6 == len(recs)
    # the sampled part draws on its own stream: not the draws a lone T 1.0 run makes
    alone, _ = _mixed(embedded, [1.0], 3)
    assert answers(alone) != answers(recs)[3:]
    single, _ = distill.generate_answers(params, cfg, tok, PROMPTS, num_samples=3,
                                         temperature=1.0, template="plain", max_new_tokens=6,
                                         batch_size=2, seed=0, progress=False)
    assert single == alone


@pytest.mark.slow
def test_the_run_directory_records_how_its_data_was_drawn(tmp_path, embedded):
    from medusa_jax.training.trainer import Context

    params, cfg, tok = embedded
    run_cfg = Medusa1Config(distill_temperatures=(0.0, 0.8), distill_samples=4,
                            distill_max_new_tokens=4, distill_batch_size=64)
    ctx = Context(run_cfg, tmp_path, None, cfg, params, tok, "plain", (2,))
    train_file, held_file = distill.self_distill(ctx)
    meta = json.loads((tmp_path / "distill" / "train.jsonl.meta.json").read_text())
    assert meta["settings"]["temperatures"] == [0.0, 0.8]
    assert "temperature" not in meta["settings"]
    assert [(p["temperature"], p["samples"]) for p in meta["stats"]["by_temperature"]] == \
        [(0.0, 2), (0.8, 2)]
    assert len(train_file.read_text().splitlines()) == 4
    # one temperature keeps the settings a run always recorded (cached answers stay valid)
    one = Medusa1Config(distill_samples=4, distill_max_new_tokens=4, distill_batch_size=64)
    ctx = Context(one, tmp_path / "one", None, cfg, params, tok, "plain", (2,))
    distill.self_distill(ctx)
    meta = json.loads((tmp_path / "one" / "distill" / "train.jsonl.meta.json").read_text())
    assert meta["settings"]["temperature"] == 0.1 and "temperatures" not in meta["settings"]


@pytest.mark.parametrize("value, needle", [
    ("-1", "--temperature must be finite and >= 0, got -1.0"),
    ("nan", "--temperature must be finite and >= 0, got nan"),
    ("0,0", "--temperature: a temperature given twice"),
    ("0,x", "expected comma-separated numbers"),
])
def test_train_distill_refuses_bad_temperatures(tmp_path, value, needle, capsys):
    from train import distill as command

    with pytest.raises(SystemExit) as e:
        command.main(["--prompts", "p.txt", "--output", str(tmp_path / "o.jsonl"),
                      "--temperature", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1]
