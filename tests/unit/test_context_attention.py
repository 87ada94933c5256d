"""A context-parallel chunk's attention (training/context.py) without a process group: the prefix and diagonal
parts merged by their log-sum-exps, forward and backward, against `manual` with an explicit lower-right mask; the
kernel resolver. test_context.py in tests/e2e checks the whole split over two ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import tiny_config
from model import GPT, manual_attention
from training.context import ContextShard, attend_chunk, resolve_chunk_kernel, use_context_parallel_attention
from training.runtime import Runtime


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def chunk_inputs(length: int, keys: int, dtype: torch.dtype, heads: int = 3, head_dim: int = 16):
    """q laid out as the model makes it (a (B, T, H, D) view turned to (B, H, T, D)); k, v as attend slices them
    from the gathered sequence."""
    torch.manual_seed(keys)
    q = torch.randn(2, length, heads, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, heads, 2 * keys, head_dim, dtype=dtype)[:, :, :keys].requires_grad_() for _ in "kv")
    return q, k, v


def lower_right_manual(q, k, v):
    """model.manual_attention with the causal mask aligned to the lower right: query i sees keys up to S-L+i."""
    visible = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril(k.size(2) - q.size(2))
    return manual_attention(q, k, v, SimpleNamespace(dense=lambda: visible))


@pytest.mark.parametrize("kernel", ["cpu_flash", "sdpa_lower_right"])
@pytest.mark.parametrize("keys", [8, 24], ids=["chunk 0 (no prefix)", "chunk 2"])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_a_chunk_attends_as_manual_with_a_lower_right_mask(kernel, keys, dtype, rtol):
    """A chunk of 8 queries on the 8 keys of chunk 0 or the 24 keys up to the end of chunk 2: output and q, k, v
    gradients within rtol of manual attention."""
    q, k, v = chunk_inputs(8, keys, dtype)
    grad = torch.randn(2, 3, 8, 16, dtype=dtype)
    got = attend_chunk(q, k, v, kernel)
    expected = lower_right_manual(q, k, v)
    assert relative(got, expected) < rtol
    for got_grad, expected_grad in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)
    ):
        assert relative(got_grad, expected_grad) < rtol


@pytest.mark.parametrize("keys", [3, 9], ids=["no prefix", "prefix"])
def test_the_merged_parts_pass_gradcheck(keys):
    q, k, v = chunk_inputs(3, keys, torch.float64, heads=2, head_dim=4)
    assert torch.autograd.gradcheck(lambda q, k, v: attend_chunk(q, k, v, "cpu_flash"), (q, k, v), fast_mode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("keys", [128, 384], ids=["chunk 0 (no prefix)", "chunk 2"])
def test_the_cuda_kernels_attend_as_manual_in_float64(kernel, keys):
    """bf16 inputs through cuDNN or SDPA's flash, against manual attention of the same inputs in float64:
    output and gradients within 1e-2 (bf16 operands)."""
    q, k, v = (t.detach().cuda().requires_grad_() for t in chunk_inputs(128, keys, torch.bfloat16, head_dim=64))
    grad = torch.randn(2, 3, 128, 64, device="cuda", dtype=torch.bfloat16)
    got = attend_chunk(q, k, v, kernel)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = lower_right_manual(*wide)
    assert relative(got.double(), expected) < 1e-2
    for got_grad, expected_grad in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, wide, grad.double())
    ):
        assert relative(got_grad.double(), expected_grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_chunks_attend_as_manual_at_training_sizes(kernel, rank):
    """The op a rank runs in training, at the T=8192 check's sizes (2 ranks, chunks of 2048 queries, prefixes up
    to 6144 keys, GPT-2's 12 heads of 64): rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. bf16 through cuDNN
    or SDPA's flash against manual attention in float64 of the same inputs, forward and backward, twice on fresh
    inputs (the second call runs the kernels' cached plans), within 1e-2."""
    from training.context import chunk_attention

    length, heads, chunks = 2048, 12, [rank, 3 - rank]
    for trial in range(2):
        torch.manual_seed(100 * rank + trial)
        q = torch.randn(1, 2 * length, heads, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, heads, 4 * length, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        grad = torch.randn(1, heads, 2 * length, 64, device="cuda", dtype=torch.bfloat16)
        inputs = [t.requires_grad_() for t in (q, k, v)]
        got = chunk_attention(*inputs, chunks, kernel)[0]
        got_grads = torch.autograd.grad(got, inputs, grad)
        wide = [t.detach().double().requires_grad_() for t in inputs]
        rows = [slice(i * length, (i + 1) * length) for i in range(2)]
        expected = torch.cat(
            [
                lower_right_manual(wide[0][:, :, r], *(t[:, :, : (c + 1) * length] for t in wide[1:]))
                for r, c in zip(rows, chunks)
            ],
            dim=2,
        )
        expected_grads = torch.autograd.grad(expected, wide, grad.double())
        errors = {
            name: relative(a.double(), b)
            for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (expected, *expected_grads))
        }
        assert max(errors.values()) < 1e-2, (trial, errors)  # every error, to tell rounding from a wrong kernel


def test_cudnn_backward_gets_its_random_state_placeholders_on_the_inputs_device(monkeypatch):
    """cuDNN's backward checks that every tensor, the unread dropout seed and offset too, is on the inputs'
    device (CPU placeholders failed every context-parallel backward on a GPU). Meta tensors stand in for CUDA."""
    from training import context

    seen = {}

    def record(*args):
        seen["devices"] = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        return args[1:4]

    monkeypatch.setattr(context, "aten", SimpleNamespace(_scaled_dot_product_cudnn_attention_backward=record))
    q, k, v = (torch.empty(1, 2, 4, 8, device="meta") for _ in "qkv")
    context.cudnn_backward(q, q, k, v, q, torch.empty(1, 2, 4, device="meta"), True)
    assert seen["devices"] == {"meta"}


def what_context_parallelism_says(sdpa_kernel: str, device: str, dtype: torch.dtype) -> tuple[list, list]:
    """(INFO lines, WARNING lines) of use_context_parallel_attention for a tiny model with this sdpa_kernel, on 2
    ranks of `device` (only its type is read: a CUDA runtime needs no GPU here)."""
    model = GPT(tiny_config(sdpa_kernel=sdpa_kernel))
    model.setup_attention(torch.device("cpu"), torch.float32, training=True, seq_len=32)
    runtime = Runtime(torch.device(device), dtype, world_size=2, context_parallel=2)
    info, warnings = [], []
    use_context_parallel_attention(model, runtime, "auto", SimpleNamespace(info=info.append, warning=warnings.append))
    return info, warnings


@pytest.mark.parametrize(
    "sdpa_kernel, device, dtype, used",
    [
        ("auto", "cpu", torch.float32, "cpu_flash"),
        ("flash", "cpu", torch.float32, "cpu_flash"),
        ("math", "cpu", torch.float32, "sdpa_lower_right"),
        ("cudnn", "cpu", torch.float32, "sdpa_lower_right"),  # cuDNN runs on CUDA only
        ("auto", "cuda", torch.bfloat16, "cudnn"),
        ("flash", "cuda", torch.bfloat16, "flash"),
        ("math", "cuda", torch.bfloat16, "sdpa_lower_right"),
    ],
)
def test_a_pinned_sdpa_kernel_picks_the_chunks_kernel(sdpa_kernel, device, dtype, used):
    """Under context parallelism sdpa_kernel pins the chunks' kernel, and the INFO line names the one that runs.
    No kernel is warned about: on 2 GPUs each step's loss matched one GPU's with cuDNN, flash and math
    (h200-context-check-sdpa_kernel-*-91d2a29.json)."""
    info, warnings = what_context_parallelism_says(sdpa_kernel, device, dtype)
    assert warnings == [] and len(info) == 1 and f", {used} per chunk (in place of sdpa)" in info[0], info


@pytest.mark.parametrize(
    "requested, device, dtype, head_dim, dropout, used",
    [
        ("auto", "cpu", torch.float64, 8, 0.0, "cpu_flash"),
        ("auto", "cpu", torch.bfloat16, 64, 0.1, "sdpa_lower_right"),  # none of the LSE kernels has dropout
        ("auto", "cuda", torch.bfloat16, 64, 0.0, "cudnn"),
        ("auto", "cuda", torch.float32, 64, 0.0, "sdpa_lower_right"),  # cuDNN and flash take half precision only
        ("auto", "cuda", torch.bfloat16, 256, 0.0, "sdpa_lower_right"),  # cuDNN: head dim <= 128
        ("flash", "cuda", torch.float16, 256, 0.0, "flash"),
        ("flash", "cuda", torch.float16, 60, 0.0, "sdpa_lower_right"),  # flash: a multiple of 8
        ("flash", "cpu", torch.float16, 64, 0.0, "sdpa_lower_right"),
        ("auto", "mps", torch.float32, 64, 0.0, "sdpa_lower_right"),
        ("sdpa_lower_right", "cuda", torch.bfloat16, 64, 0.0, "sdpa_lower_right"),
    ],
)
def test_the_resolver_falls_back_to_sdpa_where_a_kernel_cannot_serve(requested, device, dtype, head_dim, dropout, used):
    assert resolve_chunk_kernel(requested, device, dtype, head_dim, dropout) == used


def test_an_unknown_kernel_is_refused_when_the_shard_is_made():
    with pytest.raises(ValueError, match="cpu_flash"):
        ContextShard(None, 0, 2, kernel="flash_attn_3")


def traced_step(rank: int) -> list[tuple[str, tuple]]:
    """Every op of forward and backward through rank `rank`'s attention in a group of 2 (the keys gathered by a
    stand-in), with its output's shape, as torch.compile's tracer records them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    shard = ContextShard(None, rank, 2, kernel="cpu_flash")
    shard.gather = lambda tensor: tensor.repeat(1, 1, 2, 1)  # (B, H, 2L, D) -> the group's (B, H, 4L, D)

    def step(q, k, v, grad):
        return torch.autograd.grad(shard.attend(q, k, v, None), (q, k, v), grad)

    q, k, v, grad = (torch.randn(1, 2, 16, 8, requires_grad=name != "grad") for name in ("q", "k", "v", "grad"))
    ops = [n for n in make_fx(step, tracing_mode="fake")(q, k, v, grad).graph.nodes if n.op == "call_function"]
    return [(str(n.target), tuple(getattr(n.meta.get("val"), "shape", ()))) for n in ops]


def test_every_rank_traces_the_same_graph():
    """The ranks' chunks see different numbers of keys; were that in the graph, torch.compile could order or
    recompute the collectives differently per rank, and the ranks would wait on each other forever."""
    assert traced_step(0) == traced_step(1)
