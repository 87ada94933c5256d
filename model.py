"""
A GPT-2 language model in one file, with a choice of attention kernels and switches for a modern block (RoPE,
RMSNorm, SwiGLU, grouped key/value heads, q/k norm; all off is GPT-2 exactly). Top-down: the config; the block's
parts; CausalSelfAttention, Block and GPT (nanoGPT's API); attention's kernels (manual, sdpa, flash_attn_2) and the
registry, whose `resolve` picks the backend that runs, falling back with a WARNING that says why; the loss last.
`from model import GPT` loads nothing else of this repo; kernels/ registers more kernels (`python -m kernels`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("model")

# ----------------------------------------------------------------------------------------------
# Config

# fmt: off
SDPA_KERNELS = {"auto": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
CHOICES = {  # the settings that name one of a few choices, and those choices
    "norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"), "sdpa_kernel": tuple(SDPA_KERNELS),
    "cross_entropy": ("auto", "plain", "chunked"),
    "activation_checkpointing": ("none", "mlp", "block"),  # mlp keeps attention's outputs: at long T, the costly part
}
# fmt: on
AUTO_CHUNKED_LOGITS = 2**31  # auto chunks the loss past this many logits a micro-batch (8 GiB in float32)


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them
    # The modern block: each switch off is GPT-2
    rope: bool = False  # rotary position embedding on q and k, in place of learned positions (no wpe)
    rope_theta: float = 10000.0  # RoPE's base: the slowest pair of dimensions turns once in ~2π·rope_theta tokens
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm (no bias)
    mlp: str = "gelu"  # gelu (GPT-2: c_fc, GELU, c_proj) | swiglu (c_gate, c_fc, c_proj)
    mlp_hidden: int | None = None  # MLP hidden width; None: 4·n_embd (gelu), 8/3·n_embd rounded up to 64s (swiglu)
    n_kv_head: int | None = None  # key/value heads, each shared by n_head/n_kv_head query heads; None: n_head
    qk_norm: bool = False  # normalize q and k per head (with `norm`) before RoPE and attention
    attention_backend: str = "auto"  # a name or alias in BACKENDS, or auto; see resolve
    sdpa_kernel: str = "auto"  # restrict the sdpa backend to one PyTorch kernel: auto|flash|cudnn|efficient|math
    auto_measure: bool = True  # auto on a GPU its table does not know times the candidates once (kernels/auto.py)
    cross_entropy: str = "auto"  # plain (full logits) | chunked (lm_head + loss by rows) | auto: chunked if big
    activation_checkpointing: str = "none"  # recompute in backward to save memory: none | mlp | block
    use_flash_attention: bool | None = None  # deprecated: True means attention_backend="flash_attn_2"
    disable_mps_fix: bool = False  # on MPS, let SDPA run with explicit masks (documents, KV cache), NaN risk
    tie_embeddings: bool = True  # the output layer is wte (GPT-2); False: lm_head has weights of its own

    def __post_init__(self):
        if self.use_flash_attention is not None:
            new = "flash_attn_2" if self.use_flash_attention else "manual"
            message = f"use_flash_attention is deprecated; use attention_backend={new!r}"
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            self.attention_backend, self.use_flash_attention = new, None
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if not positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"head dim n_embd/n_head = {self.head_dim} must be even")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if self.mlp_hidden is not None and not positive_int(self.mlp_hidden):
            raise ValueError(f"mlp_hidden must be a positive integer or None (its default); got {self.mlp_hidden}")
        if self.n_kv_head is not None and not (positive_int(self.n_kv_head) and self.n_head % self.n_kv_head == 0):
            divides = f"a positive integer that divides n_head ({self.n_head}), or None (= n_head)"
            raise ValueError(f"n_kv_head must be {divides}; got {self.n_kv_head}")
        theta = self.rope_theta
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {theta!r}")
        self.attention_backend = canonical_backend(self.attention_backend)

    @classmethod
    def from_dict(cls, saved: dict) -> GPTConfig:
        """The config a checkpoint saved; ValueError (one line) for settings this version does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in saved if k not in known)
        if unknown:
            raise ValueError(
                f"model_config has settings this version does not know ({', '.join(unknown)}); "
                f"it was probably saved by a newer version of this code"
            )
        try:
            return cls(**saved)
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid model_config ({error})") from None

    def chunks_loss(self, tokens: int) -> bool:
        """Whether the loss over `tokens` targets runs chunked (cross_entropy; auto: past AUTO_CHUNKED_LOGITS)."""
        chunked = self.cross_entropy == "chunked"
        return chunked or (self.cross_entropy == "auto" and tokens * self.vocab_size > AUTO_CHUNKED_LOGITS)

    def parameter_count(self) -> int:
        """The model's parameter count from the config alone, so that a size is checked before it is allocated."""
        width, bias, hidden = self.n_embd, int(self.bias), self.mlp_width

        def norm(n: int) -> int:  # LayerNorm: weight and bias; RMSNorm: weight only
            return n * (1 + bias) if self.norm == "layernorm" else n

        qkv = (self.n_head + 2 * self.kv_heads) * self.head_dim
        attention = (width + bias) * qkv + (width + bias) * width + (2 * norm(self.head_dim) if self.qk_norm else 0)
        mlp = (2 if self.mlp == "swiglu" else 1) * (width + bias) * hidden + (hidden + bias) * width
        positions = 0 if self.rope else self.block_size * width
        embeddings = self.vocab_size * width * (1 if self.tie_embeddings else 2)
        return embeddings + positions + self.n_layer * (attention + mlp + 2 * norm(width)) + norm(width)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or mlp_hidden_size(self.mlp, self.n_embd)


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ----------------------------------------------------------------------------------------------
# The block's switchable pieces: the norm, the MLP, rotary position embedding. GPT-2's parameter names are kept
# wherever a piece has the same role (c_fc, c_proj, weight, bias).

NORM_EPS = 1e-5  # GPT-2's LayerNorm eps, and Llama's RMSNorm eps


def make_norm(kind: str, ndim: int, bias: bool) -> nn.Module:
    """GPT-2's LayerNorm, or RMSNorm (no mean subtraction and no bias, whatever `bias` says, as in Llama)."""
    return nn.RMSNorm(ndim, eps=NORM_EPS) if kind == "rmsnorm" else nn.LayerNorm(ndim, eps=NORM_EPS, bias=bias)


def mlp_hidden_size(kind: str, n_embd: int) -> int:
    """GPT-2's 4·n_embd; SwiGLU's 8/3·n_embd (4·n_embd's weights in two matrices), rounded up to 64s for matmuls."""
    return -(-8 * n_embd // (3 * 64)) * 64 if kind == "swiglu" else 4 * n_embd


class MLP(nn.Module):
    """GPT-2's MLP: c_proj(tanh GELU(c_fc(x))); with kind="swiglu", SwiGLU (Shazeer 2020; Llama's MLP):
    c_proj(silu(c_gate(x)) * c_fc(x)). The gate is its own Linear, not a half of a c_fc twice as wide: each
    matrix maps one to one to Llama's gate_proj, up_proj, down_proj, and LoRA or a sharded layer can take each whole."""

    def __init__(self, kind: str, n_embd: int, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.c_gate = nn.Linear(n_embd, hidden, bias=bias) if kind == "swiglu" else None
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        h = self.gelu(self.c_fc(x)) if self.c_gate is None else F.silu(self.c_gate(x)) * self.c_fc(x)
        return self.dropout(self.c_proj(h))


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) in the half-split layout of GPT-NeoX and Hugging Face's
    Llama: dimension i of a head turns with i + head_dim/2 by the angle pos · theta^(-2i/head_dim). cos and sin
    are tabled once below block_size, as non-persistent buffers (checkpoints never hold them); forward(pos) looks
    up (T,) positions shared by the batch or (B, T), one row each (packed documents, a KV cache's sequences)."""

    def __init__(self, head_dim: int, block_size: int, theta: float):
        super().__init__()
        inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hs/2,)
        angles = torch.arange(block_size, dtype=torch.float64)[:, None] * inv_freq  # (block_size, hs/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `pos`, shaped to broadcast over (B, nh, T, hs/2): (T, hs/2) or (B, 1, T, hs/2)."""
        cos, sin = self.cos[pos], self.sin[pos]
        return (cos.unsqueeze(1), sin.unsqueeze(1)) if pos.dim() == 2 else (cos, sin)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (B, nh, T, hs) turned by the angles of rope = Rotary(pos), in the tables' precision; returned in x's dtype."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token in its document (a run of equal ids): each starts at 0, as it would alone."""
    index = torch.arange(doc_ids.size(1), device=doc_ids.device).expand_as(doc_ids)  # (B, T)
    return index - torch.where(run_starts(doc_ids), index, 0).cummax(dim=1).values  # minus where its document starts


def run_starts(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True where a run of equal ids (a document of a packed row) starts."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


# ----------------------------------------------------------------------------------------------
# The model: GPT-2 (learned positions, pre-LayerNorm, tanh GELU, tied embeddings) unless GPTConfig's switches say


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.dropout = config.n_head, config.kv_heads, config.dropout
        head_dim = config.head_dim  # q: n_head heads; k and v: n_kv_head heads each
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.q_norm = self.k_norm = None  # qk_norm: one weight per head dim, shared by the heads (as Qwen3's)
        if config.qk_norm:
            self.q_norm, self.k_norm = (make_norm(config.norm, head_dim, config.bias) for _ in "qk")

    def forward(self, x, attend: Callable, mask: AttentionMask, rope=None):
        """`attend` is the resolved kernel (or, in generation, a cache's decode kernel); `mask` what it reads."""
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split((self.n_head * hs, self.n_kv_head * hs, self.n_kv_head * hs), dim=-1)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv_head, hs).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)  # autocast may give the norm float32
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0)  # k, v may have fewer heads than q
        y = y.transpose(1, 2).reshape(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config.norm, config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config.norm, config.n_embd, config.bias)
        self.mlp = MLP(config.mlp, config.n_embd, config.mlp_width, config.bias, config.dropout)
        self.recompute_mlp = config.activation_checkpointing == "mlp"

    def forward(self, x, attend: Callable, mask: AttentionMask, rope=None):
        x = x + self.attn(self.ln_1(x), attend, mask, rope)
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            return x + checkpoint(self.feed_forward, x, use_reentrant=False)
        return x + self.feed_forward(x)

    def feed_forward(self, x):
        return self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                # RoPE turns q and k by their positions inside attention: no position embedding then
                **({} if config.rope else {"wpe": nn.Embedding(config.block_size, config.n_embd)}),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config.norm, config.n_embd, config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        self.rotary = Rotary(config.head_dim, config.block_size, config.rope_theta) if config.rope else None
        for module in self.modules():  # GPT-2's init: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scales residual projections by depth
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.attention: Attention | None = None  # the resolved backend; set by setup_attention
        self.logged_lines: set[str] = set()  # say each fallback and backend line once per model

    # -- forward and generation --

    def forward(self, idx, targets=None, doc_ids=None, positions=None):
        """(logits, loss). Without targets: the last position's logits (B, 1, V) and None. With targets: the mean
        cross-entropy, and the logits (B, T, V), or None where the loss was chunked (cross_entropy; never built whole).
        doc_ids (B, T): packed documents, attention kept inside each run of equal ids. positions (T,): where idx's
        tokens sit in their sequences, when idx is a part of them (context parallelism); default 0..T-1."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        attention = self.attention_for_forward(idx.device, documents=doc_ids is not None)
        if doc_ids is not None and not attention.use.documents:
            raise ValueError("packed documents (doc_ids) need setup_attention(..., documents=True) first")
        mask = AttentionMask(T, idx.device, doc_ids)
        if positions is None:
            positions = torch.arange(T, device=idx.device) if doc_ids is None else document_positions(doc_ids)
        x, rope = self.embed(idx, positions)  # positions: (T,) or, with documents, (B, T)
        x = self.transformer.drop(x)  # (B, T, C)
        recompute_blocks = self.config.activation_checkpointing == "block" and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute_blocks:
                x = checkpoint(block, x, attention.kernel, mask, rope, use_reentrant=False)
            else:
                x = block(x, attention.kernel, mask, rope)
        return self.head(x, targets)

    def head(self, x, targets=None):
        """forward's (logits, loss) from the last block's output x (B, T, C); its own method, so that a sharded
        model compiles it apart from the loop over blocks (training/parallel.py's compile_blocks)."""
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # only the last position is needed to sample
        # plain is faster where the logits fit (bench/results/h100-train-speed.md)
        if self.config.chunks_loss(targets.numel()):  # the logits are never built whole: none to return
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        wide = torch.promote_types(logits.dtype, torch.float32)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).to(wide), targets.reshape(-1), ignore_index=-1)

    def embed(self, idx, pos) -> tuple[torch.Tensor, tuple | None]:
        """Token embeddings (B, T, C) plus position embeddings at `pos` ((T,) or (B, T)), or RoPE's angles there."""
        x = self.transformer.wte(idx)
        return (x, self.rotary(pos)) if self.rotary is not None else (x + self.transformer.wpe(pos), None)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """Sample max_new_tokens tokens after idx (B, T), nanoGPT's way: the whole context (its last block_size
        tokens) every step. generation.generate is the fast way (KV caches, compiled decode, mixed lengths)."""
        for _ in range(max_new_tokens):
            context = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = -float("inf")
                token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, token), dim=1)
        return idx

    # -- attention: resolved for the device, dtype and use the model runs with --

    def setup_attention(self, device, dtype, *, training=True, seq_len=None, documents=False, measure=False):
        """Resolve and hold the attention backend for this device, compute dtype (autocast's) and use, log it (a
        WARNING when an explicit request falls back, one INFO line naming what runs) and return its Resolution.
        Call it before torch.compile. `measure`: auto may time the candidates here (never in forward)."""
        use = self.attention_use(device, dtype, training=training, seq_len=seq_len, documents=documents)
        measure = measure and self.config.auto_measure
        self.attention = attention_for(self.config, use, self.logged_lines, measure=measure)
        log_resolution(self.config.attention_backend, self.attention, self.logged_lines)
        return self.attention.resolution

    def attention_for_forward(self, device: torch.device, documents: bool) -> Attention:
        """The held resolution, or a new one for the mode the model is in when none is held for this device, or
        the held one was for inference and this forward may train (train mode, or gradients enabled)."""
        attention, training = self.attention, self.training or torch.is_grad_enabled()
        if attention is None or attention.use.device != device or (training and not attention.use.training):
            self.setup_attention(device, self.compute_dtype(device), training=training, documents=documents)
        return self.attention

    def attention_use(self, device, dtype: torch.dtype, *, training=True, seq_len=None, documents=False, **use):
        """What a use of this model asks of an attention kernel (AttentionUse); `use`: its generation fields."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():  # as tensors' cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        c = self.config
        dropout, seq_len, mps_fix = training and c.dropout > 0, seq_len or c.block_size, not c.disable_mps_fix
        return AttentionUse(
            device, dtype, c.head_dim, documents, dropout, training, seq_len, heads=c.n_head, mps_fix=mps_fix, **use
        )

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """autocast's dtype where it is on, else the weights'."""
        autocast = torch.is_autocast_enabled(device.type)
        return torch.get_autocast_dtype(device.type) if autocast else self.lm_head.weight.dtype

    # -- nanoGPT's API: parameters, FLOPs, the optimizer, the context, pretrained weights --

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Position embeddings (wpe) are left out by default; token embeddings stay in,
        because they are tied to the output layer and so do real work."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding and "wpe" in self.transformer else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B as nanoGPT uses it:
        6N for the weight matmuls plus 12·L·H·Q·T for attention (full, not halved for causality)."""
        c = self.config
        return 6 * self.get_num_params() + 12 * c.n_layer * c.n_head * c.head_dim * (seq_len or c.block_size)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float | None:
        """nanoGPT's MFU: fwdbwd_per_iter sequences of block_size tokens each dt seconds over the weights' GPU's dense
        bf16 peak (PEAK_FLOPS); None where it is not known (CPU, MPS, another card): no A100 figure stands in."""
        peak = peak_flops(self.lm_head.weight.device)
        return None if peak is None else self.flops_per_token() * self.config.block_size * fwdbwd_per_iter / dt / peak

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas, device_type: str):
        """AdamW; weight decay on matrices and embeddings (>= 2-D) only, the fused kernel on CUDA and CPU."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = device_type in ("cuda", "cpu")  # every supported torch has fused AdamW on both
        return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), fused=fused or None)

    def crop_block_size(self, block_size: int):
        """Shrink the context (e.g. to fine-tune a 1024-token model on shorter blocks)."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in 1..{self.config.block_size}, got {block_size}")
        self.config.block_size = block_size
        if "wpe" in self.transformer:  # RoPE's tables only ever get read below block_size
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @classmethod
    def from_pretrained(cls, model_type: str, override_args: dict | None = None) -> GPT:
        """nanoGPT's loader: a hub name (gpt2 ... gpt2-xl, through huggingface_hub's cache), a Hugging Face GPT-2
        folder, or a checkpoint of this repo or nanoGPT's (a .pt, or an out_dir with ckpt.pt). override_args:
        GPTConfig fields that keep the weights' shapes (dropout, attention_backend, ...; a smaller block_size crops
        wpe). ValueError, one line, for a source that does not load or a model larger than this machine's RAM."""
        from storage.pretrained import check_fits_in_memory, read_pretrained  # here: `import model` loads no more

        model_config, read_weights = read_pretrained(model_type)
        overrides = {"dropout": 0.0, **(override_args or {})}
        block_size = overrides.pop("block_size", None)
        config = GPTConfig.from_dict({**model_config, **overrides})
        check_fits_in_memory(config)  # before the weights are read: a config.json may ask for any size
        weights = read_weights()
        model = cls(config)
        try:
            model.load_state_dict(weights)
        except RuntimeError as error:  # names or shapes that are not the config's
            why = str(error).splitlines()[-1]
            raise ValueError(f"{model_type}: its weights do not fit its config ({why})") from None
        if block_size is not None and block_size != config.block_size:
            model.crop_block_size(block_size)
        return model


# Dense bf16/fp16 tensor-core FLOP/s (vendors' datasheets) for MFU; the first fragment in the GPU's name wins
# fmt: off
PEAK_FLOPS = {
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "GH200": 989.5e12, "H200": 989.5e12, "H100": 989.5e12,
    "H800": 989.5e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12,
    "A10": 125e12, "RTX 4090": 165.2e12, "RTX 3090": 71e12, "TITAN RTX": 130e12, "T4": 65e12, "V100": 125e12,
}
# fmt: on


def peak_flops(device) -> float | None:
    """The dense bf16 peak FLOP/s of a CUDA device from PEAK_FLOPS; None for another device or an unknown card."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((flops for fragment, flops in PEAK_FLOPS.items() if fragment.lower() in name), None)


# ----------------------------------------------------------------------------------------------
# Attention's kernels: what a use asks of a kernel, the mask of one forward pass, and this file's three kernels
# (one signature: (q, k, v, mask, dropout_p) -> y on (B, H, T, D), causal; k and v may have fewer heads than q)

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionUse:
    """What a use of attention asks of a kernel: the resolver checks each backend against it."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype (autocast's, else the weights')
    head_dim: int = 64
    documents: bool = False  # attention restricted to documents of a packed row
    dropout: bool = False  # attention dropout during training
    training: bool = True  # gradients are needed
    seq_len: int = 0  # the longest sequence this use runs (0: unknown); only auto's order depends on it
    kv_cache: str = "none"  # generation: the KV cache decode steps read (none | contiguous | paged: generation/)
    decode_step: str = "eager"  # generation: eager | graph (the static step as a CUDA graph) | compiled (and graphed)
    mps_fix: bool = True  # keep SDPA away from explicit masks on MPS (why_not_sdpa); GPTConfig.disable_mps_fix
    heads: int = 0  # query heads (0: unknown); only auto's timing of candidates reads it

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


class AttentionMask:
    """The causal (and same-document) mask of one forward pass, shared by all layers, in the forms kernels ask for
    (dense, varlen, a kernel's own `form`), each made on first use. Documents are the runs of equal doc_ids."""

    def __init__(self, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None = None):
        self.seq_len, self.device, self.segments = seq_len, device, None
        self._forms: dict[str, object] = {}
        if doc_ids is not None:  # each token's document: the runs of equal ids numbered 0, 1, 2, ... per row.
            # Built as int32 and summed once: the same numbers as run_starts(...).cumsum(dtype=int32) - 1 made
            # inductor fail to lower flex_attention's packed BlockMask inside a compiled graph (torch 2.11, an H200).
            change = torch.zeros_like(doc_ids, dtype=torch.int32)
            change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
            self.segments = change.cumsum(dim=1)

    @property
    def has_documents(self) -> bool:
        return self.segments is not None

    def dense(self) -> torch.Tensor:
        """(B or 1, 1, T, T) bool, True where attention is allowed."""
        if "dense" not in self._forms:
            T = self.seq_len
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            if self.segments is not None:
                mask = mask & (self.segments[:, :, None] == self.segments[:, None, :])  # (B, T, T)
            self._forms["dense"] = mask.view(-1, 1, T, T)
        return self._forms["dense"]

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens, T): int32 document starts plus the end over the flattened (B*T) tokens; T bounds each."""
        if "varlen" not in self._forms:
            first = run_starts(self.segments).flatten().nonzero().flatten()  # one host sync per forward, not per layer
            cu_seqlens = torch.cat([first, first.new_tensor([self.segments.numel()])]).to(torch.int32)
            self._forms["varlen"] = (cu_seqlens, self.seq_len)
        return self._forms["varlen"]

    def form(self, name: str, make: Callable[[AttentionMask], object]):
        """A kernel's own form of this mask (e.g. flex_attention's BlockMask), made by make(self) on first use."""
        if name not in self._forms:
            self._forms[name] = make(self)
        return self._forms[name]


def repeat_kv(q, k, v):
    """k and v (B, n_kv, S, D) repeated to q's heads (GQA/MQA), for kernels that take no fewer k/v than q heads."""
    group = q.size(1) // k.size(1)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, S, D)


def manual_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """The reference: explicit scores, mask and a float32 (or wider) softmax. O(T^2) memory."""
    k, v = repeat_kv(q, k, v)
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout_p).to(v.dtype)
    return weights @ v


def sdpa_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0, kernel: str = "auto"):
    """torch.nn.functional.scaled_dot_product_attention; `kernel` pins one of PyTorch's kernels."""
    context = contextlib.nullcontext() if kernel == "auto" else sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[kernel]))
    attn_mask = mask.dense() if mask.has_documents else None
    k, v, gqa = sdpa_kv(q, k, v, attn_mask, kernel)
    with context:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None, **gqa
        )


def sdpa_kv(q, k, v, attn_mask, kernel: str = "auto"):
    """(k, v, keywords) for SDPA when k and v may have fewer heads than q. enable_gqa where the kernel that will
    run reads grouped heads itself: the math kernel, and PyTorch's flash kernel on CUDA (half precision, no mask;
    before sm80 the math kernel runs instead). Elsewhere k and v are repeated to q's heads: the efficient and CPU
    kernels take no grouped heads, so enable_gqa with a mask (documents, decode steps) could leave only math."""
    if k.size(1) == q.size(1):
        return k, v, {}
    if kernel == "math" or (q.is_cuda and q.dtype in HALF and attn_mask is None and kernel in ("auto", "flash")):
        return k, v, {"enable_gqa": True}
    return *repeat_kv(q, k, v), {}


MPS_MASK_PROBLEM = "SDPA on MPS can return NaN for masked rows with an explicit mask (pytorch#107616)"


def why_not_sdpa(use: AttentionUse) -> str:
    # document masks and KV-cache decode steps pass SDPA an explicit mask; plain causal attention does not
    if use.device.type == "mps" and use.mps_fix and (use.documents or use.kv_cache != "none"):
        return MPS_MASK_PROBLEM + "; disable_mps_fix=true keeps SDPA"
    return ""


def why_not_sdpa_kernel(kernel: str, use: AttentionUse) -> str:
    """Why PyTorch's SDPA kernel `kernel` cannot be pinned for this use ('' when it can)."""
    device, dtype = use.device, use.dtype
    if kernel in ("cudnn", "efficient") and device.type != "cuda":
        return f"SDPA's {kernel} kernel runs on CUDA only (device is {device.type})"
    if kernel == "flash" and device.type == "cuda" and dtype not in HALF:
        return f"SDPA's flash kernel needs float16 or bfloat16 on CUDA (this run is {dtype_name(dtype)})"
    if kernel == "cudnn" and dtype not in HALF:
        return f"SDPA's cudnn kernel needs float16 or bfloat16 (this run is {dtype_name(dtype)})"
    if kernel in ("flash", "cudnn") and use.documents:
        return f"SDPA's {kernel} kernel takes no document mask"
    if kernel in ("flash", "cudnn") and device.type == "cuda" and cuda_capability(device) < (8, 0):
        return f"SDPA's {kernel} kernel needs compute capability >= 8.0"
    return ""


def import_flash_package(name: str, pretty: str) -> tuple[object | None, str, str]:
    """Import module `name` of a flash-attn package: (module, version, '') or (None, '', why not)."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if name == error.name or name.startswith(f"{error.name}."):
            return None, "", f"{pretty} is not installed"
        return None, "", f"{pretty} failed to import: {error}"
    except (ImportError, OSError) as error:  # typically a wheel built for another torch/CUDA
        return None, "", f"{pretty} failed to import: {str(error).splitlines()[0]}"
    if not hasattr(module, "flash_attn_func"):  # flash-attn-4 alone leaves a bare flash_attn namespace
        return None, "", f"{pretty} is not installed (module {name} has no flash_attn_func)"
    return module, getattr(module, "__version__", ""), ""


def why_not_flash(use: AttentionUse, module, label: str, gpu_rule: Callable, has_dropout: bool = True) -> str:
    """What every flash-attn package asks of a use ('' when it can run it); gpu_rule(capability, 'smXY', use):
    the package's own rule for the GPU."""
    if use.device.type != "cuda":
        return f"flash-attn runs on CUDA GPUs only (device is {use.device.type})"
    capability = cuda_capability(use.device)
    why = gpu_rule(capability, "sm{}{}".format(*capability), use)
    if why:
        return why
    if use.dtype not in HALF:
        return f"flash-attn needs float16 or bfloat16 (this run is {dtype_name(use.dtype)})"
    if use.head_dim % 8 or use.head_dim > 256:
        return f"flash-attn needs a head dim that is a multiple of 8 and <= 256 (got {use.head_dim})"
    if use.dropout and not has_dropout:
        return f"{label} has no attention dropout (set dropout=0)"
    if use.kv_cache != "none" and not hasattr(module, "flash_attn_with_kvcache"):
        return f"{label} has no flash_attn_with_kvcache, which decoding from a KV cache calls"
    return ""


def flash_attention(module, q, k, v, mask: AttentionMask, **dropout):
    """Attention through a flash-attn module's flash_attn_func, or its varlen function for packed documents."""
    B, H, T, D = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D); k, v may have fewer heads (GQA)
    if mask.has_documents:
        cu_seqlens, max_len = mask.varlen()
        q, k, v = (x.reshape(B * T, x.size(2), D) for x in (q, k, v))
        lengths = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len)
        y = module.flash_attn_varlen_func(q, k, v, causal=True, **lengths, **dropout)
    else:
        y = module.flash_attn_func(q, k, v, causal=True, **dropout)
    y = y[0] if isinstance(y, tuple) else y  # FA3 builds and FA4 also return the log-sum-exp
    return y.reshape(B, T, H, D).transpose(1, 2)


class FlashAttn2:
    """flash-attn 2 (the flash_attn package) as a kernel. The package is imported once, by the first check
    (resolving runs it), and read from an attribute after, so torch.compile never traces an import."""

    module, version, why_missing = None, "", None  # set by load(); why_missing is None until it ran

    def load(self) -> str:
        """Import the package (once); why it cannot be used ('' when it can)."""
        if self.why_missing is None:
            self.module, self.version, self.why_missing = import_flash_package("flash_attn", "flash-attn")
        return self.why_missing

    def why_not(self, use: AttentionUse) -> str:
        return self.load() or why_not_flash(use, self.module, "flash-attn 2", self.why_not_gpu)

    @staticmethod
    def why_not_gpu(capability: tuple[int, int], sm: str, use: AttentionUse) -> str:
        return "" if capability >= (8, 0) else f"flash-attn 2 needs compute capability >= 8.0 (this GPU is {sm})"

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
        self.load()  # imported already where a check ran; a bench may call a kernel without one
        return flash_attention(self.module, q, k, v, mask, dropout_p=dropout_p)


# ----------------------------------------------------------------------------------------------
# The registry {name: AttentionBackend}; `resolve` turns a request into the backend that runs. Adding a backend =
# its kernel + one register() call (kernels/ and generation/ register the ones beyond this file's three).


class AttentionBackend(NamedTuple):
    name: str
    kernel: Callable | None  # (q, k, v, mask, dropout_p) -> y, all (B, H, T, D), causal; None: no kernel of its own
    why_not: Callable[[AttentionUse], str]  # why it cannot run a use ('' when it can)
    fallback: str | None  # what an explicit request of this backend falls back to
    aliases: tuple[str, ...] = ()


BACKENDS: dict[str, AttentionBackend] = {}


def register(backend: AttentionBackend) -> AttentionBackend:
    BACKENDS[backend.name] = backend
    return backend


FLASH_ATTN_2 = FlashAttn2()
register(AttentionBackend("flash_attn_2", FLASH_ATTN_2, FLASH_ATTN_2.why_not, "sdpa", ("flash_attention_2",)))
register(AttentionBackend("sdpa", sdpa_attention, why_not_sdpa, "manual"))
register(AttentionBackend("manual", manual_attention, lambda use: "", None, ("eager",)))


def default_auto_order(use: AttentionUse, measure: bool = False) -> tuple[tuple[str, ...], str]:
    """auto's order without kernels/: PyTorch's SDPA first (it picks its own fastest kernel), except for packed
    documents, which SDPA only takes as a dense mask and flash-attn's varlen kernel reads as cu_seqlens."""
    first = ("flash_attn_2", "sdpa") if use.documents else ("sdpa", "flash_attn_2")
    return (*first, "manual"), "default order"


# auto's order: (use, measure) -> (names to try, how they were chosen); the last registered wins: kernels/auto.py's
# per-card table, which with measure=True (setup_attention's, never forward's) times candidates on an unknown card
AUTO_ORDER: list[Callable[[AttentionUse, bool], tuple[tuple[str, ...], str]]] = [default_auto_order]
register_auto_order = AUTO_ORDER.append


def aliases() -> dict[str, str]:
    return {alias: b.name for b in BACKENDS.values() for alias in b.aliases}


def canonical_backend(name: str) -> str:
    """Map a backend name or alias to its canonical name; ValueError lists what is allowed."""
    key = aliases().get(str(name).strip().lower(), str(name).strip().lower())
    if key != "auto" and key not in BACKENDS:
        allowed = f"auto, {', '.join(BACKENDS)}; aliases: " + ", ".join(f"{a} (= {b})" for a, b in aliases().items())
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {allowed}")
    return key


class Resolution(NamedTuple):
    used: str  # the backend that will run
    reason: str  # why it differs from the request, or how auto chose ('' when the request runs as is)


def resolve(requested: str, use: AttentionUse, order=None, measure: bool = False) -> Resolution:
    """(the backend that runs `use` when `requested` is asked for, why). An explicit request follows its fallback
    chain; auto takes the first that runs of `order` ((names, how chosen); default: the registered auto order)."""
    requested = canonical_backend(requested)
    if requested == "auto":
        names, how = order or AUTO_ORDER[-1](use, measure)
    else:
        names, how = [requested], ""
        while BACKENDS[names[-1]].fallback:
            names.append(BACKENDS[names[-1]].fallback)
    skipped = []  # (name, why not) of each that cannot run
    for name in names:
        why = BACKENDS[name].why_not(use) if name in BACKENDS else f"{name} is not registered (import kernels)"
        if not why:
            break
        skipped.append((name, why))
    if requested == "auto":
        how = f" ({how})" if how and how != "default order" else ""
        chosen = f"auto: first that runs on {use.device.type}/{dtype_name(use.dtype)} of {' > '.join(names)}{how}"
        return Resolution(name, chosen + ("; skipped " + "; ".join(f"{n}: {p}" for n, p in skipped) if skipped else ""))
    return Resolution(name, "; then ".join([p for _, p in skipped[:1]] + [f"{n}: {p}" for n, p in skipped[1:]]))


class Attention(NamedTuple):  # a resolved backend: what the model's forward calls, and what it was resolved for
    kernel: Callable
    resolution: Resolution
    use: AttentionUse


def attention_for(config: GPTConfig, use: AttentionUse, logged: set[str], order=None, measure=False) -> Attention:
    """Resolve config.attention_backend for `use` (auto: in `order` if given); the sdpa backend pinned to
    config.sdpa_kernel where that runs. `logged`: the lines already said (log_once)."""
    resolution = resolve(config.attention_backend, use, order, measure)
    kernel, pinned = BACKENDS[resolution.used].kernel, config.sdpa_kernel
    if resolution.used == "sdpa" and pinned != "auto":
        why = why_not_sdpa_kernel(pinned, use)
        if why:
            log_once(logged, logging.WARNING, f"sdpa_kernel={pinned} requested but {why}; letting PyTorch choose")
        else:
            kernel = functools.partial(sdpa_attention, kernel=pinned)
    return Attention(kernel, resolution, use)


def log_resolution(requested: str, attention: Attention, logged: set[str], detail: str = "") -> None:
    """A WARNING when an explicit request falls back (saying why), and one INFO line naming what runs."""
    (used, reason), kernel = attention.resolution, attention.kernel
    if requested == "auto" and MPS_MASK_PROBLEM in reason:  # an explicit request warns below
        log_once(logged, logging.WARNING, f"auto: {MPS_MASK_PROBLEM}; using {used}")
    if requested != "auto" and used != requested:
        log_once(logged, logging.WARNING, f"{requested} requested but {reason}; falling back to {used}")
    detail += f", kernel {kernel.keywords['kernel']}" if isinstance(kernel, functools.partial) else ""
    note = f" ({reason})" if requested == "auto" else f" (requested {requested}: {reason})" if reason else ""
    log_once(logged, logging.INFO, f"attention backend: {used}{detail}{note}")


def log_once(logged: set[str], level: int, message: str) -> None:
    """Say `message` unless it is in `logged` (a model says each fallback and backend line once)."""
    if message not in logged:
        logged.add(message)
        log.log(level, message)


# ----------------------------------------------------------------------------------------------
# The loss without the full logits, the largest tensor of a GPT-2 training step (3.3 GB in float32 for 16 x 1024
# tokens): lm_head and cross-entropy fused. For a chunk of rows at a time, forward computes the logits, the loss
# and both gradients, then drops the chunk; backward only scales the stored gradients: the plain path's three
# matmuls, nothing recomputed (Liger-Kernel's approach, in plain PyTorch so torch.compile fuses the softmax).

IGNORE_INDEX = -1  # targets equal to this add nothing to the loss (as F.cross_entropy's ignore_index)
CHUNK_ELEMENTS = 2**28  # most logits per chunk: 5,336 rows of GPT-2's 50,304 (0.5 GiB in bf16, 1 GiB in fp32)


def chunk_rows(vocab_size: int, rows: int) -> int:
    """Rows per chunk: equal chunks of at most CHUNK_ELEMENTS logits (a short last chunk would make a slow matmul)."""
    chunks = math.ceil(rows * vocab_size / CHUNK_ELEMENTS)
    return max(1, math.ceil(rows / chunks))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # x (N, C) and weight (V, C) in the compute dtype; targets (N,)
        n, step = x.size(0), chunk_rows(weight.size(0), x.size(0))
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        wide = torch.promote_types(x.dtype, torch.float32)  # softmax and sums: float32, or float64 for float64
        count = (targets != IGNORE_INDEX).sum().clamp(min=1).to(wide)
        loss = torch.zeros((), dtype=wide, device=x.device)
        grad_x = torch.empty_like(x) if needs_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=x.device) if needs_grad else None
        for start in range(0, n, step):
            rows, target = x[start : start + step], targets[start : start + step]
            logits = (rows @ weight.t()).to(wide)  # (rows, V): the plain path's logits, upcast as it does
            keep = target != IGNORE_INDEX
            safe_target = torch.where(keep, target, 0).unsqueeze(1)
            log_norm = torch.logsumexp(logits, dim=1, keepdim=True)
            loss += ((log_norm - logits.gather(1, safe_target)).squeeze(1) * keep).sum()
            if needs_grad:  # d loss / d logits = softmax - one_hot, zero on ignored rows
                grad_logits = torch.exp(logits - log_norm)
                grad_logits.scatter_add_(1, safe_target, torch.full_like(log_norm, -1.0))
                grad_logits = (grad_logits * keep.unsqueeze(1)).to(x.dtype)
                grad_x[start : start + step] = grad_logits @ weight
                grad_weight += (grad_logits.t() @ rows).to(wide)
        if needs_grad:
            ctx.save_for_backward(grad_x, grad_weight.to(weight.dtype), count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_x * scale.to(grad_x.dtype), grad_weight * scale.to(grad_weight.dtype), None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1) without holding the (N, V) logits.
    x (..., C); weight (V, C); targets (...). Under autocast both are cast to its dtype, as F.linear casts them."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
    with torch.autocast(x.device.type, enabled=False):
        x, weight = x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype)
        return _ChunkedLinearCrossEntropy.apply(x, weight, targets.reshape(-1))
