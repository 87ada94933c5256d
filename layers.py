"""
The pieces of a transformer block that GPTConfig can switch (model.py builds the block from them): the norm
(GPT-2's LayerNorm or RMSNorm), the MLP (GPT-2's GELU MLP or SwiGLU), rotary position embedding (RoPE), and
the positions of packed documents.
GPT-2's parameter names are kept wherever a piece has the same role (c_fc, c_proj, weight, bias).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
NORM_EPS = 1e-5  # GPT-2's LayerNorm eps, and Llama's RMSNorm eps


def check_block(config) -> None:
    """ValueError, one line naming what is allowed, for a bad switch of GPTConfig's modern block."""
    if config.norm not in NORMS:
        raise ValueError(f"unknown norm {config.norm!r}; choose one of {', '.join(NORMS)}")
    if config.mlp not in MLPS:
        raise ValueError(f"unknown mlp {config.mlp!r}; choose one of {', '.join(MLPS)}")
    if config.mlp_hidden is not None and not positive_int(config.mlp_hidden):
        raise ValueError(f"mlp_hidden must be a positive integer or None (its default); got {config.mlp_hidden}")
    n_kv_head, n_head = config.n_kv_head, config.n_head
    if n_kv_head is not None and not (positive_int(n_kv_head) and n_head % n_kv_head == 0):
        raise ValueError(
            f"n_kv_head must be a positive integer that divides n_head ({n_head}), or None (= n_head); got {n_kv_head}"
        )
    theta = config.rope_theta
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta must be a finite number > 0, got {theta!r}")


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, NORM_EPS)


def make_norm(kind: str, ndim: int, bias: bool) -> nn.Module:
    """GPT-2's LayerNorm, or RMSNorm (no mean subtraction and no bias, whatever `bias` says, as in Llama)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(ndim, eps=NORM_EPS)
    return LayerNorm(ndim, bias)


def mlp_hidden_size(kind: str, n_embd: int) -> int:
    """GPT-2's 4·n_embd; for SwiGLU 8/3·n_embd (as many weights as 4·n_embd in two matrices), rounded up to a
    multiple of 64 for the matmuls."""
    if kind == "swiglu":
        return -(-8 * n_embd // (3 * 64)) * 64
    return 4 * n_embd


class MLP(nn.Module):
    """GPT-2's MLP: c_fc, tanh GELU, c_proj."""

    def __init__(self, n_embd: int, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """SwiGLU (Shazeer 2020; Llama's MLP): c_proj(silu(c_gate(x)) * c_fc(x)). The gate is its own Linear, not a
    half of a c_fc twice as wide: each matrix maps one to one to Llama's gate_proj, up_proj, down_proj, and
    LoRA or a sharded layer can take each whole."""

    def __init__(self, n_embd: int, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.c_gate = nn.Linear(n_embd, hidden, bias=bias)
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


def make_mlp(kind: str, n_embd: int, hidden: int, bias: bool, dropout: float) -> nn.Module:
    return (SwiGLU if kind == "swiglu" else MLP)(n_embd, hidden, bias, dropout)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) in the half-split layout of GPT-NeoX and Hugging Face's
    Llama: dimension i of a head turns with i + head_dim/2 by the angle pos · theta^(-2i/head_dim).

    cos and sin are tabled once for every position below block_size, as non-persistent buffers (checkpoints
    never hold them); `forward(pos)` looks up any positions: (T,) shared by the batch, or (B, T), one row each
    (positions that restart per document, or each sequence's own positions in a KV cache)."""

    def __init__(self, head_dim: int, block_size: int, theta: float):
        super().__init__()
        inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hs/2,)
        angles = torch.arange(block_size, dtype=torch.float64)[:, None] * inv_freq  # (block_size, hs/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `pos`, shaped to broadcast over (B, nh, T, hs/2): (T, hs/2) or (B, 1, T, hs/2)."""
        cos, sin = self.cos[pos], self.sin[pos]
        if pos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (B, nh, T, hs) turned by the angles of rope = Rotary(pos); computed in the tables' precision, returned
    in x's dtype."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token within its document (runs of equal ids): packed documents each start at 0,
    as they would alone."""
    T = doc_ids.size(1)
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)  # (B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values  # minus where its document starts
