"""
Generation's KV caches and the attention kernels that read them; the prefill/decode loop that drives them is
generation/loop.py.

Generation reads the prompt once (prefill), then feeds one token per step (decode). Each layer keeps the keys
and values it has computed, so a decode step computes only the new token's. Two layouts:

- ContiguousKVCache: per layer (B, H, capacity, D), preallocated; sequence b's keys in slots [0, length_b).
- PagedKVCache: per layer a pool of fixed-size pages (num_pages, page_size, H, D); each sequence has a block
  table (its pages in order), filled from a free list as it grows, so prompts of different lengths hold only
  the pages they need.

H is the model's key/value heads (n_kv_head): with grouped query heads (GQA, MQA) the cache is n_head/n_kv_head
times smaller, and every decode kernel reads it as it is, each group of query heads sharing one cached head.

Every sequence has its own length, so prompts of different lengths share a batch without padding in the cache:
row b's next token sits at position length_b (its position embedding too) and sees keys [0, length_b].
Attention over a cache is causal aligned to the end of the cache (bottom-right), whatever the number of new
tokens; a `CacheMask`, built once per forward and read by every layer as AttentionMask is in training, gives each
new token's position. A prefill into an empty cache is plain causal attention over the chunk: the backend's
own kernel runs it, as in training.

Decode kernels share one signature, (q, cache, layer, step) -> y on (B, H, T, D), one per backend of model.py:
sdpa and manual read a dense view (a paged cache's pages gathered into it); flex_attention reads the cache in
place through a BlockMask over its blocks or pages (the technique of torch's experimental
torch.nn.attention.experimental._paged_attention, written here against the public BlockMask API); flash-attn
calls flash_attn_with_kvcache, with a block table for pages.

Fast decode (compile=True): a static decode step reads every slot up to the capacity, masked, so its shapes
never change and torch.compile(mode="reduce-overhead") replays it as CUDA graphs (gpt-fast's approach); on a
CPU the same static step runs eagerly.

At block_size the model has no position left for a sequence's next token. Generation then slides: the whole
batch is prefilled again from the last block_size tokens of each sequence, which is exactly what the uncached
model reads, so the tokens match kv_cache="none"; from there on each step costs a full forward pass.
Nothing ever attends beyond block_size.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.auto import gpu_generation
from kernels.flash import FLASH_ATTN_3, FLASH_ATTN_4, FlashAttention
from kernels.flex import compiled_flex_attention
from model import FLASH_ATTN_2, AttentionBackend, AttentionMask, AttentionUse, FlashAttn2, register, repeat_kv, sdpa_kv

log = logging.getLogger("model")

KV_CACHES = ("none", "contiguous", "paged")
FLEX_BLOCK = 128  # flex_attention's default tile: the key block of a contiguous cache's BlockMask


# ----------------------------------------------------------------------------------------------
# One forward step over a cache


class CacheMask:
    """The mask of one forward step over a cache: where the step's tokens sit, for every layer. The new tokens
    of row b are at positions q_pos[b] (continuing its sequence) and each sees the keys at positions up to its own."""

    def __init__(
        self,
        q_pos: torch.Tensor,
        kv_len: torch.Tensor,
        span: int,
        *,
        fresh: bool = False,
        sees_all: bool = False,
        start: int | None = None,
        host_kv_len: Sequence[int] | None = None,
    ):
        self.q_pos = q_pos  # (B, T) long
        self.kv_len = kv_len  # (B,) long: keys each sequence holds once this step is written
        self.span = span  # key slots a dense kernel reads: the capacity when static, else the longest sequence
        self.fresh = fresh  # the cache held nothing before: plain causal attention within the chunk
        self.sees_all = sees_all  # every query sees all `span` keys: no mask needed
        self.start = start  # the position of every row's first new token, when all rows share it
        self.host_kv_len = host_kv_len  # kv_len on the host, where known without a sync
        self.last = kv_len - 1 - q_pos[:, 0]  # (B,) the chunk index of each row's newest real token
        self.chunk_mask = AttentionMask(q_pos.size(1), q_pos.device) if fresh else None
        self.memo: dict = {}  # forms a cache builds once per step for all layers (block masks, page slots)

    @classmethod
    def chunk(cls, lengths: Sequence[int], T: int, device) -> CacheMask:
        """T tokens per row from position 0, row b's first lengths[b] real (right padding after)."""
        q_pos = torch.arange(T, device=device).expand(len(lengths), T)
        kv_len = torch.tensor(lengths, device=device)
        return cls(q_pos, kv_len, max(lengths), fresh=True, start=0, host_kv_len=list(lengths))

    @classmethod
    def decoding(cls, positions: torch.Tensor, span: int) -> CacheMask:
        """One token per row at `positions` (B,), keys read over all `span` slots: static shapes."""
        return cls(positions[:, None], positions + 1, span)

    def dense(self) -> torch.Tensor:
        """(B, 1, T, span) bool, True where a query may see a key slot."""
        if "dense" not in self.memo:
            slots = torch.arange(self.span, device=self.q_pos.device)
            self.memo["dense"] = (slots <= self.q_pos[:, :, None])[:, None]
        return self.memo["dense"]

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """dense() as an additive mask in dtype, 0 where a query may see a key slot and -inf elsewhere, made once
        per step: a bool mask is converted again by every layer's kernel. Its rows start at multiples of 16
        slots, as SDPA's efficient kernel reads a mask without padding it first."""
        if ("bias", dtype) not in self.memo:
            B, T = self.q_pos.shape
            bias = torch.zeros(B, 1, T, -(-self.span // 16) * 16, dtype=dtype, device=self.q_pos.device)
            bias = bias[..., : self.span].masked_fill_(~self.dense(), float("-inf"))
            self.memo["bias", dtype] = bias
        return self.memo["bias", dtype]


# ----------------------------------------------------------------------------------------------
# The caches


class KVCache:
    """Keys and values of every layer for a batch of sequences, each with its own length.

    `attends()` gives one function per layer with the kernels' signature (the CacheMask in the mask's place): it
    writes the step's keys and values, then attends with the prefill kernel (fresh cache) or the decode kernel.
    `static`: decode steps read every slot up to the capacity, masked, so a step's shapes never change (for
    torch.compile with CUDA graphs)."""

    def __init__(self, n_layer, batch_size, capacity, n_kv_head, head_dim, dtype, device, *, static=False):
        self.n_layer, self.batch_size, self.capacity = n_layer, batch_size, capacity
        self.n_kv_head, self.head_dim, self.dtype = n_kv_head, head_dim, dtype
        self.device, self.static = torch.device(device), static
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.host_lengths = [0] * batch_size  # the same on the host: sizes and pages need no device sync
        self.prefill_kernel: Callable | None = None
        self.decode_kernel: Callable | None = None

    def attends(self, prefill_kernel: Callable, decode_kernel: Callable) -> list[Callable]:
        self.prefill_kernel, self.decode_kernel = prefill_kernel, decode_kernel
        return [functools.partial(self.attend, layer) for layer in range(self.n_layer)]

    def attend(self, layer: int, q, k, v, step: CacheMask, dropout_p: float = 0.0):
        self.write(layer, k.to(self.dtype), v.to(self.dtype), step)
        if step.fresh:
            return self.prefill_kernel(q, k, v, step.chunk_mask, 0.0)
        return self.decode_kernel(q, self, layer, step)

    def static_tensors(self) -> list[torch.Tensor]:
        """Tensors whose address must stay fixed for CUDA graphs (torch._dynamo.mark_static_address)."""
        return [*self.k, *self.v]

    # -- steps: each reserves room, moves the lengths on and says where the new tokens go --

    def prefill(self, lengths: Sequence[int], T: int) -> CacheMask:
        """Empty the cache for a chunk of T tokens per row, of which row b's first lengths[b] are real."""
        self._check(lengths)
        self.clear()
        self.reserve(lengths)
        self.lengths.copy_(torch.tensor(lengths))
        self.host_lengths = list(lengths)
        return CacheMask.chunk(lengths, T, self.device)

    def extend(self, T: int = 1) -> CacheMask:
        """T new tokens on every row (a decode step when T is 1)."""
        new = [n + T for n in self.host_lengths]
        self._check(new)
        self.reserve(new)
        q_pos = self.lengths[:, None] + torch.arange(T, device=self.device)
        uniform = len(set(self.host_lengths)) == 1 and not self.static
        span = self.capacity if self.static else max(new)
        step = CacheMask(
            q_pos,
            self.lengths + T,
            span,
            sees_all=not self.static and T == 1 and min(new) == span,
            start=self.host_lengths[0] if uniform else None,
            host_kv_len=new,
        )
        self.advance(T)
        return step

    def advance(self, T: int):
        self.lengths += T
        self.host_lengths = [n + T for n in self.host_lengths]

    def _check(self, lengths: Sequence[int]):
        if max(lengths) > self.capacity:
            raise ValueError(f"a sequence of {max(lengths)} tokens does not fit this cache of {self.capacity}")

    def clear(self):
        self.lengths.zero_()
        self.host_lengths = [0] * self.batch_size

    def reserve(self, lengths: Sequence[int]):
        """Make room for `lengths` keys per sequence (a paged cache allocates pages here)."""


class ContiguousKVCache(KVCache):
    """Per layer (B, H, capacity, D) keys and values, preallocated (as gpt-fast does)."""

    def __init__(self, n_layer, batch_size, capacity, n_kv_head, head_dim, dtype, device, *, static=False):
        super().__init__(n_layer, batch_size, capacity, n_kv_head, head_dim, dtype, device, static=static)
        shape = (batch_size, n_kv_head, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layer)]

    def write(self, layer: int, k, v, step: CacheMask):
        T = k.size(2)
        if step.start is not None:  # every row writes the same slots (padding of a prefill included: masked)
            self.k[layer][:, :, step.start : step.start + T] = k
            self.v[layer][:, :, step.start : step.start + T] = v
        else:
            if "rows" not in step.memo:
                step.memo["rows"] = torch.arange(self.batch_size, device=self.device)[:, None]
            rows = step.memo["rows"]
            self.k[layer][rows, :, step.q_pos] = k.transpose(1, 2)  # indexed (B, T, H, D)
            self.v[layer][rows, :, step.q_pos] = v.transpose(1, 2)

    def dense_kv(self, layer: int, step: CacheMask):
        """(B, H, span, D) keys and values: views of the cache."""
        return self.k[layer][:, :, : step.span], self.v[layer][:, :, : step.span]

    def flex_kv(self, layer: int, step: CacheMask):
        return self.k[layer], self.v[layer]

    def flex_block_mask(self, step: CacheMask, heads: int):
        """Every key block of the capacity, read up to each row's length; mask_mod is the bottom-right causal.
        Per head, not broadcast over heads: see kernels/flex.py's block_mask for why."""
        from torch.nn.attention.flex_attention import BlockMask

        B, T = step.q_pos.shape
        q_blocks, kv_blocks = -(-T // FLEX_BLOCK), -(-self.capacity // FLEX_BLOCK)
        indices = torch.arange(kv_blocks, device=self.device, dtype=torch.int32).expand(B, heads, q_blocks, kv_blocks)
        count = ((step.kv_len + FLEX_BLOCK - 1) // FLEX_BLOCK).to(torch.int32)
        return BlockMask.from_kv_blocks(
            count[:, None, None].expand(B, heads, q_blocks).contiguous(),
            indices.contiguous(),
            BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
            mask_mod=_up_to_position(step.q_pos),
            seq_lengths=(T, self.capacity),
        )

    def flash_kv(self, layer: int):
        """flash-attn's (B, S, H, D) layout: views of the (B, H, S, D) cache."""
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2), None


def _up_to_position(q_pos):
    def mask_mod(b, h, q, kv):  # one code object for every step, so compiled flex is not recompiled
        return kv <= q_pos[b, q]

    return mask_mod


class PagedKVCache(KVCache):
    """Per layer a pool (num_pages, page_size, H, D) of keys and one of values (flash-attn's paged layout).

    Sequence b's position t lives in page block_table[b, t // page_size] at offset t % page_size. Pages come
    from a free list as a sequence grows (`reserve`) and go back when the cache is cleared."""

    def __init__(
        self, n_layer, batch_size, capacity, n_kv_head, head_dim, dtype, device, *, page_size, num_pages, static=False
    ):
        super().__init__(n_layer, batch_size, capacity, n_kv_head, head_dim, dtype, device, static=static)
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages = -(-capacity // page_size)  # per sequence
        shape = (num_pages, page_size, n_kv_head, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layer)]
        # Unused entries point at page 0: every kernel reads a row's table only up to its length
        self.block_table = torch.zeros(batch_size, self.max_pages, dtype=torch.int32, device=self.device)
        # Each page's sequence (-1: free) and its index in that sequence, for flex's mask over physical slots
        self.page_owner = torch.full((num_pages,), -1, dtype=torch.long, device=self.device)
        self.page_index = torch.zeros(num_pages, dtype=torch.long, device=self.device)
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]

    def static_tensors(self):
        return [*self.k, *self.v, self.block_table, self.page_owner, self.page_index]

    def reserve(self, lengths):
        rows, indices, pages = [], [], []
        for b, length in enumerate(lengths):
            while len(self.pages[b]) * self.page_size < length:
                if not self.free:
                    raise RuntimeError(
                        f"paged KV cache out of pages: all {self.num_pages} pages of {self.page_size} tokens are in use"
                    )
                page = self.free.pop()
                rows.append(b)
                indices.append(len(self.pages[b]))
                pages.append(page)
                self.pages[b].append(page)
        if pages:  # one small copy per new page batch, not per step
            rows_t, indices_t, pages_t = (torch.tensor(x, device=self.device) for x in (rows, indices, pages))
            self.block_table[rows_t, indices_t] = pages_t.to(torch.int32)
            self.page_owner[pages_t] = rows_t
            self.page_index[pages_t] = indices_t

    def clear(self):
        super().clear()
        for row in self.pages:
            self.free.extend(reversed(row))
        self.pages = [[] for _ in range(self.batch_size)]
        self.page_owner.fill_(-1)

    def in_use(self) -> int:
        return self.num_pages - len(self.free)

    def slots(self, step: CacheMask) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the pool slot of each new token to write, which of the chunk's B*T tokens they are; None: all)."""
        if "slots" not in step.memo:
            pages = self.block_table.gather(1, step.q_pos // self.page_size).long()
            slots = (pages * self.page_size + step.q_pos % self.page_size).flatten()  # (B*T,)
            which = None
            if step.fresh and min(step.host_kv_len) < step.q_pos.size(1):  # right padding: write real tokens only
                which = (step.q_pos < step.kv_len[:, None]).flatten().nonzero().flatten()
                slots = slots[which]
            step.memo["slots"] = (slots, which)
        return step.memo["slots"]

    def write(self, layer: int, k, v, step: CacheMask):
        slots, which = self.slots(step)
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            new = new.transpose(1, 2).reshape(-1, self.n_kv_head, self.head_dim)  # (B*T, H, D)
            pool.view(-1, self.n_kv_head, self.head_dim)[slots] = new if which is None else new[which]

    def dense_kv(self, layer: int, step: CacheMask):
        """(B, H, span, D) keys and values: the pages of each row gathered, in order, into a copy."""
        pages = self.block_table[:, : -(-step.span // self.page_size)].long()  # (B, n)
        B = pages.size(0)
        return tuple(
            pool[pages].reshape(B, -1, self.n_kv_head, self.head_dim)[:, : step.span].transpose(1, 2)
            for pool in (self.k[layer], self.v[layer])
        )

    def flex_kv(self, layer: int, step: CacheMask):
        """The pools as one (1, H, num_pages * page_size, D) sequence of physical slots: a view, no copy."""
        return tuple(
            pool.view(-1, self.n_kv_head, self.head_dim).permute(1, 0, 2)[None]
            for pool in (self.k[layer], self.v[layer])
        )

    def flex_block_mask(self, step: CacheMask, heads: int):
        """Row b reads its own pages (block_table) up to its length; mask_mod maps a physical slot back to its
        position for the bottom-right causal (and refuses other rows' pages, which eager flex would read). Per
        head, not broadcast over heads: see kernels/flex.py's block_mask for why."""
        from torch.nn.attention.flex_attention import BlockMask

        B, T = step.q_pos.shape
        q_blocks = -(-T // FLEX_BLOCK)
        indices = torch.zeros(B, heads, q_blocks, self.num_pages, dtype=torch.int32, device=self.device)
        indices[..., : self.max_pages] = self.block_table[:, None, None]
        count = ((step.kv_len + self.page_size - 1) // self.page_size).to(torch.int32)
        return BlockMask.from_kv_blocks(
            count[:, None, None].expand(B, heads, q_blocks).contiguous(),
            indices,
            BLOCK_SIZE=(FLEX_BLOCK, self.page_size),
            mask_mod=_paged_up_to_position(step.q_pos, self.page_owner, self.page_index, self.page_size),
            seq_lengths=(T, self.num_pages * self.page_size),
        )

    def flash_kv(self, layer: int):
        return self.k[layer], self.v[layer], self.block_table


def _paged_up_to_position(q_pos, page_owner, page_index, page_size: int):
    def mask_mod(b, h, q, kv):
        page = kv // page_size
        position = page_index[page] * page_size + kv % page_size
        return (page_owner[page] == b) & (position <= q_pos[b, q])

    return mask_mod


# ----------------------------------------------------------------------------------------------
# Decode kernels: (q, cache, layer, step) -> y, one per backend (DECODE_KERNELS names them by backend)


class DecodeKernel(NamedTuple):
    run: Callable  # (q, cache, layer, step) -> y on (B, H, T, D)
    page_size: int  # a paged cache's default page size for this kernel
    pages: str  # how it reads a paged cache, for the INFO line


# Not cuDNN's kernel: it builds a new plan for every key length, and a decode step's keys grow by one each step
_DECODE_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_decode(q, cache: KVCache, layer: int, step: CacheMask):
    k, v = cache.dense_kv(layer, step)
    # A one-token step that sees every slot needs no mask (is_causal would align top-left: wrong for T < S)
    attn_mask = None if step.sees_all else step.bias(q.dtype)
    k, v, gqa = sdpa_kv(q, k, v, attn_mask)
    with sdpa_kernel(_DECODE_SDPA_KERNELS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **gqa)


def manual_decode(q, cache: KVCache, layer: int, step: CacheMask):
    """manual_attention's math over the dense view in 5 kernels a layer, not 8: the scale and the mask are one
    add onto the step's float32 additive mask."""
    k, v = repeat_kv(q, *cache.dense_kv(layer, step))
    scores = torch.add(step.bias(torch.float32), q @ k.transpose(-2, -1), alpha=1.0 / math.sqrt(q.size(-1)))
    return F.softmax(scores, dim=-1).to(v.dtype) @ v


def flex_decode(q, cache: KVCache, layer: int, step: CacheMask):
    from torch.nn.attention.flex_attention import flex_attention as flex

    if "flex" not in step.memo:
        step.memo["flex"] = cache.flex_block_mask(step, q.size(1))
    k, v = cache.flex_kv(layer, step)
    run = flex if torch.compiler.is_compiling() else compiled_flex_attention()
    return run(q, k, v, block_mask=step.memo["flex"], enable_gqa=k.size(1) != q.size(1))


class FlashDecode:
    """flash_attn_with_kvcache of a flash-attn package: the cache read in place (a block table for pages),
    causal aligned bottom-right by the kernel itself. Called through a PyTorch custom op, so a compiled decode
    step keeps one graph (the package calls its extension directly, which dynamo cannot trace)."""

    def __init__(self, kernel: FlashAttn2 | FlashAttention):
        self.kernel, self.index = kernel, len(_FLASH_KERNELS)
        _FLASH_KERNELS.append(kernel)

    def __call__(self, q, cache: KVCache, layer: int, step: CacheMask):
        if "seqlens" not in step.memo:
            step.memo["seqlens"] = step.kv_len.to(torch.int32)
        k_cache, v_cache, table = cache.flash_kv(layer)
        y = flash_with_kvcache(q.transpose(1, 2), k_cache, v_cache, step.memo["seqlens"], table, self.index)
        return y.transpose(1, 2)


_FLASH_KERNELS: list[FlashAttn2 | FlashAttention] = []  # the kernels flash_with_kvcache calls, by FlashDecode.index


@torch.library.custom_op("gpt_kv_cache::flash_with_kvcache", mutates_args=())
def flash_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    table: torch.Tensor | None,
    kernel: int,
) -> torch.Tensor:
    """(B, T, H, D) attention of q over the cache through a flash-attn package's flash_attn_with_kvcache; the
    package is read at each call, as the flash kernels do."""
    function = flash_module(_FLASH_KERNELS[kernel]).flash_attn_with_kvcache
    extra = {} if table is None else {_table_keyword(function): table}
    y = function(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True, **extra)
    return (y[0] if isinstance(y, tuple) else y).contiguous()


def flash_module(kernel: FlashAttn2 | FlashAttention):
    kernel.load()  # imported already by the kernel's first check, which resolving a backend runs
    return kernel.module


@flash_with_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, table, kernel):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@functools.cache
def _table_keyword(function) -> str:
    """flash-attn 2 names the page table block_table, flash-attn 3 page_table."""
    return "page_table" if "page_table" in inspect.signature(function).parameters else "block_table"


IN_PLACE = "reads the pages in place"
GATHERED = "gathers the pages into a contiguous copy each step ({} reads no block table)"
SDPA_DECODE = DecodeKernel(sdpa_decode, 16, GATHERED.format("SDPA"))
MANUAL_DECODE = DecodeKernel(manual_decode, 16, GATHERED.format("manual"))
FLEX_DECODE = DecodeKernel(flex_decode, FLEX_BLOCK, IN_PLACE)  # a page is one key block of flex's tile


def flash_decode(kernel: FlashAttn2 | FlashAttention) -> DecodeKernel:
    return DecodeKernel(FlashDecode(kernel), 256, IN_PLACE)  # flash-attn 2 takes pages of a multiple of 256


DECODE_KERNELS = {
    "flash_attn_4": flash_decode(FLASH_ATTN_4),
    "flash_attn_3": flash_decode(FLASH_ATTN_3),
    "flash_attn_2": flash_decode(FLASH_ATTN_2),
    "flex_attention": FLEX_DECODE,
    "sdpa": SDPA_DECODE,
    "manual": MANUAL_DECODE,
}

# auto's order for decoding from a KV cache, by how the decode step runs (AttentionUse.decode_step). Eager: the fewest
# launches per step first (flash-attn's flash_attn_with_kvcache reads the cache, pages included, in place), SDPA
# before flex, whose eager calls cost more host time. A CUDA graph (sample.py's default; no launch cost): flash-attn,
# then manual, whose one-query kernels beat SDPA's efficient kernel (made for many queries); flex last, as its
# kernel's compile took 7 s on a fresh machine (bench/results/h100-sampling.md). Compiled: flex_attention skips
# the cache's empty key blocks and manual's one-query scores fuse into Triton kernels, both ahead of flash-attn's
# and SDPA's kernels (bench/results/h100-generate-compiled.md).
DECODE_ORDER = {
    ("cuda", "contiguous", "eager"): ("flash_attn_3", "flash_attn_2", "sdpa", "flex_attention", "manual"),
    ("cuda", "paged", "eager"): ("flash_attn_3", "flash_attn_2", "flex_attention", "sdpa", "manual"),
    ("cuda", "contiguous", "graph"): ("flash_attn_3", "flash_attn_2", "manual", "sdpa", "flex_attention"),
    ("cuda", "paged", "graph"): ("flash_attn_3", "flash_attn_2", "manual", "sdpa", "flex_attention"),
    ("cuda", "contiguous", "compiled"): ("flex_attention", "manual", "flash_attn_3", "flash_attn_2", "sdpa"),
    ("cuda", "paged", "compiled"): ("flex_attention", "flash_attn_3", "flash_attn_2", "manual", "sdpa"),
    ("other", "contiguous", "eager"): ("sdpa", "manual"),
    ("other", "paged", "eager"): ("sdpa", "manual"),
}
DECODE_STEPS = ("eager", "graph", "compiled")


def decode_order(use: AttentionUse) -> tuple[tuple[str, ...], str]:
    """auto's order for decoding from use.kv_cache (a graphed or compiled step: on CUDA only)."""
    generation = gpu_generation(use.device)[0]
    step = use.decode_step if generation == "cuda" else "eager"  # elsewhere a static step runs eagerly
    return DECODE_ORDER[(generation, use.kv_cache, step)], f"{'' if step == 'eager' else step + ' '}decode order"


def why_not_paged(use: AttentionUse) -> str:
    """paged_attention is a cache layout for generation, not a kernel of its own."""
    if use.training:
        return "paged_attention is a paged KV cache for generation; it cannot train"
    if use.kv_cache != "paged":
        return "paged_attention needs a paged KV cache (generation with a KV cache); this use reads none"
    return ""


# A cache layout, not a kernel: generation under it runs auto's pick for a paged cache (generation/loop.py). It is
# a name attention_backend takes, so that a model can be configured to sample from a paged cache.
register(AttentionBackend("paged_attention", None, why_not_paged, "sdpa", ("paged", "paged_attn")))
