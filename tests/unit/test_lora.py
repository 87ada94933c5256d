"""weights/lora.py: adapters that start as a no-op, train alone, merge into the weights, and save as a small file
naming their base; train.py's lora_* settings, resume, sample.py and `python -m weights merge` on an adapter
checkpoint."""

from __future__ import annotations

import contextlib
import io
import os
import shutil

import pytest
import torch
from torch.nn import functional as F

import sample
import train
from helpers import tiny_args, tiny_config, tree_digest
from model import GPT
from storage.checkpoint import claim_out_dir
from weights import lora
from weights.__main__ import main as weights_main
from weights.load import load_checkpoint, saved_model_config
from weights.lora import LoRALinear, apply_lora, lora_state_dict, merge_lora

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    model = GPT(tiny_config()).to(dtype)
    model.setup_attention("cpu", dtype)
    return model


def all_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Logits at every position: with targets, under the plain loss (the chunked one never builds them)."""
    model.config.cross_entropy = "plain"
    logits, _ = model(idx, torch.zeros_like(idx))
    assert logits.shape == (*idx.shape, model.config.vocab_size)
    return logits


def train_adapters_a_little(model: GPT) -> None:
    """Three AdamW steps as train.py configures them (weight decay on every matrix it is given)."""
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
    for _ in range(3):
        idx = torch.randint(64, (2, 16))
        _, loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_at_init_the_lora_model_is_the_base_exactly_and_only_adapters_train():
    model = tiny_gpt()
    idx = torch.randint(64, (3, 32))
    base_logits, base_state = all_logits(model, idx), {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, rank=4, alpha=8.0, targets="c_attn,c_proj")
    assert torch.equal(all_logits(model, idx), base_logits)
    adapters = lora_state_dict(model)
    assert set(model.state_dict()) == set(base_state) | set(adapters)  # the base keeps its names
    assert len(adapters) == 2 * 3 * 2  # c_attn, attn.c_proj, mlp.c_proj in each of 2 layers; A and B each
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)

    train_adapters_a_little(model)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base_state.items())  # no base tensor moved, decay or not
    assert all(state[k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))  # the adapters did


def test_lora_linear_forward_and_backward_match_the_merged_weight_float64():
    """y and the gradients of A and B against a Linear with W + s·B·A, differentiated by autograd."""
    torch.manual_seed(1)
    layer = LoRALinear(torch.nn.Linear(12, 20).double(), rank=3, alpha=6.0)
    torch.nn.init.normal_(layer.lora_B)
    x, dy = torch.randn(5, 12, dtype=torch.float64), torch.randn(5, 20, dtype=torch.float64)
    A, B = layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_()
    reference = F.linear(x, layer.weight.detach() + 2.0 * B @ A, layer.bias.detach())
    y = layer(x)
    torch.testing.assert_close(y, reference, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(y, [layer.lora_A, layer.lora_B], dy)
    reference_grads = torch.autograd.grad(reference, [A, B], dy)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_merged_and_unmerged_models_agree_and_merging_gives_a_plain_gpt():
    model = tiny_gpt()
    base_keys = set(model.state_dict())
    apply_lora(model, rank=4, targets="c_attn,c_fc")
    train_adapters_a_little(model)
    idx = torch.randint(64, (2, 32))
    with torch.no_grad():
        unmerged = all_logits(model, idx)
        merged_model = merge_lora(model)
        merged = all_logits(merged_model, idx)
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, LoRALinear) for m in merged_model.modules())
    assert set(merged_model.state_dict()) == base_keys
    assert all(p.requires_grad for p in merged_model.parameters())
    assert merged_model.lm_head.weight is merged_model.transformer.wte.weight  # still tied


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=4, targets="c_attn,nope"), "'nope' matches no Linear layer; the model has c_attn, c_fc, c_proj"),
        (dict(rank=4, targets="lm_head"), "lm_head is tied to wte"),
        (dict(rank=4, targets=" , "), "lora_targets is empty"),
        (dict(rank=0), "rank must be a positive integer"),
    ],
)
def test_bad_lora_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError) as error:
        apply_lora(tiny_gpt(), **kwargs)
    assert message in str(error.value)


# ---- train.py, sample.py and the merge command on adapter checkpoints ----


def run_train(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train.main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def lora_out(trained_out, char_data, tmp_path_factory):
    """out_dir of 3 LoRA steps (rank 4) on trained_out's checkpoint. Shared: copy it before changing it."""
    out = tmp_path_factory.mktemp("lora_out")
    base = trained_out / "ckpt.pt"
    args = ("--max_iters=3", "--eval_interval=3", "--learning_rate=1e-2", "--lora_rank=4", f"--init_from={base}")
    code, stdout, err = run_train(*tiny_args(char_data, out, *args))
    assert code == 0, err
    return out


def test_an_adapter_checkpoint_is_small_and_names_its_base(lora_out, trained_out):
    state = load_checkpoint(lora_out / "ckpt.pt", resume=True)
    assert set(state["model"]) and all(lora.is_adapter_key(k) for k in state["model"])
    assert any(v.abs().sum() > 0 for k, v in state["model"].items() if k.endswith("lora_B"))
    entry = state["lora"]
    assert entry["base"] == str((trained_out / "ckpt.pt").resolve())
    assert entry["base_sha256"] == lora.weights_digest(load_checkpoint(trained_out / "ckpt.pt")["model"])
    assert (entry["rank"], entry["alpha"]) == (4, 16.0)
    assert (lora_out / "ckpt.pt").stat().st_size < (trained_out / "ckpt.pt").stat().st_size / 4


def test_resume_continues_the_adapters(lora_out, char_data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(lora_out, out)
    common = (*tiny_args(char_data, out, "--eval_interval=5", "--learning_rate=1e-2"), "--init_from=resume")
    code, stdout, err = run_train(*common, "--max_iters=5", "--lora_rank=4")
    assert code == 0, err
    assert "resuming at iter 3" in stdout
    state = load_checkpoint(out / "ckpt.pt", resume=True)
    assert state["iter_num"] == 5 and all(lora.is_adapter_key(k) for k in state["model"])

    before = tree_digest(out)
    for extra, message in (("--lora_rank=8", "lora_rank=4 (config says 8)"), ("--lora_rank=0", "holds LoRA adapters")):
        code, _, err = run_train(*common, "--max_iters=7", extra)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert tree_digest(out) == before  # the refused runs wrote nothing


def test_sample_and_merge_use_the_base_with_the_adapters_merged(lora_out, tmp_path):
    state = load_checkpoint(lora_out / "ckpt.pt")
    adapted = GPT(saved_model_config(state, lora_out / "ckpt.pt"))
    lora.load_model_weights(adapted, state, lora_out / "ckpt.pt", keep_adapters=True)
    assert any(isinstance(m, LoRALinear) for m in adapted.modules())
    idx = torch.randint(adapted.config.vocab_size, (2, 16))

    cfg = sample.SampleConfig(out_dir=str(lora_out), device="cpu", num_samples=1, max_new_tokens=4, start="ROMEO:")
    sampled, *_ = sample.load_model(cfg, torch.device("cpu"))
    assert not any(isinstance(m, LoRALinear) for m in sampled.modules())
    with torch.no_grad():
        torch.testing.assert_close(all_logits(sampled, idx), all_logits(adapted, idx), rtol=1e-5, atol=1e-5)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert sample.sample(cfg) == 0

    merged_path = tmp_path / "merged.pt"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert weights_main(["merge", str(lora_out / "ckpt.pt"), str(merged_path)]) == 0
    assert out.getvalue() == f"wrote {merged_path}\n"
    merged = load_checkpoint(merged_path)
    assert "lora" not in merged and set(merged) == {"model", "model_config", "meta"}
    before = tree_digest(tmp_path, lora_out)
    with contextlib.redirect_stderr(io.StringIO()) as err:  # export wants the merged model, not the adapters
        assert weights_main(["safetensors", str(lora_out / "ckpt.pt"), str(tmp_path / "x.safetensors")]) == 2
    adapters = lora_out / "ckpt.pt"
    assert err.getvalue() == (
        f"error: {adapters} is a LoRA adapter checkpoint (adapters on a base model), not a plain one; merge them "
        f"into their base first: python -m weights merge {adapters} {lora_out / 'ckpt-merged.pt'}\n"
    )
    assert tree_digest(tmp_path, lora_out) == before  # nothing written
    plain = GPT(adapted.config)
    plain.load_state_dict(merged["model"])
    with torch.no_grad():
        torch.testing.assert_close(all_logits(plain, idx), all_logits(adapted, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["base moved", "base changed"])
def test_an_adapter_checkpoint_whose_base_is_gone_or_changed_is_one_line(lora_out, tmp_path, capsys, change):
    state = load_checkpoint(lora_out / "ckpt.pt")
    if change == "base moved":
        state["lora"]["base"] = str(tmp_path / "nowhere.pt")
    else:
        state["lora"]["base_sha256"] = "0" * 64
    torch.save(state, tmp_path / "ckpt.pt")
    before = tree_digest(tmp_path)
    assert sample.main([f"--out_dir={tmp_path}", "--device=cpu", "--max_new_tokens=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / 'ckpt.pt'} holds LoRA adapters"), err
    assert ("which is missing; put the base back" if change == "base moved" else "sha256 differs") in err
    assert tree_digest(tmp_path) == before


def test_lora_from_scratch_saves_its_base_inside_and_resumes(char_data, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_train(*tiny_args(char_data, out, "--max_iters=2", "--eval_interval=2", "--lora_rank=2"))
    assert code == 0, err
    state = load_checkpoint(out / "ckpt.pt")
    assert state["lora"]["base"] == "" and "transformer.wte.weight" in state["model"]
    args = tiny_args(char_data, out, "--max_iters=3", "--eval_interval=3", "--lora_rank=2", "--init_from=resume")
    code, stdout, err = run_train(*args)
    assert code == 0 and "resuming at iter 2" in stdout, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lora_rank=4", "--lora_targets=c_attn,q_proj"], "'q_proj' matches no Linear layer; the model has c_attn"),
        (["--lora_rank=-1"], "lora_rank must be >= 0"),
        (["--lora_rank=4", "--lora_alpha=0"], "lora_alpha > 0"),
    ],
)
def test_bad_lora_settings_are_one_line(char_data, tmp_path, extra, message):
    code, stdout, err = run_train(*tiny_args(char_data, tmp_path / "out", *extra))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


# ---- where merge may write ----


def merge_cli(*argv: str) -> tuple[int, str, str]:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = weights_main(["merge", *argv])
    return code, out.getvalue(), err.getvalue()


def test_merge_never_writes_over_a_training_runs_checkpoint_and_a_resumable_one_only_when_told(
    lora_out, trained_out, tmp_path
):
    """A run holds its out_dir: merging onto its ckpt.pt is refused, --overwrite or not. Without a live run, a
    checkpoint a run can resume from is replaced only with --overwrite."""
    run = tmp_path / "run"
    shutil.copytree(trained_out, run)
    before = tree_digest(run)
    with claim_out_dir(run, continuing=True, overwrite=False):
        for extra in ((), ("--overwrite",)):
            code, out, err = merge_cli(str(lora_out / "ckpt.pt"), str(run / "ckpt.pt"), *extra)
            assert code == 2 and out == "" and err.count("\n") == 1, err
            assert f"is the out_dir of a run training now (pid {os.getpid()})" in err, err
    assert tree_digest(run) == before
    code, out, err = merge_cli(str(lora_out / "ckpt.pt"), str(run / "best.pt"))
    assert code == 2 and "a checkpoint a run can resume from (iter " in err and "--overwrite" in err, err
    assert tree_digest(run) == before
    code, out, err = merge_cli(str(lora_out / "ckpt.pt"), str(run / "best.pt"), "--overwrite")
    assert code == 0 and out == f"wrote {run / 'best.pt'}\n", err
    assert "optimizer" not in load_checkpoint(run / "best.pt")


def test_merge_takes_paths_as_typed_and_says_where_the_file_went(lora_out, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    adapters = str(lora_out / "ckpt.pt")
    assert merge_cli(adapters, "~/home.pt")[:2] == (0, f"wrote {tmp_path / 'home.pt'}\n")
    assert merge_cli(adapters, "sub/../here.pt")[:2] == (0, f"wrote {tmp_path / 'here.pt'}\n")
    for typed, message in (
        ("new/", "new/ ends in / (a folder); name the file to write, e.g. new/merged.pt"),
        ("sub", "sub is a folder; name the file to write, e.g. sub/merged.pt"),
        ("nowhere/m.pt", "cannot write nowhere/m.pt: folder nowhere does not exist"),
    ):
        code, out, err = merge_cli(adapters, typed)
        assert code == 2 and out == "" and err == f"error: {message}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here.pt", "home.pt", "sub"]
    assert not any((tmp_path / "sub").iterdir())


def test_merge_refuses_weights_that_come_out_non_finite(lora_out, tmp_path):
    state = load_checkpoint(lora_out / "ckpt.pt")
    name = next(key for key in state["model"] if key.endswith("lora_B"))
    state["model"][name][0, 0] = float("inf")
    torch.save(state, tmp_path / "adapters.pt")
    code, out, err = merge_cli(str(tmp_path / "adapters.pt"), str(tmp_path / "merged.pt"))
    assert code == 2 and err.count("\n") == 1 and "has non-finite weights (NaN or inf in transformer.h." in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters.pt"]
