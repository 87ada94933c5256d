"""
Generation: prompts of any lengths read once (prefill), then one token per step (decode) from a KV cache
(kv_cache.py), with its own resolved attention: the model's training choice is never touched.

    from generation import generate, stream
    out = generate(model, idx, 100, temperature=0.8, top_k=200)           # (B, T + 100); KV cache, eager
    for tokens in stream(model, prompts, 100, kv_cache="paged", compile=True): ...   # (B,) per step
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.nn import functional as F
from torch.nn.attention import sdpa_kernel

from errors import NonFiniteLogits
from generation.kv_cache import (
    _DECODE_SDPA_KERNELS,
    DECODE_KERNELS,
    KV_CACHES,
    CacheMask,
    ContiguousKVCache,
    DecodeKernel,
    KVCache,
    PagedKVCache,
    decode_order,
    log,
)
from model import BACKENDS, GPT, Attention, attention_for, log_resolution, resolve

SLIDES = ("exact", "half")  # what generation reads once a sequence reaches block_size (stream's slide)


def forward_cached(model: GPT, idx, step: CacheMask, attends: Sequence[Callable]) -> torch.Tensor:
    """Logits (B, vocab) at each row's newest token: idx (B, T) sits at positions step.q_pos, continuing each
    sequence in its cache, and layer i attends through attends[i]."""
    x, rope = model.embed(idx, step.q_pos)
    for block, attend in zip(model.transformer.h, attends):
        x = block(x, attend, step, rope)
    x = x[torch.arange(idx.size(0), device=idx.device), step.last]  # (B, C): the rest works per token
    return model.lm_head(model.transformer.ln_f(x))


def generation_attention(model: GPT, use) -> tuple[Attention, DecodeKernel | None]:
    """The backend generation runs for `use` (auto: the decode order for a KV cache), its decode kernel, and
    the INFO line saying so. paged_attention runs auto's pick for a paged cache under it. Under auto, when the
    decode pick is flex or manual, prompts are read (prefill) with auto's pick for a forward."""
    config = model.config
    order = decode_order(use) if use.kv_cache != "none" else None
    attention = attention_for(config, use, model.logged_lines, order)
    used, detail = attention.resolution.used, ""
    if used == "paged_attention":
        used = resolve("auto", use, order).used
        attention = attention._replace(kernel=BACKENDS[used].kernel)
        detail = f" over {used} (auto's pick for a paged cache)"
    decode = DECODE_KERNELS.get(used)
    if decode is None and use.kv_cache != "none":  # a backend registered without a decode kernel of its own
        decode = DECODE_KERNELS["sdpa"]
        detail += ", decoding from the cache with sdpa's kernel (it has none of its own)"
    if use.kv_cache == "paged":
        detail += f", paged KV cache: {decode.pages}"
    elif use.kv_cache == "contiguous":
        detail += ", contiguous KV cache"
    if config.attention_backend in ("auto", "paged_attention") and used in ("flex_attention", "manual"):
        # A prompt (and a slide's window) is read as a forward of many queries reads it: flex would recompile for
        # each new length, and manual is O(T^2). flash-attn and SDPA read prompts well themselves.
        forward = attention_for(config, dataclasses.replace(use, kv_cache="none", decode_step="eager"), set())
        if forward.resolution.used != used:
            attention = attention._replace(kernel=forward.kernel)
            detail += f"; prompts read with {forward.resolution.used} (auto's pick for a forward)"
    log_resolution(config.attention_backend, attention, model.logged_lines, detail)
    return attention, decode


@torch.no_grad()
def generate(model: GPT, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, **options):
    """Sample max_new_tokens tokens after idx: a (B, T) tensor gives (B, T + max_new_tokens); a list of 1-D
    prompts of different lengths gives a list, each prompt followed by its new tokens. options: stream's."""
    prompts = list(idx)
    steps = list(stream(model, prompts, max_new_tokens, temperature, top_k, **options))
    new = torch.stack(steps, dim=1) if steps else prompts[0].new_zeros(len(prompts), 0)  # (B, new)
    if isinstance(idx, torch.Tensor):
        return torch.cat((idx, new.to(idx.dtype)), dim=1)
    return [torch.cat((prompt, row.to(prompt.dtype))) for prompt, row in zip(prompts, new)]


@torch.no_grad()
# Long for its docstring: it is the reference for every option of generation, which sample.py passes through.
def stream(
    model: GPT,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    kv_cache: str = "contiguous",
    compile: bool = False,
    cuda_graph: bool | None = None,
    vocab_size: int | None = None,
    page_size: int | None = None,
    slide: str = "exact",
) -> Iterator[torch.Tensor]:
    """Yield the next token of every prompt, (B,), max_new_tokens times.

    kv_cache: "contiguous" (preallocated), "paged" (pages allocated on demand; what
    attention_backend="paged_attention" means) or "none" (the whole context every step, as nanoGPT). compile: a
    static-shape decode step under torch.compile(mode="reduce-overhead"), CUDA graphs (elsewhere it runs eagerly).
    cuda_graph (None: on CUDA with a KV cache, unless compiled): the eager decode step and the draw after it
    captured once as a CUDA graph (GraphedStep). Past block_size, slide="exact" re-reads each row's last
    block_size tokens every step (nanoGPT's tokens, a full forward a token); "half" re-reads the last
    block_size/2 once and decodes on from the cache until it is full again (the context then spans half to all
    of the window). temperature 0 is greedy; only ids below vocab_size are drawn; page_size overrides the
    kernel's. NonFiniteLogits once the tokens are out when any were drawn from NaN or inf logits (checked on the
    GPU each step, read once at the end)."""
    check_generation(max_new_tokens, temperature, top_k, kv_cache, compile, slide)
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("every prompt must be a non-empty 1-D tensor of token ids")
    if model.config.attention_backend == "paged_attention" and kv_cache == "contiguous":
        kv_cache = "paged"  # the backend names the cache layout
    device, longest = prompts[0].device, max(p.numel() for p in prompts)
    seq_len = min(model.config.block_size, longest + max_new_tokens)
    decode_step = decode_step_for(device, kv_cache, compile, cuda_graph)
    use = model.attention_use(
        device, model.compute_dtype(device), training=False, seq_len=seq_len, kv_cache=kv_cache, decode_step=decode_step
    )
    attention, decode = generation_attention(model, use)
    generation = Generation(
        model,
        prompts,
        max_new_tokens,
        attention,
        decode,
        kv_cache,
        functools.partial(next_token, temperature=temperature, top_k=top_k, vocab_size=vocab_size),
        decode_step=decode_step,
        page_size=page_size,
        slide=slide,
    )
    yield from itertools.islice(generation, max_new_tokens)  # no step past the last
    generation.check_finite()


# ----------------------------------------------------------------------------------------------
# Sampling and the generation loop


def decode_step_for(device: torch.device, kv_cache: str, compile: bool, cuda_graph: bool | None = None) -> str:
    """How stream runs a decode step (AttentionUse.decode_step): compiled, graph (by default on CUDA with a KV cache,
    unless compiled) or eager."""
    if compile:
        return "compiled"
    graph = device.type == "cuda" and kv_cache != "none" and cuda_graph is not False
    return "graph" if graph else "eager"


def check_generation(max_new_tokens, temperature, top_k, kv_cache: str, compile: bool, slide: str = "exact"):
    """ValueError with a clear message for a setting generation cannot use."""
    if slide not in SLIDES:
        raise ValueError(f"unknown slide {slide!r}; choose one of {', '.join(SLIDES)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not math.isfinite(temperature):  # inf would divide every logit to 0 (uniform noise), nan to nan
        raise ValueError(f"temperature must be >= 0 (0 is greedy) and finite, got {temperature}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
    if compile and kv_cache == "none":
        raise ValueError("compile compiles the decode step over a KV cache; it needs kv_cache contiguous or paged")


def next_token(
    logits, temperature: float, top_k: int | None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) ids drawn from logits (B, V), only below vocab_size (a padded vocabulary's extra ids decode to
    nothing), and a 0-dim bool: whether any logit was NaN or inf. temperature 0 takes the likeliest. Nothing here
    waits for the GPU, so the host runs ahead and a CUDA graph can hold it."""
    logits = logits[:, :vocab_size].float()
    nonfinite = ~logits.isfinite().all()
    if temperature == 0:
        return logits.argmax(dim=-1), nonfinite
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))  # not logits[mask] = ...: that syncs the host
    probs = F.softmax(logits, dim=-1)
    # torch.multinomial's own draw for one sample, the same ids for the same seed, without its two host syncs
    # (checks on probs, which the nonfinite flag replaces)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1), nonfinite


class Generation:
    """One generate call: the tokens so far, the cache and how a step runs. Iterating yields each row's next
    token, (B,), drawn from the step's logits by `draw` (next_token's signature, less the settings)."""

    def __init__(
        self,
        model,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        attention: Attention,
        decode: DecodeKernel | None,
        kv_cache: str,
        draw: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        *,
        decode_step: str = "eager",
        page_size: int | None = None,
        slide: str = "exact",
    ):
        config, device = model.config, prompts[0].device
        # past block_size: re-read the last block_size tokens every step (exact), or the last half and decode on
        self.keep = config.block_size if slide == "exact" else max(1, config.block_size // 2)
        self.model, self.block_size = model, config.block_size
        self.counts = [p.numel() for p in prompts]  # tokens per row so far, on the host
        B, self.longest = len(prompts), max(self.counts)
        # room for every new token up to 2*block_size of them; past that, compact() keeps each row's last window
        room = min(max_new_tokens, 2 * config.block_size)
        self.tokens = torch.zeros(B, self.longest + room, dtype=torch.long, device=device)
        for b, prompt in enumerate(prompts):
            self.tokens[b, : prompt.numel()] = prompt
        self.rows, self.ends = torch.arange(B, device=device), torch.tensor(self.counts, device=device)
        self.newest = None  # (B, 1) the tokens added last, which the next decode step feeds
        self.draw, self.nonfinite = draw, torch.zeros((), dtype=torch.bool, device=device)
        self.cache = None
        if kv_cache == "none":
            kernel = attention.kernel
            self.attends = [lambda q, k, v, step, p: kernel(q, k, v, step.chunk_mask, p)] * config.n_layer
        else:
            dtype, static = model.compute_dtype(device), decode_step != "eager"
            self.cache = make_cache(config, prompts, max_new_tokens, kv_cache, decode, device, dtype, static, page_size)
            self.attends = self.cache.attends(attention.kernel, decode.run)
        self.decode = self.fast_decode(device, decode_step)

    def fast_decode(self, device: torch.device, decode_step: str) -> Callable | None:
        """(tokens, positions) -> the next tokens and the nonfinite flag, over the static decode step (decode_step,
        from decode_step_for): compiled (the draw after it), or captured with the draw as one CUDA graph; None:
        decode steps run eagerly."""
        if decode_step == "compiled":
            if device.type == "cuda":  # CUDA graphs read these in place; a new call's cache re-records, not recompiles
                for tensor in self.cache.static_tensors():
                    torch._dynamo.mark_static_address(tensor, guard=False)
            step = compile_step(self.decode_static, device)
            return lambda tokens, positions: self.draw(step(tokens, positions))
        if decode_step == "graph":  # on CUDA with a cache only (decode_step_for)
            return GraphedStep(lambda tokens, positions: self.draw(self.decode_static(tokens, positions)), device)
        return None

    def __iter__(self) -> Iterator[torch.Tensor]:
        tokens, nonfinite = self.draw(self.prefill())
        while True:
            self.add(tokens, nonfinite)
            yield tokens
            if self.cache is None or max(self.cache.host_lengths) >= self.block_size:
                tokens, nonfinite = self.draw(self.prefill(self.keep))  # no cache, or a full one: the last tokens again
            elif self.decode is not None:
                self.cache.reserve([n + 1 for n in self.cache.host_lengths])
                tokens, nonfinite = self.decode(self.newest, self.cache.lengths)
                self.cache.advance(1)
            else:
                logits = forward_cached(self.model, self.newest, self.cache.extend(1), self.attends)
                tokens, nonfinite = self.draw(logits)

    def add(self, tokens: torch.Tensor, nonfinite: torch.Tensor):
        """Append (B,) tokens, one per row, and whether their logits held NaN or inf."""
        if self.longest == self.tokens.size(1):
            self.compact()
        self.longest += 1
        self.tokens[self.rows, self.ends] = tokens
        self.ends += 1
        self.counts = [n + 1 for n in self.counts]
        self.newest = tokens[:, None]
        self.nonfinite |= nonfinite

    def compact(self):
        """Move each row's last block_size tokens (all a window reads) to the buffer's start: the buffer never
        grows with max_new_tokens (the caller keeps what it yields)."""
        keep = [min(n, self.block_size) for n in self.counts]
        starts = torch.tensor([n - k for n, k in zip(self.counts, keep)], device=self.tokens.device)
        index = torch.minimum(starts[:, None] + torch.arange(max(keep), device=starts.device), self.ends[:, None] - 1)
        self.tokens[:, : max(keep)] = self.tokens.gather(1, index)  # (B, max(keep)); a short row repeats its last
        self.counts, self.longest = keep, max(keep)
        self.ends = torch.tensor(keep, device=self.tokens.device)

    def check_finite(self):
        """NonFiniteLogits when any token so far was drawn from NaN or inf logits (the one wait for the GPU)."""
        if self.nonfinite.item():
            raise NonFiniteLogits("the model's logits are not finite (NaN or inf): the tokens drawn are not samples")

    def prefill(self, window: int | None = None) -> torch.Tensor:
        """Run each row's last `window` (default block_size) tokens, right-padded to the longest, into an empty
        cache."""
        windows = [min(n, window or self.block_size) for n in self.counts]
        T = max(windows)
        starts = torch.tensor([n - w for n, w in zip(self.counts, windows)], device=self.tokens.device)
        index = torch.minimum(starts[:, None] + torch.arange(T, device=starts.device), self.ends[:, None] - 1)
        idx = self.tokens.gather(1, index)  # (B, T): padding repeats a row's last token, never read
        if self.cache is None:  # each step a new length, for which cuDNN's SDPA kernel would build a new plan
            with sdpa_kernel(_DECODE_SDPA_KERNELS):
                return forward_cached(self.model, idx, CacheMask.chunk(windows, T, idx.device), self.attends)
        return forward_cached(self.model, idx, self.cache.prefill(windows, T), self.attends)

    def decode_static(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row over the whole capacity: the same shapes every step (what torch.compile captures)."""
        return forward_cached(self.model, tokens, CacheMask.decoding(positions, self.cache.capacity), self.attends)


class GraphedStep:
    """The static decode step captured once as a CUDA graph and replayed: a step's hundreds of small kernels
    launch as one, which is what decoding a small batch is bound by (what compile's reduce-overhead mode does,
    without the compile). The cache stays where it is, so the graph reads and writes it in place; the inputs are
    copied into the graph's own buffers, and the outputs copied out (the next replay overwrites them)."""

    def __init__(self, step: Callable, device: torch.device):
        self.step, self.device, self.graph = step, device, None

    def capture(self, tokens: torch.Tensor, positions: torch.Tensor):
        self.tokens, self.positions = tokens.clone(), positions.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisations stay out of the graph
            for _ in range(2):
                self.step(self.tokens, self.positions)  # writes this step's keys and values: the same again below
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(self.graph):  # random draws replay with fresh numbers (RNG offsets)
            self.outputs = self.step(self.tokens, self.positions)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            self.capture(tokens, positions)
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return tuple(output.clone() for output in self.outputs)


@contextlib.contextmanager
def no_collection():
    """No garbage collection inside the block, what is garbage collected first: an earlier generation's graph
    (held in a reference cycle) freed by a collection during a capture would invalidate the capture."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_step(step: Callable, device: torch.device) -> Callable:
    """The static decode step under torch.compile with CUDA graphs (gpt-fast's approach); eager elsewhere."""
    if device.type != "cuda":
        log.info(f"compile: CUDA graphs need a CUDA device; the static decode step runs eagerly on {device.type}")
        return step
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)


def make_cache(
    config, prompts, max_new_tokens, kind, decode: DecodeKernel, device, dtype, static=False, page_size=None
) -> KVCache:
    """A cache for these prompts: capacity for the longest sequence generation can reach (block_size at most);
    a paged pool with exactly the pages all rows together can need."""
    lengths = [min(p.numel() + max_new_tokens, config.block_size) for p in prompts]
    shape = (config.n_layer, len(prompts), max(lengths), config.kv_heads, config.head_dim, dtype, device)
    if kind == "contiguous":
        return ContiguousKVCache(*shape, static=static)
    page_size = page_size or decode.page_size
    num_pages = sum(-(-n // page_size) for n in lengths)
    return PagedKVCache(*shape, page_size=page_size, num_pages=num_pages, static=static)
