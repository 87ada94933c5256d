"""training/preflight.py: the model shape a checkpoint gives a run (with_weights_shape). The settings the user
left out take the weights' values; one the user set against them is one line naming both."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

import train
from errors import UsageError
from model import GPTConfig
from train import TrainConfig
from training.preflight import with_weights_shape
from weights.load import load_checkpoint

# A model unlike TrainConfig's defaults in every shape setting
SAVED = GPTConfig(
    block_size=16,
    vocab_size=41,
    n_layer=2,
    n_head=4,
    n_embd=32,
    bias=True,
    rope=True,
    rope_theta=500.0,
    norm="rmsnorm",
    mlp="swiglu",
    mlp_hidden=96,
    n_kv_head=2,
    qk_norm=True,
)
CHECKPOINT = {"model_config": dataclasses.asdict(SAVED)}


def test_a_fine_tune_takes_every_shape_setting_left_out_from_the_weights():
    cfg = TrainConfig(init_from="a/ckpt.pt", batch_size=3)
    shaped = with_weights_shape(cfg, CHECKPOINT)
    assert shaped.model_config() == SAVED  # block_size included
    assert shaped.batch_size == 3 and shaped.init_from == "a/ckpt.pt"


def test_settings_set_to_the_weights_values_stay_and_a_smaller_block_size_crops():
    cfg = TrainConfig(init_from="a/ckpt.pt", n_layer=2, block_size=8, n_kv_head=2, n_head=4, n_embd=32)
    shaped = with_weights_shape(cfg, CHECKPOINT, frozenset({"n_layer", "block_size", "n_kv_head"}))
    assert shaped.model_config() == dataclasses.replace(SAVED, block_size=8)


def test_resume_takes_the_whole_shape_block_size_included():
    """A resume continues the checkpoint's model: a run trained at another block_size than the default resumes
    with no flags (a smaller one set is refused: check_resume_keeps_model)."""
    shaped = with_weights_shape(TrainConfig(init_from="resume", out_dir="a"), CHECKPOINT)
    assert shaped.model_config() == SAVED


def test_grouped_heads_set_as_the_model_sees_them_are_the_same_model():
    """n_kv_head=None means n_head key/value heads: set either way, it is the saved model."""
    plain = {"model_config": {**CHECKPOINT["model_config"], "n_kv_head": None}}
    cfg = TrainConfig(init_from="a/ckpt.pt", n_kv_head=4, n_head=4, n_embd=32)
    assert with_weights_shape(cfg, plain, frozenset({"n_kv_head"})).n_kv_head == 4
    cfg = TrainConfig(init_from="a/ckpt.pt", n_kv_head=None)
    assert with_weights_shape(cfg, CHECKPOINT, frozenset()).n_kv_head == 2  # left out: the weights'


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"n_layer": 4},
            "--n_layer=4 conflicts with the checkpoint's n_layer=2 (a/ckpt.pt); "
            "leave it out to take the checkpoint's shape",
        ),
        (
            {"n_embd": 64, "rope": False, "n_kv_head": None},
            "--n_embd=64 conflicts with the checkpoint's n_embd=32, --rope=False with its rope=True, "
            "--n_kv_head=None with its n_kv_head=2 (a/ckpt.pt); leave them out to take the checkpoint's shape",
        ),
        (  # no model at all with the weights' n_embd=32 (head dim 1): compared as set
            {"n_head": 32},
            "--n_head=32 conflicts with the checkpoint's n_head=4 (a/ckpt.pt); leave it out",
        ),
    ],
    ids=["one", "several", "no-model"],
)
def test_a_shape_setting_set_against_the_weights_is_one_line_naming_both(settings, message):
    cfg = TrainConfig(init_from="a/ckpt.pt", **settings)
    with pytest.raises(UsageError) as error:
        with_weights_shape(cfg, CHECKPOINT, frozenset(settings))
    assert str(error.value).startswith(message)
    assert with_weights_shape(cfg, CHECKPOINT, frozenset()).model_config() == SAVED  # left out: no conflict


def test_a_setting_that_does_not_go_with_the_weights_shape_is_a_usage_error():
    cfg = TrainConfig(init_from="a/ckpt.pt", context_parallel=2)  # 4 chunks of each sequence
    odd = {"model_config": {**CHECKPOINT["model_config"], "block_size": 18}}
    with pytest.raises(UsageError, match=r"^with the model shape of a/ckpt.pt: context_parallel=2 .* multiple of 4"):
        with_weights_shape(cfg, odd)


def test_fine_tuning_a_checkpoint_of_another_shape_needs_no_shape_flags(trained_out, tmp_path, one_thread):
    """nanoGPT's habit: `python train.py --init_from=a/ckpt.pt` with TrainConfig's model defaults (4 x 128, block
    64) on a checkpoint of 2 layers x 32, block 16."""
    data = load_checkpoint(trained_out / "ckpt.pt")["config"]["data_dir"]
    out = tmp_path / "out"
    args = [f"--init_from={trained_out / 'ckpt.pt'}", f"--data_dir={data}", f"--out_dir={out}", "--device=cpu"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train.main([*args, "--max_iters=1", "--eval_iters=1", "--batch_size=2", "--compile=false"]) == 0
    saved = load_checkpoint(trained_out / "ckpt.pt")["model_config"]
    assert load_checkpoint(out / "ckpt.pt")["model_config"] == saved
