"""Packed documents under torch.compile on CUDA, as train.py runs them: every backend that takes document masks
trains a few steps compiled and evaluates under no_grad (a graph of its own), against manual's loss. flex_attention
crashed here once (an inductor stride for a broadcast head dim of its in-graph BlockMask, kernels/flex.py)."""

import pytest
import torch

import kernels  # noqa: F401  (registers flash-attn 3/4 and flex_attention)
from model import BACKENDS, GPT, GPTConfig

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda") if torch.cuda.is_available() else None
DOCUMENT_BACKENDS = ("flex_attention", "sdpa", "manual", "flash_attn_2", "flash_attn_3", "flash_attn_4")


def packed_batch(batch: int, T: int, vocab: int, generator: torch.Generator):
    idx = torch.randint(0, vocab, (batch, T + 1), generator=generator)
    lengths = torch.randint(20, 200, (batch, T), generator=generator)
    doc_ids = torch.zeros(batch, T, dtype=torch.long)
    for row in range(batch):
        position, doc = 0, 0
        while position < T:
            doc_ids[row, position : position + int(lengths[row, doc])] = doc
            position, doc = position + int(lengths[row, doc]), doc + 1
    return idx[:, :-1].to(CUDA), idx[:, 1:].to(CUDA), doc_ids.to(CUDA)


def eval_loss(backend: str, steps: int, heads: int = 4) -> float:
    torch.manual_seed(0)
    config = GPTConfig(block_size=512, vocab_size=256, n_layer=2, n_head=heads, n_embd=128, attention_backend=backend)
    model = GPT(config).to(CUDA)
    model.setup_attention(CUDA, torch.bfloat16, documents=True)
    compiled = torch.compile(model)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y, doc_ids = packed_batch(8, 512, 256, generator)
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = compiled(x, y, doc_ids=doc_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    x, y, doc_ids = packed_batch(8, 512, 256, torch.Generator().manual_seed(2))
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        _, loss = compiled(x, y, doc_ids=doc_ids)
    torch.cuda.synchronize()
    return loss.item()


@pytest.mark.skipif(CUDA is None, reason="needs CUDA")
@pytest.mark.parametrize("backend", DOCUMENT_BACKENDS)
@pytest.mark.parametrize("heads", [4, 1])
def test_packed_documents_train_and_evaluate_under_compile(backend, heads):
    from model import AttentionUse

    problem = BACKENDS[backend].why_not(AttentionUse(CUDA, torch.bfloat16, head_dim=128 // heads, documents=True))
    if problem:
        pytest.skip(problem)
    loss, reference = eval_loss(backend, 5, heads), eval_loss("manual", 5, heads)
    assert abs(loss - reference) < 2e-2, (loss, reference)
