"""The training step's speed switches change the speed, never the math: each against the plain path (full
logits, nothing recomputed) on a tiny model, losses and gradients, in float64 and float32; and which way
torch.compile takes the model (per block or whole)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import model
from model import GPT, GPTConfig, chunked_cross_entropy

TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_cross_entropy_is_linear_then_cross_entropy(dtype, monkeypatch):
    monkeypatch.setattr(model, "CHUNK_ELEMENTS", 29 * 5)  # 5 rows a chunk: 8 chunks, the last short
    assert model.chunk_rows(29, 37) == 5
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, dtype=dtype, generator=generator, requires_grad=True)
    weight = torch.randn(29, 16, dtype=dtype, generator=generator, requires_grad=True)
    targets = torch.randint(29, (37,), generator=generator)
    targets[[3, 11, 12]] = -1  # ignored rows
    loss = chunked_cross_entropy(x, weight, targets)
    grads = torch.autograd.grad(2.5 * loss, (x, weight))  # backward scales by the incoming gradient
    reference = F.cross_entropy(F.linear(x, weight), targets, ignore_index=-1)
    expected = torch.autograd.grad(2.5 * reference, (x, weight))
    torch.testing.assert_close(loss, reference, **TOLERANCES[dtype])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(chunked_cross_entropy(x, weight, targets), reference, **TOLERANCES[dtype])


def model_loss_and_grads(dtype, **switches):
    torch.manual_seed(0)
    config = GPTConfig(block_size=24, vocab_size=71, n_layer=2, n_head=2, n_embd=32, dropout=0.0, **switches)
    model = GPT(config).to(dtype).train()
    model.setup_attention("cpu", dtype)
    generator = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(71, (3, 24), generator=generator) for _ in range(2))
    targets[0, :4] = -1
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "switches",
    [
        dict(cross_entropy="chunked"),
        dict(activation_checkpointing="mlp"),
        dict(activation_checkpointing="block"),
        dict(cross_entropy="chunked", activation_checkpointing="block", attention_backend="manual"),
    ],
    ids=["chunked-ce", "recompute-mlp", "recompute-block", "all-manual"],
)
def test_each_switch_gives_the_plain_paths_loss_and_gradients(dtype, switches):
    plain_loss, plain_grads = model_loss_and_grads(
        dtype, cross_entropy="plain", attention_backend=switches.get("attention_backend", "sdpa")
    )
    loss, grads = model_loss_and_grads(dtype, **switches)
    torch.testing.assert_close(loss, plain_loss, **TOLERANCES[dtype])
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], **TOLERANCES[dtype], msg=name)


@pytest.mark.parametrize(
    "field, value", [("cross_entropy", "fused"), ("activation_checkpointing", "all"), ("compile_mode", "fast")]
)
def test_an_unknown_switch_value_is_one_line_listing_the_allowed(field, value, capsys):
    import train

    assert train.main([f"--{field}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and value in err and "choose one of" in err, err


def test_auto_chunks_the_loss_only_past_its_logits_limit(monkeypatch):
    config = GPTConfig(block_size=24, vocab_size=71, n_layer=1, n_head=2, n_embd=32)
    assert config.cross_entropy == "auto" and not config.chunks_loss(1024)
    assert config.chunks_loss(model.AUTO_CHUNKED_LOGITS // 71 + 1)
    gpt = GPT(config)
    idx = torch.randint(71, (2, 24), generator=torch.Generator().manual_seed(0))
    logits, plain = gpt(idx, idx)
    assert logits is not None
    monkeypatch.setattr(model, "AUTO_CHUNKED_LOGITS", 2 * 24 * 71 - 1)  # this batch is now past the limit
    logits, chunked = gpt(idx, idx)
    assert logits is None
    torch.testing.assert_close(chunked, plain)


@pytest.mark.parametrize(
    "settings, per_block",
    [
        ({"n_layer": 48}, True),  # the default for a deep model: regional compilation, its first step in seconds
        ({"n_layer": 12}, False),  # a shallow one compiles whole: as fast to compile, and faster to run
        ({"n_layer": 12, "compile_blocks": True}, True),
        ({"n_layer": 48, "compile_blocks": False}, False),
        ({"n_layer": 48, "compile_mode": "max-autotune-no-cudagraphs"}, True),
        ({"n_layer": 48, "compile_mode": "reduce-overhead"}, False),  # CUDA graphs of the whole model
        ({"n_layer": 48, "compile_mode": "max-autotune"}, False),
        ({"n_layer": 48, "ddp_graph_split": True}, False),  # cuts the whole model's graph at DDP's buckets
    ],
)
def test_compile_is_per_block_unless_the_whole_graph_is_asked_for(settings, per_block):
    from train import TrainConfig
    from training.preflight import compiles_per_block

    assert compiles_per_block(TrainConfig(**settings)) is per_block


@pytest.mark.parametrize("other", ["--ddp_graph_split=true", "--compile_mode=reduce-overhead"])
def test_compile_blocks_true_with_a_whole_graph_setting_is_one_line(other, capsys):
    import train

    assert train.main(["--compile_blocks=true", other]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "compile_blocks=true" in err, err


def test_a_sharded_model_compiles_per_block_and_says_so_where_asked_otherwise(caplog):
    import logging

    from train import TrainConfig
    from training.preflight import compiles_per_block

    for compile_blocks, warned in ((None, False), (True, False), (False, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="train"):
            assert compiles_per_block(TrainConfig(compile_blocks=compile_blocks), sharded=True)
        assert ("compile_blocks=false: parallelism fsdp compiles each block apart" in caplog.text) is warned
