"""weights/hf.py, weights/load.py and model.py's GPT.from_pretrained: Hugging Face GPT-2 and nanoGPT weights in,
HF GPT-2 folders out (`python -m weights hf`), with transformers as the oracle. Nothing here downloads: hub names
resolve from a temporary Hugging Face cache, offline."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil

import pytest
import torch
from torch.nn import functional as F

import data.tokenizer
import sample
import train
from data.common import read_meta
from errors import CheckpointError, DataError
from helpers import one_torch_thread, tiny_args, tree_digest
from model import GPT, GPTConfig
from weights import hf as interop
from weights.__main__ import main as weights_main
from weights.hf import from_pretrained
from weights.load import load_checkpoint
from weights.lora import load_model_weights

transformers = pytest.importorskip("transformers")  # slow to import: once, here

# odd sizes, so that a transposed or misplaced tensor cannot pass: 3 heads of 16, 97 ids, 40 positions
HF_SIZES = dict(n_layer=2, n_head=3, n_embd=48, n_positions=40, vocab_size=97, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def hf_model():
    """A random HF GPT-2 with non-zero biases and LayerNorm parameters (HF initialises them to 0 and 1)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_SIZES))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(hf_model, tmp_path_factory):
    """{"safetensors": save_pretrained's folder, "bin": the same weights as pytorch_model.bin, with the causal
    mask buffers older GPT-2 code saved}."""
    root = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(root / "safetensors")
    (root / "bin").mkdir()
    shutil.copy(root / "safetensors" / "config.json", root / "bin")
    weights = hf_model.state_dict()
    weights["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 40, 40, dtype=torch.bool))
    weights["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(weights, root / "bin" / "pytorch_model.bin")
    return {"safetensors": root / "safetensors", "bin": root / "bin"}


def tokens(seed: int = 1, vocab: int = 97, T: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def all_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    logits, _ = model(idx, idx)  # with targets: every position's logits
    return logits


@pytest.mark.parametrize("form, backend", [("safetensors", "manual"), ("safetensors", "sdpa"), ("bin", "sdpa")])
def test_hf_weights_give_hf_logits_and_gradients(hf_model, hf_dirs, form, backend):
    model = from_pretrained(hf_dirs[form], attention_backend=backend)
    assert model.config.vocab_size == 97 and model.config.bias and model.config.block_size == 40
    model.setup_attention("cpu", torch.float32, training=True)
    x = tokens()
    ours = all_logits(model, x)
    hf_model.zero_grad()
    expected = hf_model(x, labels=x)
    torch.testing.assert_close(ours, expected.logits, atol=1e-5, rtol=0)
    F.cross_entropy(ours[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1)).backward()  # HF shifts the labels
    expected.loss.backward()
    h0 = hf_model.transformer.h[0]
    torch.testing.assert_close(model.lm_head.weight.grad, hf_model.transformer.wte.weight.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(
        model.transformer.h[0].attn.c_attn.weight.grad, h0.attn.c_attn.weight.grad.t(), atol=1e-4, rtol=0
    )


def test_hf_weights_load_without_the_tokenizer_files(hf_model, hf_dirs, monkeypatch):
    """A Hugging Face folder carries no tokenizer we read: its meta is GPT-2's, and needs no files to say so."""

    def no_files():
        raise DataError("GPT-2 tokenizer files not found")

    monkeypatch.setattr(data.tokenizer, "gpt2_files_dir", no_files)
    monkeypatch.setattr(data.tokenizer, "gpt2_encoding", no_files)
    model = from_pretrained(hf_dirs["safetensors"])
    assert model.config.vocab_size == HF_SIZES["vocab_size"]


@pytest.mark.gpu
@pytest.mark.usefixtures("allow_flex_recompiles")  # earlier tests may have used up dynamo's recompiles
def test_hf_logits_under_flex_attention(hf_model, hf_dirs):
    """flex_attention runs forward-only on CPU too, but a CPU compile costs tens of seconds: tested on CUDA."""
    model = from_pretrained(hf_dirs["safetensors"], attention_backend="flex_attention").cuda().eval()
    x = tokens()
    with torch.no_grad():
        expected = hf_model.cuda()(x.cuda()).logits
        assert model.setup_attention("cuda", torch.float32, training=False).used == "flex_attention"
        torch.testing.assert_close(all_logits(model, x.cuda()), expected, atol=1e-5, rtol=0)
    hf_model.cpu()


def test_export_round_trip_gives_hf_logits(hf_model, hf_dirs, tmp_path):
    model = from_pretrained(hf_dirs["safetensors"])
    interop.export_hf(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = tokens(2)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, hf_model(x).logits, atol=1e-5, rtol=0)


def char_checkpoint(tmp_path, **config) -> tuple[GPT, dict]:
    """A random model of ours (bias=False, as train.py's default) saved as a checkpoint with a char meta."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(**{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 29, **config}))
    meta = {"tokenizer": "char", "vocab_size": 29, "itos": [chr(ord("a") + i) for i in range(26)] + list(" .\n")}
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "meta": meta}
    torch.save(state, tmp_path / "ckpt.pt")
    return model.eval(), meta


def test_export_cli_writes_bias_free_models_exactly(tmp_path, capsys):
    model, meta = char_checkpoint(tmp_path, bias=False)
    assert weights_main(["hf", str(tmp_path), str(tmp_path / "hf")]) == 0  # an out_dir: its ckpt.pt
    hf_dir = tmp_path / "hf"
    assert capsys.readouterr().out == f"wrote {hf_dir / 'config.json'} and {hf_dir / 'model.safetensors'}\n"
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["n_positions"], config["bos_token_id"]) == (29, 16, None)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = tokens(4, vocab=29, T=16)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, all_logits(model, x), atol=1e-5, rtol=0)
    state, _ = interop.load_weights(tmp_path / "hf")  # the tokenizer travels in the safetensors metadata
    assert state["meta"] == meta and state["model_config"]["bias"] is True
    capsys.readouterr()
    argv = [f"--init_from={tmp_path / 'hf'}", "--start=ab", "--num_samples=1", "--max_new_tokens=3", "--device=cpu"]
    assert sample.main([*argv, "--temperature=0"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_export_refuses_what_gpt2_cannot_express(tmp_path, monkeypatch, capsys):
    char_checkpoint(tmp_path)
    before = tree_digest(tmp_path)
    assert weights_main(["hf", str(tmp_path), str(tmp_path / "ckpt.pt")]) == 2  # a file, not a folder
    assert capsys.readouterr().err == f"error: --out_dir {tmp_path / 'ckpt.pt'} is a file, not a folder\n"
    assert tree_digest(tmp_path) == before
    # a field outside what config.json expresses that differs from GPT-2's default (stands in for any switch)
    monkeypatch.setattr(interop, "EXPRESSIBLE", tuple(f for f in interop.EXPRESSIBLE if f != "n_layer"))
    with pytest.raises(CheckpointError, match=r"^this model cannot be exported .* no n_layer=1;"):
        interop.export_hf(tmp_path / "ckpt.pt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "setting, allowed",
    [("layer_norm_epsilon", 1e-6), ("activation_function", "relu"), ("n_inner", 100), ("model_type", "llama")],
)
def test_hf_config_gpt2_cannot_reproduce_is_one_line(hf_dirs, tmp_path, setting, allowed):
    config = json.loads((hf_dirs["safetensors"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, setting: allowed}))
    with pytest.raises(CheckpointError, match=rf"{setting}.*(not supported|only GPT-2)"):
        interop.load_hf(tmp_path)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, offline: nothing can download."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read when huggingface_hub was imported
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_hub_name_not_cached_offline_is_one_line(hf_cache, capsys):
    assert sample.main(["--init_from=gpt2-medium", "--device=cpu"]) == 2
    assert capsys.readouterr().err == (
        "error: gpt2-medium is not in the local Hugging Face cache and the hub cannot be reached; download it with "
        "`hf download gpt2-medium config.json model.safetensors` or pass a local directory\n"
    )


def test_hub_name_resolves_from_the_cache(hf_cache, hf_model, hf_dirs):
    commit = "0123456789abcdef0123456789abcdef01234567"
    (hf_cache / "models--gpt2" / "refs").mkdir(parents=True)
    (hf_cache / "models--gpt2" / "refs" / "main").write_text(commit)
    shutil.copytree(hf_dirs["safetensors"], hf_cache / "models--gpt2" / "snapshots" / commit)
    model = from_pretrained("gpt2")
    x = tokens(5)
    with torch.no_grad():
        torch.testing.assert_close(all_logits(model.eval(), x), hf_model(x).logits, atol=1e-5, rtol=0)


def test_bad_init_from_lists_what_is_allowed(capsys):
    assert sample.main(["--init_from=gpt3", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: init_from='gpt3': allowed are a .pt checkpoint") and err.count("\n") == 1
    assert "gpt2, gpt2-medium, gpt2-large, gpt2-xl" in err


def test_nanogpt_checkpoint_loads(tmp_path):
    """nanoGPT's layout: model_args, a state dict with torch.compile's _orig_mod. prefix and the causal-mask
    buffers, the dataset's meta.pkl (here beside it) for a char vocabulary."""
    model, meta = char_checkpoint(tmp_path, bias=True)
    weights = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    weights["_orig_mod.transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    args = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")}
    nanogpt = {"model": weights, "model_args": {**args, "dropout": 0.0}, "iter_num": 5, "config": {"dataset": "x"}}
    torch.save(nanogpt, tmp_path / "nano.pt")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 29, "itos": dict(enumerate(meta["itos"])), "stoi": {}}, f)
    state = load_checkpoint(tmp_path / "nano.pt")
    assert state["meta"]["itos"] == meta["itos"]
    loaded = interop.model_from_checkpoint(state, tmp_path / "nano.pt").eval()
    x = tokens(6, vocab=29, T=16)
    with torch.no_grad():
        torch.testing.assert_close(all_logits(loaded, x), all_logits(model, x), atol=0, rtol=0)


def nanogpt_char_folder(char_data, folder):
    """char_data as nanoGPT's prepare.py leaves it: the bins and meta.pkl, no meta.json."""
    folder.mkdir()
    for name in ("train.bin", "val.bin"):
        shutil.copy(char_data / name, folder)
    itos = read_meta(char_data)["itos"]
    stoi = {c: i for i, c in enumerate(itos)}
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(itos), "itos": dict(enumerate(itos)), "stoi": stoi}, f)
    return itos


def test_fine_tune_from_an_hf_folder_on_a_meta_pkl_dataset(char_data, tmp_path):
    """train.py --init_from=<HF folder>: the model takes the weights' shape (here bias=True against the tiny
    config's False); the data folder has nanoGPT's meta.pkl instead of meta.json."""
    itos = nanogpt_char_folder(char_data, tmp_path / "data")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=len(itos), bias=True))
    meta = {"tokenizer": "char", "vocab_size": len(itos), "itos": itos}
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "meta": meta}
    interop.export_hf(state, tmp_path / "hf")
    args = tiny_args(tmp_path / "data", tmp_path / "out", f"--init_from={tmp_path / 'hf'}", "--max_iters=2")
    with one_torch_thread(), contextlib.redirect_stdout(io.StringIO()):
        assert train.main([*args, "--eval_interval=2", "--eval_iters=1"]) == 0
    saved = load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert saved["model_config"]["bias"] is True and saved["model_config"]["block_size"] == 16
    assert not torch.equal(saved["model"]["transformer.wpe.weight"], model.state_dict()["transformer.wpe.weight"][:16])


def test_meta_pkl_that_loads_a_class_is_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("still here")

    class Remove:
        def __reduce__(self):
            return os.remove, (str(victim),)

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 2, "itos": Remove()}))
    with pytest.raises(DataError, match=r"meta.pkl refused: only plain dicts, lists, strings and numbers .*os"):
        read_meta(tmp_path)
    assert victim.read_text() == "still here"


# ---- GPT.from_pretrained: nanoGPT's loader, in model.py alone -------------------------------------


@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_gpt_from_pretrained_reads_a_hf_folder_with_hf_logits(hf_model, hf_dirs, form):
    model = GPT.from_pretrained(str(hf_dirs[form]))
    assert model.config.dropout == 0.0 and model.config.tie_embeddings
    x = tokens(7)
    with torch.no_grad():
        torch.testing.assert_close(all_logits(model.eval(), x), hf_model(x).logits, atol=1e-5, rtol=0)


def test_gpt_from_pretrained_takes_override_args(hf_dirs):
    model = GPT.from_pretrained(str(hf_dirs["safetensors"]), dict(dropout=0.1, block_size=20))
    assert model.config.dropout == 0.1 and model.config.block_size == 20
    assert model.transformer.wpe.weight.shape == (20, HF_SIZES["n_embd"])


def test_gpt_from_pretrained_reads_a_hub_name_from_the_cache(hf_cache, hf_model, hf_dirs):
    commit = "0123456789abcdef0123456789abcdef01234567"
    (hf_cache / "models--gpt2" / "refs").mkdir(parents=True)
    (hf_cache / "models--gpt2" / "refs" / "main").write_text(commit)
    shutil.copytree(hf_dirs["safetensors"], hf_cache / "models--gpt2" / "snapshots" / commit)
    x = tokens(8)
    with torch.no_grad():
        torch.testing.assert_close(
            all_logits(GPT.from_pretrained("gpt2").eval(), x), hf_model(x).logits, atol=1e-5, rtol=0
        )
    with pytest.raises(ValueError, match=r"^gpt2-xl is not in the local Hugging Face cache"):
        GPT.from_pretrained("gpt2-xl")


def test_gpt_from_pretrained_reads_our_checkpoint_and_out_dir(tmp_path):
    model, _ = char_checkpoint(tmp_path, bias=True)
    x = tokens(9, vocab=29, T=16)
    for source in (tmp_path / "ckpt.pt", tmp_path):
        loaded = GPT.from_pretrained(str(source)).eval()
        with torch.no_grad():
            torch.testing.assert_close(all_logits(loaded, x), all_logits(model, x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="is not a checkpoint file, an out_dir with ckpt.pt, a Hugging Face"):
        GPT.from_pretrained(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def untied_hf(tmp_path_factory):
    """A HF GPT-2 with tie_word_embeddings=false: its lm_head has weights of its own."""
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_SIZES, tie_word_embeddings=False))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.05 * torch.randn_like(param))
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    folder = tmp_path_factory.mktemp("untied")
    hf.save_pretrained(folder)
    return hf.eval(), folder


def test_an_untied_hf_folder_loads_untied_with_hf_logits(untied_hf, tmp_path):
    hf, folder = untied_hf
    x = tokens(10)
    with torch.no_grad():
        expected = hf(x).logits
        for model in (GPT.from_pretrained(str(folder)), from_pretrained(folder)):
            assert not model.config.tie_embeddings
            assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
            torch.testing.assert_close(all_logits(model.eval(), x), expected, atol=1e-5, rtol=0)
        # and back out: the export keeps its own lm_head
        interop.export_hf(model, tmp_path / "out")
        again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(again(x).logits, expected, atol=1e-5, rtol=0)


HUGE = dict(n_layer=10000, n_embd=65536, n_head=64)  # 5e14 parameters: petabytes


def test_a_config_larger_than_memory_is_refused_before_anything_is_allocated(hf_dirs, tmp_path, capsys):
    config = json.loads((hf_dirs["safetensors"] / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **HUGE}))
    shutil.copy(hf_dirs["safetensors"] / "model.safetensors", tmp_path / "hf")
    with pytest.raises(ValueError, match=r"^the model asks for [\d,]+ parameters .* of RAM \(n_layer=10000"):
        GPT.from_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"asks for [\d,]+ parameters"):
        interop.load_hf(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not read")  # refused before its weights are read
    with pytest.raises(ValueError, match=r"^the model asks for [\d,]+ parameters"):
        GPT.from_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"asks for [\d,]+ parameters"):
        interop.load_hf(tmp_path / "hf")
    # a checkpoint of ours whose model_config asks for it: sample.py's loader and the export refuse it in one line
    char_checkpoint(tmp_path)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    state["model_config"].update(HUGE)
    torch.save(state, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match=r"asks for [\d,]+ parameters"):
        interop.model_from_checkpoint(state, tmp_path / "ckpt.pt")
    assert weights_main(["hf", str(tmp_path / "ckpt.pt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "parameters" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_untied_checkpoint_is_refused_by_a_model_that_ties(untied_hf, tmp_path):
    """Both models hold lm_head.weight: loading into a tied one would silently make wte the output layer."""
    _, folder = untied_hf
    state = interop.load_hf(folder)
    tied = GPT(GPTConfig(**{**state["model_config"], "tie_embeddings": True}))
    with pytest.raises(CheckpointError, match="untied from wte"):
        load_model_weights(tied, state, folder)
