"""training/fp8.py: which recipe runs and why, which linears convert, that checkpoints keep their format, and FSDP's
FP8 all-gather (as one process of a gloo group: FSDP on a CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from helpers import free_port, tiny_args, tiny_config
from model import GPT, GPTConfig
from training import fp8, parallel
from training.runtime import Runtime, join_process_group, leave_process_group

float8_linear = pytest.importorskip("torchao.float8.float8_linear")

CPU = torch.device("cpu")


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_an_explicit_recipe_on_a_cpu_trains_in_bf16_and_says_why_once(mode, caplog):
    model = GPT(tiny_config())
    with caplog.at_level(logging.INFO, logger="train"):
        choice = fp8.setup_fp8(model, mode, CPU, torch.bfloat16, compiled=True, lora=False)
    assert choice == fp8.Fp8Choice("off", "FP8 matmuls need a CUDA GPU (device is cpu)")
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"fp8={mode} requested but FP8 matmuls need a CUDA GPU (device is cpu); training in bf16"]
    assert not any(isinstance(m, float8_linear.Float8Linear) for m in model.modules())


def test_lora_comes_before_every_other_reason():
    choice = fp8.choose_fp8("tensorwise", 4096, CPU, torch.float32, compiled=False, lora=True)
    assert choice.recipe == "off" and choice.reason.startswith("LoRA")


def test_auto_is_off_where_no_measurement_says_fp8_wins(caplog, monkeypatch):
    monkeypatch.setattr(fp8, "why_fp8_cannot_run", lambda *args, **kwargs: "")
    monkeypatch.setattr(fp8, "card_family", lambda device: "sm90")
    monkeypatch.setattr(fp8, "AUTO_FP8", {"sm90": (4096, "tensorwise")})
    assert fp8.choose_fp8("auto", 768, CPU, torch.bfloat16, compiled=True, lora=False).recipe == "off"
    wide = fp8.choose_fp8("auto", 4096, CPU, torch.bfloat16, compiled=True, lora=False)
    assert wide == fp8.Fp8Choice("tensorwise", "auto: measured faster than bf16 on sm90 from width 4096")
    monkeypatch.setattr(fp8, "AUTO_FP8", {})
    model = GPT(tiny_config())
    with caplog.at_level(logging.INFO, logger="train"):
        assert fp8.setup_fp8(model, "auto", CPU, torch.bfloat16, compiled=True, lora=False).recipe == "off"
    assert [r.levelname for r in caplog.records] == ["INFO"]  # auto falling back is no warning
    assert "fp8: off, bf16 matmuls (auto: FP8 measured faster than bf16 on sm90 at no width yet" in caplog.text


@pytest.mark.parametrize(
    ("n_embd", "recipe"), [(768, "off"), (1600, "off"), (4096, "tensorwise"), (5120, "tensorwise")]
)
def test_auto_turns_fp8_on_for_hopper_from_width_4096_and_never_for_gpt2_widths(monkeypatch, n_embd, recipe):
    """The shipped table: GPT-2 124M (768) and XL (1600) train in bf16, the 6.7B GPT's width (4096) in FP8."""
    monkeypatch.setattr(fp8, "why_fp8_cannot_run", lambda *args, **kwargs: "")
    for family, expected in (("sm90", recipe), ("sm89", "off"), ("sm100", "off")):
        monkeypatch.setattr(fp8, "card_family", lambda device, family=family: family)
        choice = fp8.choose_fp8("auto", n_embd, CPU, torch.bfloat16, compiled=True, lora=False)
        assert choice.recipe == expected, (family, choice)


@pytest.mark.parametrize(
    ("shape", "tensorwise", "rowwise"),
    [
        ((768, 768), False, False),  # GPT-2 124M's attention c_proj
        ((2304, 768), True, False),  # its c_attn: wide enough for tensorwise, K too small for rowwise
        ((768, 3072), False, False),  # its MLP c_proj
        ((50304, 768), True, False),  # lm_head
        ((12288, 4096), True, True),  # 6.7B's c_attn
        ((4096, 16384), True, True),  # 6.7B's MLP c_proj
        ((4104, 4096), False, False),  # not a multiple of 16: no FP8 kernel
    ],
)
def test_the_conversion_rule_by_shape(shape, tensorwise, rowwise):
    linear = nn.Linear(shape[1], shape[0], bias=False, device="meta")
    assert (fp8.converts(linear, "tensorwise"), fp8.converts(linear, "rowwise")) == (tensorwise, rowwise)


def test_converted_linears_keep_their_weights_the_tie_and_the_checkpoint_format():
    model = GPT(tiny_config(n_embd=64, n_head=2, vocab_size=2048))  # c_attn 192x64: K <= 4096, N <= 1024 stays
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = fp8.convert_to_fp8(model, "tensorwise")
    assert names == ["lm_head"]  # (2048, 64): N > 1024
    assert isinstance(model.lm_head, float8_linear.Float8Linear)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    plain = GPT(tiny_config(n_embd=64, n_head=2, vocab_size=2048))
    plain.load_state_dict(after)  # an FP8 run's checkpoint resumes without FP8, and the other way round
    model.load_state_dict(plain.state_dict())


def wide_mlp_config(**overrides):
    """A model whose MLP c_fc (1040 x 32) converts for tensorwise, as its lm_head (1040 x 32, tied) does: N past 1024,
    the smallest such multiple of 16 (on a CPU, FP8 matmuls run a slow reference kernel)."""
    return tiny_config(n_embd=32, n_head=2, vocab_size=1040, mlp_hidden=1040, bias=False, **overrides)


@pytest.mark.parametrize(
    ("recipe", "sharded", "gathers"),
    [("tensorwise", True, True), ("tensorwise", False, False), ("rowwise", True, False), ("rowwise", False, False)],
)
def test_fsdp_all_gathers_in_fp8_with_tensorwise_scaling_only(recipe, sharded, gathers):
    """torchao offers the FP8 all-gather for tensorwise scaling; rowwise under FSDP gathers bf16 weights."""
    config = fp8.float8_config(recipe, sharded=sharded)
    assert config.enable_fsdp_float8_all_gather is gathers
    recipe_config = float8_config_module().Float8LinearConfig.from_recipe_name(recipe)
    assert config.cast_config_weight == recipe_config.cast_config_weight  # the recipe itself is unchanged


def float8_config_module():
    return pytest.importorskip("torchao.float8.config")


def test_under_the_fp8_all_gather_a_tied_lm_head_stays_as_it_is():
    for sharded, expected in ((False, ["lm_head"]), (True, [])):
        model = GPT(wide_mlp_config())
        names = fp8.convert_to_fp8(model, "tensorwise", sharded=sharded)
        assert names == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc", *expected]
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied


def test_setup_under_fsdp_says_the_weights_are_gathered_in_fp8(caplog, monkeypatch):
    monkeypatch.setattr(fp8, "why_fp8_cannot_run", lambda *args, **kwargs: "")  # as on a GPU that runs FP8
    for recipe, sharded, gathers in (
        ("tensorwise", True, True),
        ("tensorwise", False, False),
        ("rowwise", True, False),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="train"):
            choice = fp8.setup_fp8(
                GPT(wide_mlp_config()), recipe, CPU, torch.bfloat16, compiled=True, lora=False, sharded=sharded
            )
        assert choice == fp8.Fp8Choice(recipe, "", gathers)
        assert ("FSDP all-gathers their weights in FP8" in caplog.text) is gathers, caplog.text


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    """A gloo process group of this one process, destroyed after the test."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in world.items():
        monkeypatch.setenv(name, value)
    join_process_group("gloo")
    yield
    leave_process_group()


def test_fsdp_with_the_fp8_all_gather_trains_as_fp8_unsharded_and_saves_plain_weights(gloo_world_of_one, monkeypatch):
    """Sharded (one process, placed as a rank of two), with the FP8 all-gather and the scales precomputed after
    each optimizer step: the losses and weights of the same FP8 model unsharded, and a checkpoint of plain tensors,
    which loads into a model without FP8. lm_head untied: it converts in both."""
    import torchao.float8

    precomputed = []
    precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp
    monkeypatch.setattr(
        torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", lambda m: precomputed.append(1) or precompute(m)
    )
    idx = torch.randint(0, 1040, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for world_size in (1, 2):
        torch.manual_seed(0)
        model = GPT(wide_mlp_config(tie_embeddings=False))
        assert len(fp8.convert_to_fp8(model, "tensorwise", sharded=world_size == 2)) == 3
        model = parallel.place_model(model, Runtime(CPU, torch.float32, world_size=world_size), "fsdp")
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
        if world_size == 2:
            fp8.precompute_scales_after_each_step(optimizer, model)
        losses = []
        for _ in range(3):
            _, loss = model(idx, idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        results[world_size] = losses, parallel.full_model_state(model)
    assert len(precomputed) == 3
    torch.testing.assert_close(results[2][0], results[1][0])
    weights = results[2][1]
    assert all(type(tensor) is torch.Tensor for tensor in weights.values())
    torch.testing.assert_close(weights, dict(results[1][1]))
    GPT(wide_mlp_config(tie_embeddings=False)).load_state_dict(weights)


def test_train_py_with_fp8_on_a_cpu_trains_in_bf16_and_warns_once(char_data, tmp_path, capsys):
    import train

    args = tiny_args(char_data, tmp_path / "out", "--fp8=tensorwise", "--max_iters=1", "--eval_iters=1")
    assert train.main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert err.count("WARNING: fp8=tensorwise requested but FP8 matmuls need a CUDA GPU (device is cpu)") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_train_py_trains_with_fp8_compiled(recipe, char_data, tmp_path, capsys, monkeypatch):
    """A few compiled steps through train.py with every linear whose dims are multiples of 16 converted (the tiny
    model is below the rule's sizes): the loss falls, the INFO line names the recipe, and the checkpoint loads
    into a plain model."""
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("FP8 needs sm89 or newer")
    import train

    monkeypatch.setattr(
        fp8, "converts", lambda linear, recipe: linear.in_features % 16 == linear.out_features % 16 == 0
    )
    out = tmp_path / "out"
    args = tiny_args(char_data, out, f"--fp8={recipe}", "--device=cuda", "--compile=true", "--max_iters=20")
    assert train.main([*args, "--eval_interval=10", "--eval_iters=2", "--log_interval=10"]) == 0
    captured = capsys.readouterr()
    assert f"fp8: {recipe} scaling on " in captured.err and "WARNING" not in captured.err
    state = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)
    GPT(GPTConfig(**state["model_config"])).load_state_dict(state["model"])
    evals = [float(line.split("| val ")[1].split()[0]) for line in captured.out.splitlines() if "| val " in line]
    assert evals and evals[-1] < evals[0]
