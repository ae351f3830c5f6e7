"""What a notebook's `Medusa.generate` compiles: a new drafter, tree, batch, prompt bucket,
length bucket, or greedy against sampled; never a new temperature, filter, seed, typical's
thresholds or a token limit within its bucket."""

import pytest


@pytest.mark.slow
def test_changing_sampling_values_seed_or_length_compiles_nothing(medusa_default, capfd):
    m = medusa_default
    prompts = ["Once upon a time", "Lily"]
    m.generate(prompts, mode="rejection", temperature=0.7, max_new_tokens=20)
    capfd.readouterr()
    first = [g.token_ids for g in m.generate(prompts, mode="rejection", temperature=0.7,
                                              max_new_tokens=20, seed=1)]
    changes = [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(top_p=0.9),
               dict(seed=2), dict(max_new_tokens=30), dict(mode="typical", temperature=0.5),
               dict(mode="typical", epsilon=0.2, delta=0.5)]
    outputs = []
    for change in changes:
        kw = dict(mode="rejection", temperature=0.7, max_new_tokens=20, seed=1) | change
        gens = m.generate(prompts, **kw)
        err = capfd.readouterr().err
        assert "compiling" not in err, (change, err)
        assert m.last_timing.compile.seconds == 0, change
        assert all(g.new_tokens <= kw["max_new_tokens"] for g in gens)  # EOS may stop one
        outputs.append([g.token_ids for g in gens])
    assert max(len(ids) for ids in outputs[4]) > 20  # the new limit, within its bucket
    # the values are used, not just accepted: a new seed or temperature changes the draws
    assert outputs[3] != first and outputs[0] != first
    # a limit in another bucket, or greedy after sampling, is a program of its own
    m.generate(prompts, mode="rejection", temperature=0.7, max_new_tokens=40)
    assert "compiling" in capfd.readouterr().err
