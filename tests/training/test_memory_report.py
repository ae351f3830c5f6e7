"""The training commands' --memory-report (the real step compiled from shapes) and the
one-line errors of the scale flags."""

import json

import jax
import numpy as np
import pytest

from medusa_jax.model.backbone import param_shapes
from medusa_jax.training import memory

SHAPE = "llama-15m"  # hidden 288, 6 layers, 32,000 words: compiles in seconds
SMALL = ["--shape", SHAPE, "--batch-size", "4", "--seq-len", "128", "--num-heads", "3",
         "--num-layers", "1", "--memory-layers", "1,1", "--json"]  # one compile each


def report(command, args, capsys) -> dict:
    command.main(["--memory-report", *SMALL, *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_medusa1_report_counts_params_and_adam_moments_exactly(capsys):
    from train.medusa1 import command

    r = report(command, ["--dtype", "bfloat16"], capsys)
    cfg = memory.model_config(SHAPE)
    n_backbone = sum(int(np.prod(s)) for s in
                     jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)))
    h, v = cfg.hidden_size, cfg.vocab_size
    n_heads = 3 * (h * h + h + h * v)
    assert r["params_bytes"] == {"backbone": 2 * n_backbone, "heads": 4 * n_heads}
    # Adam's two float32 moments for the heads only; a few scalar counters
    assert 0 <= r["parts_bytes"]["optimizer_state"] - 2 * 4 * n_heads < 64
    assert r["per_device_bytes"] == sum(r["parts_bytes"].values())
    # memory_analysis counts one device's arguments: the state and the batch
    assert r["compiled_argument_bytes"] == r["state_and_batch_bytes"]
    assert r["layers"] == 6 and r["layers_compiled"] == [1]


@pytest.mark.slow
def test_soft_targets_are_reported_and_chunked_over_tokens(capsys):
    from train.medusa1 import command

    soft = ["--target", "tv", "--target-temperature", "0.8"]
    one = report(command, [*soft, "--loss-chunk", "128"], capsys)
    chunked = report(command, [*soft, "--loss-chunk", "8"], capsys)
    assert (one["target"], one["target_temperature"]) == ("tv", 0.8)
    assert list(one["loss_chunking"]) == ["one", 128]
    assert list(chunked["loss_chunking"]) == ["tokens", 8]
    # unchunked: the heads' [K, B, T, V] float32 logits and the backbone's [B, T, V] at once
    logits = 3 * 4 * 128 * 32000 * 4
    assert one["parts_bytes"]["temporaries"] - chunked["parts_bytes"]["temporaries"] > logits
    command.main(["--memory-report", *SMALL[:-1], *soft])  # the text report names it
    assert "target tv at T 0.8" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_fsdp_splits_the_state_and_the_chunked_loss_cuts_temporaries(capsys):
    from train.medusa1 import command

    one = report(command, ["--loss-chunk", "128"], capsys)  # one block: today's loss
    two = report(command, ["--loss-chunk", "128", "--mesh", "fsdp=2"], capsys)
    assert two["devices"] == 2 and two["batch_per_device"] == 2
    for part in ("params", "optimizer_state"):  # norms stay whole: just over half
        assert 0.5 <= two["parts_bytes"][part] / one["parts_bytes"][part] < 0.51, part
    chunked = report(command, ["--loss-chunk", "8"], capsys)
    # the unchunked step holds [K, B, T, V] float32 logits of 3 x 4 x 128 x 32,000 (197 MB)
    # and their gradient; the chunked one a 16th of them at a time
    logits = 3 * 4 * 128 * 32000 * 4
    assert one["parts_bytes"]["temporaries"] - chunked["parts_bytes"]["temporaries"] > logits
    assert list(chunked["loss_chunking"]) == ["tokens", 8]
    assert list(one["loss_chunking"]) == ["one", 128]


@pytest.mark.slow
def test_medusa2_report_keeps_float32_master_weights_and_a_bfloat16_teacher(capsys):
    from train.medusa2 import command

    r = report(command, ["--dtype", "bfloat16", "--remat", "--device-memory", "80GB"], capsys)
    bb = r["params_bytes"]["backbone"]
    assert r["params_bytes"]["teacher"] * 2 == bb and r["backbone_param_dtype"] == "float32"
    # Adam moments for the backbone and the heads, none for the teacher
    trained = bb + r["params_bytes"]["heads"]
    assert 0 <= r["parts_bytes"]["optimizer_state"] - 2 * trained < 64
    assert r["remat"] and r["fits"] and r["device_memory_bytes"] == 80 * 10 ** 9


@pytest.mark.parametrize("argv, message", [
    (["--shape", SHAPE], "--shape needs --memory-report"),
    (["--memory-report"], "--memory-report needs --shape"),
    (["--memory-report", "--shape", "llama-9b"], "neither a known shape"),
    (["--memory-report", "--shape", SHAPE, "--device-memory", "lots"], "bad memory size"),
    (["--memory-report", "--shape", SHAPE, "--memory-layers", "1"], "two depths"),
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6 is not divisible by "
                                                  "--grad-accum 4"),
    (["--loss-chunk", "-1"], "--loss-chunk must be >= 0"),
])
def test_bad_scale_flags_exit_2_with_one_line(argv, message, capsys):
    from train.medusa1 import command

    with pytest.raises(SystemExit) as e:
        command.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in ln for ln in err), err


@pytest.mark.parametrize("aux, message", [
    ("1,2,40", "--aux-layers 1,2,40: layer 40 is past the 6 layers of --shape llama-15m "
               "(0 .. 5)"),
    ("1,2,6", "--aux-layers 1,2,6: layer 6 is past the 6 layers of --shape llama-15m "
              "(0 .. 5)"),
])
def test_eagle_report_names_an_aux_layer_past_the_shape(aux, message, capsys):
    """The shape's depth is what the layer is past, not --memory-layers' depths."""
    from train.eagle import command

    with pytest.raises(SystemExit) as e:
        command.main(["--memory-report", "--shape", SHAPE, "--aux-layers", aux])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"python -m train.eagle: error: {message}", err


def test_micro_batch_not_divisible_by_the_mesh_fails_before_any_work(tmp_path, capsys):
    from train.medusa1 import command

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        command.main(["--batch-size", "8", "--grad-accum", "4", "--mesh", "data=4",
                      "--output-dir", str(run)])
    assert "2 rows per micro-batch is not divisible by the 4 batch shards" in str(e.value)
    assert not run.exists()


@pytest.mark.slow
def test_eagle_report_counts_the_drafter_and_its_adam_moments_exactly(capsys):
    """train.eagle's report: the drafter the run would train (the shape's default aux layers,
    the given draft vocabulary), its weights' two Adam moments (d2t/t2d frozen), and a
    compiled depth that cannot hold the aux layers is a one-line error."""
    from medusa_jax.drafters.eagle3 import heads as eagle3
    from train.eagle import command

    args = ["--memory-report", "--shape", SHAPE, "--batch-size", "4", "--seq-len", "128",
            "--draft-vocab", "8000", "--ttt-steps", "2", "--json"]
    command.main(args)
    r = json.loads(capsys.readouterr().out)
    cfg = memory.model_config(SHAPE)
    c = eagle3.default_config(cfg, 8000, (1, 3, 5))  # the 6-layer shape's default layers
    shapes = eagle3.param_shapes(c)
    n_all = sum(int(np.prod(shapes[n])) for n in eagle3.NAMES)
    n_trained = sum(int(np.prod(shapes[n])) for n in eagle3.WEIGHTS)
    assert r["params_bytes"]["heads"] == 4 * n_all
    assert 0 <= r["parts_bytes"]["optimizer_state"] - 2 * 4 * n_trained < 64
    assert r["method"] == "eagle3" and "layers [1, 3, 5]" in r["heads"]
    assert r["layers_compiled"] == [6]
    with pytest.raises(SystemExit) as e:
        command.main([*args, "--memory-layers", "2,3"])
    msg = str(e.value)
    assert msg.startswith("error: --memory-layers") and "give depths of at least 4" in msg
    assert "\n" not in msg
