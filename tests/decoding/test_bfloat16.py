"""bfloat16 decoding: Medusa is exact only in float32. In bfloat16 the verification pass
(several tokens at once) rounds differently from one-token steps, so Medusa greedy may part
from plain bfloat16 greedy; what matters is that it stays as close to float32 greedy as
plain bfloat16 decoding does."""

import numpy as np
import pytest

from medusa_jax.api import Medusa
from medusa_jax.runtime import assets

N_PROMPTS, NEW = 8, 48


def _agreement(rows, reference):
    """Mean length of the common prefix with the reference rows."""
    out = []
    for a, b in zip(rows, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(n)
    return float(np.mean(out))


@pytest.mark.slow
def test_bfloat16_medusa_stays_as_close_to_float32_as_plain_bfloat16(medusa_default):
    prompts = assets.heldout_prompts()[:N_PROMPTS]
    f32 = medusa_default  # Medusa.load(heads="default")
    bf16 = Medusa.load(heads="default", param_dtype="bfloat16", compute_dtype="bfloat16")
    ref = [g.token_ids for g in f32.generate(prompts, max_new_tokens=NEW, medusa=False)]
    plain = [g.token_ids for g in bf16.generate(prompts, max_new_tokens=NEW, medusa=False)]
    medusa = [g.token_ids for g in bf16.generate(prompts, max_new_tokens=NEW)]
    medusa32 = [g.token_ids for g in f32.generate(prompts, max_new_tokens=NEW)]
    assert medusa32 == ref  # float32: identical, the project's guarantee
    plain_agree, medusa_agree = _agreement(plain, ref), _agreement(medusa, ref)
    # rounding, not a bug: both part from float32 somewhere; Medusa no sooner on average
    # (a little slack for 8 prompts)
    assert medusa_agree >= 0.8 * plain_agree, (medusa_agree, plain_agree)
