"""
A GPT-2 language model, with a choice of attention kernels and switches for a modern block (RoPE, RMSNorm,
SwiGLU, grouped key/value heads, q/k norm; all off is GPT-2 exactly).

Read top-down: the config; the attention backends, one record each (kernel, when it cannot run, what to
fall back to, how it decodes from a KV cache); `resolve`, which turns a requested backend into the one that
runs; the model, which resolves once when it is set up for a device, dtype and use (`setup_attention`),
never inside forward; and `python model.py`, which prints what this machine can run. The kernels live in
attention.py; generation's KV caches and the kernels that read them in kv_cache.py; the block's switchable
pieces (norms, MLPs, RoPE) in layers.py.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from attention import (
    FLASH_ATTN_2,
    FLASH_ATTN_3,
    FLASH_ATTN_4,
    MPS_MASK_PROBLEM,
    AttentionMask,
    FlashAttention,
    Need,
    auto_order,
    card_key,
    dtype_name,
    flex_attention,
    flex_problem,
    manual_attention,
    manual_problem,
    measured_order,
    read_auto_table,
    sdpa_attention,
    sdpa_kernel_problem,
    sdpa_problem,
)
from cross_entropy import chunked_cross_entropy
from kv_cache import (
    FLEX_DECODE,
    MANUAL_DECODE,
    SDPA_DECODE,
    DecodeKernel,
    Generation,
    Step,
    check_generation,
    flash_decode,
    next_token,
    paged_problem,
)
from layers import Rotary, apply_rotary, check_block, document_positions, make_mlp, make_norm, mlp_hidden_size

log = logging.getLogger("model")

# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them
    # The modern block: each switch off is GPT-2 (layers.py)
    rope: bool = False  # rotary position embedding on q and k, in place of learned positions (no wpe)
    rope_theta: float = 10000.0  # RoPE's base: the slowest pair of dimensions turns once in ~2π·rope_theta tokens
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm (no bias)
    mlp: str = "gelu"  # gelu (GPT-2: c_fc, GELU, c_proj) | swiglu (c_gate, c_fc, c_proj)
    mlp_hidden: int | None = None  # MLP hidden width; None: 4·n_embd (gelu), 8/3·n_embd rounded up to 64s (swiglu)
    n_kv_head: int | None = None  # key/value heads, each shared by n_head/n_kv_head query heads; None: n_head
    qk_norm: bool = False  # normalize q and k per head (with `norm`) before RoPE and attention
    attention_backend: str = "auto"  # a name or alias in BACKENDS, or auto; see resolve
    sdpa_kernel: str = "auto"  # restrict the sdpa backend to one PyTorch kernel: auto|flash|cudnn|efficient|math
    auto_measure: bool = True  # auto on a GPU the table does not know times the candidates once (cached)
    cross_entropy: str = "auto"  # plain (full logits) | chunked (lm_head + loss by rows) | auto: chunked if big
    activation_checkpointing: str = "none"  # recompute in backward to save memory: none | mlp | block
    use_flash_attention: bool | None = None  # deprecated: True means attention_backend="flash_attn_2"
    disable_mps_fix: bool = False  # on MPS, let SDPA run with explicit masks (documents, KV cache), NaN risk

    def __post_init__(self):
        if self.use_flash_attention is not None:
            new = "flash_attn_2" if self.use_flash_attention else "manual"
            warnings.warn(
                f"use_flash_attention is deprecated; use attention_backend={new!r}", DeprecationWarning, stacklevel=3
            )
            self.attention_backend, self.use_flash_attention = new, None
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"head dim n_embd/n_head = {self.head_dim} must be even")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_block(self)  # the modern block's switches
        self.attention_backend = canonical_backend(self.attention_backend)
        if self.sdpa_kernel not in SDPA_KERNELS:
            raise ValueError(f"unknown sdpa_kernel {self.sdpa_kernel!r}; choose one of {', '.join(SDPA_KERNELS)}")
        for name, allowed in (("cross_entropy", CROSS_ENTROPY), ("activation_checkpointing", CHECKPOINTING)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")

    def chunks_loss(self, tokens: int) -> bool:
        """Whether the loss over `tokens` targets runs chunked (cross_entropy; auto: past AUTO_CHUNKED_LOGITS)."""
        return self.cross_entropy == "chunked" or (
            self.cross_entropy == "auto" and tokens * self.vocab_size > AUTO_CHUNKED_LOGITS
        )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or mlp_hidden_size(self.mlp, self.n_embd)


# ----------------------------------------------------------------------------------------------
# Attention backends: one record each. Adding a backend = its kernel (attention.py) + one record here.


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    kernel: Callable | None  # (q, k, v, mask, dropout_p) -> y, all (B, H, T, D), causal
    problem: Callable[[Need], str]  # why it cannot run for a use ('' when it can)
    fallback: str | None  # what an explicit request of this backend falls back to
    aliases: tuple[str, ...] = ()
    decode: DecodeKernel | None = None  # attention over a KV cache for generation (kv_cache.py)


BACKENDS: dict[str, AttentionBackend] = {}
SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")
CROSS_ENTROPY = ("auto", "plain", "chunked")
AUTO_CHUNKED_LOGITS = 2**31  # auto chunks the loss past this many logits a micro-batch (8 GiB in float32)
CHECKPOINTING = ("none", "mlp", "block")  # mlp keeps attention's outputs: at long T, attention is the costly part


def register(backend: AttentionBackend) -> AttentionBackend:
    BACKENDS[backend.name] = backend
    return backend


FA4_DECODE, FA3_DECODE, FA2_DECODE = (flash_decode(kernel) for kernel in (FLASH_ATTN_4, FLASH_ATTN_3, FLASH_ATTN_2))

for _backend in (
    AttentionBackend(
        "flash_attn_4", FLASH_ATTN_4, FLASH_ATTN_4.problem, "flash_attn_3", ("flash_attention_4",), FA4_DECODE
    ),
    AttentionBackend(
        "flash_attn_3", FLASH_ATTN_3, FLASH_ATTN_3.problem, "flash_attn_2", ("flash_attention_3",), FA3_DECODE
    ),
    AttentionBackend("flash_attn_2", FLASH_ATTN_2, FLASH_ATTN_2.problem, "sdpa", ("flash_attention_2",), FA2_DECODE),
    AttentionBackend("flex_attention", flex_attention, flex_problem, "sdpa", ("flex",), FLEX_DECODE),
    AttentionBackend("sdpa", sdpa_attention, sdpa_problem, "manual", (), SDPA_DECODE),
    AttentionBackend("manual", manual_attention, manual_problem, None, ("eager",), MANUAL_DECODE),
    # A cache layout, not a kernel: generation under it runs auto's pick for a paged cache (GPT._resolve)
    AttentionBackend("paged_attention", None, paged_problem, "sdpa", ("paged", "paged_attn")),
):
    register(_backend)


def backend_names() -> tuple[str, ...]:
    return ("auto", *BACKENDS)


def aliases() -> dict[str, str]:
    return {alias: b.name for b in BACKENDS.values() for alias in b.aliases}


def canonical_backend(name: str) -> str:
    """Map a backend name or alias to its canonical name; ValueError lists what is allowed."""
    key = str(name).strip().lower()
    key = aliases().get(key, key)
    if key not in backend_names():
        listed = ", ".join(f"{a} (= {b})" for a, b in aliases().items())
        raise ValueError(
            f"unknown attention_backend {name!r}; choose one of {', '.join(backend_names())}; aliases: {listed}"
        )
    return key


class Resolution(NamedTuple):
    used: str  # the backend that will run
    reason: str  # why it differs from the request, or how auto chose ('' when the request runs as is)


def resolve(requested: str, need: Need, order: tuple[tuple[str, ...], str] | None = None) -> Resolution:
    """The backend that runs for `need` when `requested` is asked for, and why.

    An explicit request follows its fallback chain; `auto` takes the first that runs of `order`
    ((names, how chosen); default: attention.auto_order, from the card's table).
    """
    requested = canonical_backend(requested)
    if requested == "auto":
        names, how = order or auto_order(need)
    else:
        names, how = [requested], ""
        while BACKENDS[names[-1]].fallback:
            names.append(BACKENDS[names[-1]].fallback)
    skipped = []
    for name in names:
        problem = BACKENDS[name].problem(need)
        if not problem:
            break
        skipped.append((name, problem))
    if requested == "auto":
        why = "; ".join(f"{n}: {p}" for n, p in skipped)
        how = f" ({how})" if how and how != "default order" else ""
        return Resolution(
            name,
            f"auto: first that runs on {need.where} of {' > '.join(names)}{how}" + (f"; skipped {why}" if why else ""),
        )
    if not skipped:
        return Resolution(name, "")
    return Resolution(name, skipped[0][1] + "".join(f"; then {n}: {p}" for n, p in skipped[1:]))


class Attention(NamedTuple):
    """What the model's forward calls, resolved by setup_attention."""

    kernel: Callable
    resolution: Resolution
    need: Need  # what it was resolved for
    decode: DecodeKernel | None = None  # generation with a KV cache: attention over it
    under: str = ""  # paged_attention: the backend whose kernels run under it


# ----------------------------------------------------------------------------------------------
# The model (GPT-2: learned positions, pre-LayerNorm, tanh GELU, tied embeddings; GPTConfig's switches
# change the block: RoPE, RMSNorm, SwiGLU, grouped key/value heads, q/k norm)


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
        self.mlp = make_mlp(config.mlp, config.n_embd, config.mlp_width, config.bias, config.dropout)
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
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        self.rotary = Rotary(config.head_dim, config.block_size, config.rope_theta) if config.rope else None
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scales residual projections by depth
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.attention: dict[bool, Attention] = {}  # documents or not -> kernel; set by setup_attention
        self.attention_device: torch.device | None = None
        self._logged: set[str] = set()  # say each fallback and backend line once per model

    @classmethod
    def from_pretrained(cls, path_or_name, **overrides) -> GPT:
        """GPT-2 weights: a hub name (gpt2 ... gpt2-xl, from the Hugging Face cache), a Hugging Face GPT-2 folder,
        or a checkpoint of this repo or nanoGPT; overrides set GPTConfig fields such as attention_backend."""
        from interop import from_pretrained  # interop imports this module

        return from_pretrained(path_or_name, **overrides)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # -- attention backend: resolved once for the device, dtype and use the model runs with --

    def setup_attention(
        self,
        device,
        dtype: torch.dtype,
        *,
        training: bool = True,
        seq_len: int | None = None,
        documents: bool = False,
        kv_cache: str = "none",
        compiled: bool = False,
    ) -> Resolution:
        """Resolve the attention backend for this device, compute dtype (autocast's) and use, and log it:
        a WARNING when an explicit request falls back, one INFO line naming what runs. Call it before
        torch.compile; forward then reads the result. `documents` says whether the run packs documents
        (both kinds are resolved; the one in use is logged); `kv_cache`, which cache generation decodes
        from, and `compiled`, whether its decode step is compiled. Returns the resolution in use."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():  # as tensors' cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        dropout = training and self.config.dropout > 0
        seq_len = seq_len or self.config.block_size
        self.attention = {}
        for docs in (False, True):
            mps_fix = not self.config.disable_mps_fix
            need = Need(
                device, dtype, self.config.head_dim, docs, dropout, training, seq_len, kv_cache, compiled, mps_fix
            )
            self.attention[docs] = self._resolve(need, measure=docs == documents)
        self.attention_device = device
        self._log(self.attention[documents])
        return self.attention[documents].resolution

    def _resolve(self, need: Need, measure: bool) -> Attention:
        requested, order = self.config.attention_backend, None
        measure = measure and self.config.auto_measure and need.kv_cache == "none"  # decode kernels: by design
        if requested == "auto" and measure and self._card_unknown(need):
            runs = {
                n: BACKENDS[n].kernel for n in auto_order(need)[0] if n != "manual" and not BACKENDS[n].problem(need)
            }
            if len(runs) > 1:
                order = measured_order(runs, need, self.config.n_head)
        resolution = resolve(requested, need, order)
        under = resolve("auto", need).used if resolution.used == "paged_attention" else ""
        record = BACKENDS[under or resolution.used]
        kernel = record.kernel
        if record.name == "sdpa" and self.config.sdpa_kernel != "auto":
            problem = sdpa_kernel_problem(self.config.sdpa_kernel, need)
            if problem:
                self._log_once(
                    logging.WARNING,
                    f"sdpa_kernel={self.config.sdpa_kernel} requested but {problem}; letting PyTorch choose",
                )
            else:
                kernel = functools.partial(sdpa_attention, kernel=self.config.sdpa_kernel)
        return Attention(kernel, resolution, need, record.decode, under)

    @staticmethod
    def _card_unknown(need: Need) -> bool:
        return need.device.type == "cuda" and card_key(need.device) not in read_auto_table()

    def _log(self, attention: Attention):
        requested, resolution, kernel = self.config.attention_backend, attention.resolution, attention.kernel
        if requested == "auto" and MPS_MASK_PROBLEM in resolution.reason:  # an explicit request warns below
            self._log_once(logging.WARNING, f"auto: {MPS_MASK_PROBLEM}; using {resolution.used}")
        if requested != "auto" and resolution.used != requested:
            self._log_once(
                logging.WARNING, f"{requested} requested but {resolution.reason}; falling back to {resolution.used}"
            )
        detail = f" over {attention.under} (auto's pick for a paged cache)" if attention.under else ""
        detail += f", kernel {kernel.keywords['kernel']}" if isinstance(kernel, functools.partial) else ""
        if attention.need.kv_cache == "paged":
            detail += f", paged KV cache: {attention.decode.pages}"
        elif attention.need.kv_cache == "contiguous":
            detail += ", contiguous KV cache"
        if requested == "auto":
            note = f" ({resolution.reason})"
        elif resolution.reason:
            note = f" (requested {requested}: {resolution.reason})"
        else:
            note = ""
        self._log_once(logging.INFO, f"attention backend: {resolution.used}{detail}{note}")

    def _log_once(self, level: int, message: str):
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, message)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """autocast's dtype where it is on, else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.lm_head.weight.dtype

    # -- forward, loss and generation --

    def forward(self, idx, targets=None, doc_ids=None):
        """(logits, loss). Without targets: the last position's logits (B, 1, V) and None. With targets: the mean
        cross-entropy, and the logits (B, T, V), or None where the loss was chunked (cross_entropy; never built whole).
        doc_ids (B, T): packed documents, attention kept inside each run of equal ids."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        if self.attention_device != idx.device:  # not set up for this device: resolve for training, once
            self.setup_attention(idx.device, self.compute_dtype(idx.device))
        attend = self.attention[doc_ids is not None].kernel
        mask = AttentionMask(T, idx.device, doc_ids)
        pos = torch.arange(T, device=idx.device) if doc_ids is None else document_positions(doc_ids)  # (T,)|(B, T)
        x, rope = self.embed(idx, pos)
        x = self.transformer.drop(x)  # (B, T, C)
        recompute_blocks = self.config.activation_checkpointing == "block" and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute_blocks:
                x = checkpoint(block, x, attend, mask, rope, use_reentrant=False)
            else:
                x = block(x, attend, mask, rope)
        return self.head(x, targets)

    def head(self, x, targets=None):
        """forward's (logits, loss) from the last block's output x (B, T, C)."""
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # only the last position is needed to sample
        # plain is faster where the logits fit (bench/results/h100-train-speed.md)
        if self.config.chunks_loss(targets.numel()):  # the logits are never built whole: none to return
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        wide = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).to(wide), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def embed(self, idx, pos) -> tuple[torch.Tensor, tuple | None]:
        """Token embeddings (B, T, C), plus the position embeddings at `pos` ((T,) or (B, T)); with RoPE
        instead, the rotary angles at `pos` that every layer's attention applies to q and k."""
        x = self.transformer.wte(idx)
        if self.rotary is not None:
            return x, self.rotary(pos)
        return x + self.transformer.wpe(pos), None

    def forward_cached(self, idx, step: Step, attends: Sequence[Callable]) -> torch.Tensor:
        """Logits (B, vocab) at each row's newest token, for generation: idx (B, T) sits at positions
        step.q_pos, continuing each sequence in its cache, and layer i attends through attends[i] (kv_cache.py)."""
        x, rope = self.embed(idx, step.q_pos)
        for block, attend in zip(self.transformer.h, attends):
            x = block(x, attend, step, rope)
        x = x[torch.arange(idx.size(0), device=idx.device), step.last]  # (B, C): the rest works per token
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        **options,
    ):
        """Sample max_new_tokens tokens after idx: a (B, T) tensor gives (B, T + max_new_tokens); a list of
        1-D prompts of different lengths gives a list, each prompt followed by its new tokens. options: stream's
        (kv_cache, compile, vocab_size, page_size)."""
        prompts = list(idx)
        steps = list(self.stream(prompts, max_new_tokens, temperature, top_k, **options))
        new = torch.stack(steps, dim=1) if steps else prompts[0].new_zeros(len(prompts), 0)  # (B, new)
        if isinstance(idx, torch.Tensor):
            return torch.cat((idx, new.to(idx.dtype)), dim=1)
        return [torch.cat((prompt, row.to(prompt.dtype))) for prompt, row in zip(prompts, new)]

    @torch.no_grad()
    def stream(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        kv_cache: str = "contiguous",
        compile: bool = False,
        vocab_size: int | None = None,
        page_size: int | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the next token of every prompt, (B,), max_new_tokens times.

        The prompts (1-D, of any lengths) are read once (prefill); each later step feeds only the newest tokens
        and reads the rest from a per-layer KV cache: "contiguous" (preallocated), "paged" (pages allocated on
        demand; what attention_backend="paged_attention" means) or "none" (the whole context every step, as
        nanoGPT). compile: a static-shape decode step under torch.compile(mode="reduce-overhead"), CUDA graphs
        (elsewhere it runs eagerly). Past block_size every row reads its last block_size tokens (kv_cache.py).
        temperature 0 is greedy; only ids below vocab_size are drawn; page_size overrides the kernel's. The
        attention backend is resolved for this use once, and the previous choice restored after."""
        check_generation(max_new_tokens, temperature, top_k, kv_cache, compile)
        if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
            raise ValueError("every prompt must be a non-empty 1-D tensor of token ids")
        if self.config.attention_backend == "paged_attention" and kv_cache == "contiguous":
            kv_cache = "paged"  # the backend names the cache layout
        device, longest = prompts[0].device, max(p.numel() for p in prompts)
        saved = self.attention, self.attention_device
        seq_len = min(self.config.block_size, longest + max_new_tokens)
        self.setup_attention(
            device, self.compute_dtype(device), training=False, seq_len=seq_len, kv_cache=kv_cache, compiled=compile
        )
        try:
            attention = self.attention[False]
            generation = Generation(
                self, prompts, max_new_tokens, attention, kv_cache, compile=compile, page_size=page_size
            )
            for _, logits in zip(range(max_new_tokens), generation):  # range first: no step past the last
                tokens = next_token(logits, temperature, top_k, vocab_size)
                generation.add(tokens)
                yield tokens
        finally:
            self.attention, self.attention_device = saved

    # -- helpers for training --

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Position embeddings (wpe) are left out by default; token embeddings stay in,
        because they are tied to the output layer and so do real work."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding and "wpe" in self.transformer else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B as nanoGPT uses it:
        6N for the weight matmuls plus 12·L·H·Q·T for attention (full, not halved for causality)."""
        c = self.config
        T = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * T

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas, device_type: str, *, fused: bool = True
    ):
        """AdamW; weight decay on matrices and embeddings (>= 2-D) only, the fused kernel on CUDA and CPU."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = fused and device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), **({"fused": True} if fused else {}))

    def crop_block_size(self, block_size: int):
        """Shrink the context (e.g. to fine-tune a 1024-token model on shorter blocks)."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in 1..{self.config.block_size}, got {block_size}")
        self.config.block_size = block_size
        if "wpe" in self.transformer:  # RoPE's tables only ever get read below block_size
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])


# ----------------------------------------------------------------------------------------------
# What this machine can run: `python model.py`


def attention_report(device=None) -> dict:
    """Versions, GPU, and for each backend whether it trains here and why not; what auto picks per dtype
    at T=1024 (auto) and T=32768 (auto_long), from the table or the default order (not measured)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(device)
    train_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "capability": "sm{}{}".format(*capability) if capability else None,
        "dtype": dtype_name(train_dtype),
        "backends": {},
        "auto": {},
        "auto_long": {},
    }
    for name, backend in BACKENDS.items():
        problem = backend.problem(Need(device, train_dtype, training=True))
        kernel = backend.kernel
        version = kernel.package().version if isinstance(kernel, FlashAttention) else torch.__version__
        report["backends"][name] = {"available": not problem, "version": version, "why": problem}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for key, seq_len in (("auto", 1024), ("auto_long", 32768)):
            report[key][dtype_name(dtype)] = resolve("auto", Need(device, dtype, seq_len=seq_len)).used
    return report


def main():
    report = attention_report()
    gpu = f"{report['gpu']} ({report['capability']})" if report["gpu"] else "none"
    print(f"torch {report['torch']} | CUDA {report['cuda']} | cuDNN {report['cudnn']} | GPU {gpu}")
    print(f"device {report['device']}, training dtype {report['dtype']}:")
    for name, row in report["backends"].items():
        status = "available" if row["available"] else "unavailable"
        version = f" {row['version']}" if row["version"] else ""
        print(f"  {name:<15} {status:<12}{version:<14} {row['why']}")
    for key, length in (("auto", "1024"), ("auto_long", "32768")):
        picks = ", ".join(f"{dtype} -> {used}" for dtype, used in report[key].items())
        print(f"  auto picks at T={length}: {picks}")


if __name__ == "__main__":
    main()
