"""
auto's order on a GPU: a per-card table of measured lengths (config/attention_auto.json, fitted by
python -m bench.attention fit) from which a card's fastest backend goes first, and, for a card the table does not
know, a one-time timing of the candidates at setup (kernels.timing, cached on disk). Registered into model.py's
registry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.timing import median_ms
from model import BACKENDS, AttentionMask, AttentionUse, cuda_capability, dtype_name, register_auto_order
from storage.atomic import atomic_path

log = logging.getLogger("model")

AUTO_TABLE = Path(__file__).resolve().parent.parent / "config" / "attention_auto.json"
# Orders before any table: what the kernels' published speeds suggest, fastest first
AUTO_ORDER = {
    ("cuda", "sm100+", False): ("flash_attn_4", "sdpa", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm100+", True): ("flash_attn_4", "flex_attention", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "sm90", False): ("sdpa", "flash_attn_4", "flash_attn_3", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm90", True): ("flex_attention", "flash_attn_4", "flash_attn_3", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", False): ("flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", True): ("flash_attn_2", "flex_attention", "sdpa", "manual"),
    ("other", "", False): ("sdpa", "manual"),
    ("other", "", True): ("sdpa", "manual"),
}


def card_key(device: torch.device) -> str:
    """The table's key for a GPU: its compute capability, e.g. 'sm90' (cards of one generation rank the
    kernels alike); '' for a CPU or MPS device."""
    if device.type != "cuda":
        return ""
    return "sm{}{}".format(*cuda_capability(device))


def gpu_generation(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "other", ""
    capability = cuda_capability(device)
    return "cuda", "sm100+" if capability >= (10, 0) else "sm90" if capability >= (9, 0) else "older"


def read_auto_table(path: Path = AUTO_TABLE) -> dict:
    """{card: {"causal"|"documents": [[largest head dim, shortest T], ...]}}: from which length the card's
    `first` backend goes ahead of the default order. A missing or unreadable file is an empty table."""
    try:
        return json.loads(Path(path).read_text())["cards"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def auto_order(use: AttentionUse, measure: bool = False) -> tuple[tuple[str, ...], str]:
    """(the order auto tries, how it was chosen), registered as model.py's auto order. `measure`
    (setup_attention's, never forward's): on a GPU the table does not know, the candidates timed once."""
    measured = measure_unknown_card(use) if measure else None
    return measured or table_order(use)


def table_order(use: AttentionUse, table: dict | None = None) -> tuple[tuple[str, ...], str]:
    """On a card in the table, its `first` backend goes first from the measured length on; elsewhere the
    default order for the GPU generation."""
    order = AUTO_ORDER[(*gpu_generation(use.device), use.documents)]
    key = card_key(use.device)
    entry = (read_auto_table() if table is None else table).get(key)
    if not entry:
        return order, "default order"
    masking = "documents" if use.documents else "causal"
    start = next((t for d, t in entry.get(masking, []) if use.head_dim <= d), None)
    if start is None or use.seq_len < start:
        return order, f"table for {key}: T={use.seq_len} < {start}"
    first = entry["first"]
    return (first, *(name for name in order if name != first)), f"table for {key}: {first} from T={start}"


def auto_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "gpt-attention" / "auto.json"


def measure_key(use: AttentionUse, n_head: int) -> str:
    device = torch.cuda.get_device_name(use.device) if use.device.type == "cuda" else use.device.type
    masking = "documents" if use.documents else "causal"
    return (
        f"{device}|torch {torch.__version__}|{dtype_name(use.dtype)}|H{n_head} D{use.head_dim} "
        f"T{use.seq_len}|{masking}|{'train' if use.training else 'infer'}"
    )


def measured_order(
    candidates: dict[str, Callable], use: AttentionUse, n_head: int, cache_path: Path | None = None, tokens: int = 16384
) -> tuple[tuple[str, ...], str]:
    """The candidates fastest first, timed once for this card, torch, dtype and shape and cached on disk.

    Each runs (B, H, T, D) = (~16k tokens / T, n_head, seq_len, head_dim) forward (+ backward when
    training) on random inputs: a few milliseconds each, after its warm-up (flex compiles there).
    """
    cache_path = cache_path or auto_cache_path()
    key = measure_key(use, n_head)
    cache = _read_cache(cache_path)
    cached = cache.get(key)
    if isinstance(cached, dict) and set(cached) == set(candidates):
        return tuple(sorted(cached, key=cached.get)), "measured on this card earlier: " + _timings(cached)
    timings = {name: time_kernel(kernel, use, n_head, tokens) for name, kernel in candidates.items()}
    _write_cache(cache_path, {**cache, key: timings})
    return tuple(sorted(timings, key=timings.get)), "measured on this card: " + _timings(timings)


def _timings(timings: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(timings.items(), key=lambda item: item[1]))


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(cache, indent=1))
    except OSError as error:  # a read-only home still gets the measured choice, just not cached
        log.debug(f"could not cache auto's timings in {path}: {error}")


def time_kernel(kernel: Callable, use: AttentionUse, n_head: int, tokens: int = 16384) -> float:
    """Median milliseconds of one call (forward, + backward when training); inf if it fails (e.g. OOM)."""
    T = max(1, use.seq_len)
    shape = (max(1, tokens // T), n_head, T, use.head_dim)
    q, k, v = (torch.randn(shape, device=use.device, dtype=use.dtype, requires_grad=use.training) for _ in "qkv")
    doc_ids = torch.arange(T, device=use.device).div(max(1, T // 4), rounding_mode="floor").expand(shape[0], T)
    mask = AttentionMask(T, use.device, doc_ids if use.documents else None)

    def run():
        y = kernel(q, k, v, mask, 0.0)
        if use.training:
            y.sum().backward()

    try:
        with torch.no_grad() if not use.training else contextlib.nullcontext():
            # short: every candidate is timed at setup; the warm-up compiles flex
            return median_ms(run, use.device, (q, k, v) if use.training else (), warmup_ms=5, rep_ms=20)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        log.debug(f"auto: timing failed ({str(error).splitlines()[0]})")
        return math.inf


def measure_unknown_card(use: AttentionUse) -> tuple[tuple[str, ...], str] | None:
    """On a GPU the table does not know, the candidates that run, timed (measured_order); None elsewhere."""
    if use.device.type != "cuda" or card_key(use.device) in read_auto_table() or use.kv_cache != "none":
        return None
    runs = {n: BACKENDS[n].kernel for n in table_order(use)[0] if n != "manual" and not BACKENDS[n].why_not(use)}
    return measured_order(runs, use, use.heads) if len(runs) > 1 else None


register_auto_order(auto_order)
