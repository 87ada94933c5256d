"""Packed documents: document ids from the separator token (data/loader.py), positions that restart at each
document (model.document_positions), a packed row that scores each document as if it ran alone, and train.py's
packed_documents switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import train
from data.common import write_dataset
from data.loader import document_ids
from helpers import tiny_args, tiny_config
from model import GPT, document_positions

pytestmark = pytest.mark.usefixtures("one_thread")

SEP = 63  # the tiny vocabulary's last id ends each document


def test_document_ids_and_positions_restart_after_each_separator():
    x = torch.tensor([[5, 9, SEP, 4, SEP, SEP, 7], [SEP, 1, 2, 3, 4, 5, 6]])
    ids = document_ids(x, SEP)
    # the separator belongs to the document it ends; a second separator in a row is a document of its own
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    no_separator = torch.arange(7).expand(2, 7)
    assert document_ids(no_separator, SEP).eq(0).all()
    assert torch.equal(document_positions(document_ids(no_separator, SEP)), no_separator)


def pack(documents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    row = torch.cat(documents)
    return row[None], document_ids(row[None], SEP)


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_a_packed_row_scores_each_document_as_if_it_ran_alone(backend):
    """Per-token losses of a row of 3 documents equal those of each document run alone (float64), and so do
    the weight gradients of their sum. Targets are the next token, across document ends too (GPT-2's
    practice): the separator predicts the next document's first token from its own document only."""
    torch.manual_seed(0)
    model = GPT(tiny_config(attention_backend=backend, vocab_size=64, cross_entropy="plain")).double()
    model.setup_attention("cpu", torch.float64, documents=True)
    lengths = (5, 9, 4)  # 18 tokens, plus the first token of a 4th document as the last target
    tokens = torch.randint(SEP, (sum(lengths) + 1,))
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[ends] = SEP
    documents = list(tokens[:-1].split(lengths))
    targets = tokens[1:]

    x, doc_ids = pack(documents)
    logits, _ = model(x, targets[None], doc_ids)
    packed = F.cross_entropy(logits[0], targets, reduction="none")
    grads_packed = torch.autograd.grad(packed.sum(), list(model.parameters()))

    alone, start = [], 0
    for document in documents:
        logits, _ = model(document[None], targets[start : start + len(document)][None])
        alone.append(F.cross_entropy(logits[0], targets[start : start + len(document)], reduction="none"))
        start += len(document)
    alone = torch.cat(alone)
    grads_alone = torch.autograd.grad(alone.sum(), list(model.parameters()))
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)
    for packed_grad, alone_grad in zip(grads_packed, grads_alone):
        torch.testing.assert_close(packed_grad, alone_grad, rtol=1e-10, atol=1e-12)
    # without doc_ids the later documents see the earlier ones: the check above can tell the difference
    logits, _ = model(x, targets[None])
    assert not torch.allclose(F.cross_entropy(logits[0], targets, reduction="none"), alone)


def test_doc_ids_need_a_model_set_up_for_documents():
    """The documents mask is resolved with the backend: a model set up without documents refuses doc_ids rather
    than run a kernel chosen for plain causal attention; one never set up resolves at its first forward for
    what that forward is given."""
    x = torch.randint(SEP, (1, 8), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 3 + [1] * 5])
    gpt = GPT(tiny_config())
    gpt.setup_attention("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"setup_attention\(\.\.\., documents=True\)"):
        gpt(x, x, doc_ids)
    gpt.setup_attention("cpu", torch.float32, documents=True)
    _, loss = gpt(x, x, doc_ids)
    assert torch.isfinite(loss)
    fresh = GPT(tiny_config())
    fresh(x, x, doc_ids)
    assert fresh.attention.use.documents
    unpacked = GPT(tiny_config())
    unpacked(x, x)
    assert not unpacked.attention.use.documents


@pytest.fixture(scope="module")
def documents_data(tmp_path_factory):
    """A tiny dataset of short documents, each ended by SEP, whose meta.json names SEP as eot_token."""
    rng = np.random.default_rng(0)
    ids = []
    for _ in range(300):
        ids += [*rng.integers(0, SEP, rng.integers(3, 12)), SEP]
    ids = np.asarray(ids)
    itos = [chr(ord("0") + i) for i in range(64)]
    meta = {"tokenizer": "char", "vocab_size": 64, "itos": itos, "eot_token": SEP}
    out = tmp_path_factory.mktemp("documents")
    write_dataset(out, ids[: len(ids) * 9 // 10], ids[len(ids) * 9 // 10 :], meta)
    return out


def test_train_with_packed_documents_passes_document_ids(monkeypatch, documents_data, tmp_path, capsys):
    seen = []
    forward = GPT.forward

    def spy(self, idx, targets=None, doc_ids=None):
        seen.append(doc_ids)
        return forward(self, idx, targets, doc_ids)

    monkeypatch.setattr(GPT, "forward", spy)
    args = tiny_args(documents_data, tmp_path / "out", "--max_iters=2", "--eval_interval=2", "--packed_documents=true")
    assert train.main(args) == 0, capsys.readouterr().err
    assert seen and all(doc_ids is not None for doc_ids in seen)  # training and evaluation
    x_ids = seen[-1]
    assert x_ids.shape == (4, 16) and x_ids.dtype == torch.int32 and x_ids.max() > 0
    assert (tmp_path / "out" / "ckpt.pt").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--packed_documents=true"], "names no eot_token"),
        (["--packed_documents=true", "--document_separator=99"], "must be a token id in [0, "),
        (["--document_separator=5"], "needs packed_documents=True"),
    ],
)
def test_packing_without_a_usable_separator_is_one_line(char_data, tmp_path, capsys, extra, message):
    assert train.main(tiny_args(char_data, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()
