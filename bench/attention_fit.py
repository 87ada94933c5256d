"""`python -m bench.attention fit`: the lengths from which auto puts flash-attn-4 first on a card, from an
attention results file (bench/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from data.common import OneLineParser
from kernels.auto import AUTO_TABLE
from storage.atomic import atomic_path

WITHOUT_FLASH_ATTN_4 = {"causal": "sdpa:auto", "documents": "flex_attention"}


def fit(results: dict) -> dict[str, list[list[int]]]:
    """{masking: [[covered head dim, shortest T from which flash_attn_4 wins at every measured T], ...]}."""
    times: dict[tuple[str, int], dict[int, dict[str, float]]] = {}  # (masking, head dim): {T: {backend: ms}}
    for row in results["rows"]:
        if row.get("fwd_bwd_ms") is not None:
            masking = "documents" if row["docs"] else "causal"
            by_backend = times.setdefault((masking, row["head_dim"]), {}).setdefault(row["seq_len"], {})
            by_backend[row["backend"]] = row["fwd_bwd_ms"]
    fitted: dict[str, list[list[int]]] = {}
    for (masking, head_dim), by_seq_len in sorted(times.items()):
        rival = WITHOUT_FLASH_ATTN_4[masking]
        cells = sorted((t, c) for t, c in by_seq_len.items() if "flash_attn_4" in c and rival in c)
        start = None
        for seq_len, cell in reversed(cells):  # longest first; stop at the first T where flash-attn-4 loses
            if cell["flash_attn_4"] >= cell[rival]:
                break
            start = seq_len
        if start is None:
            raise ValueError(
                f"{masking} D={head_dim}: flash_attn_4 does not beat {rival} at the longest measured T, "
                f"so no threshold fits; leave this card out of the table (auto then measures on it)"
            )
        fitted.setdefault(masking, []).append([64 if head_dim <= 64 else 256, start])
    return fitted


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m bench.attention fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="an attention results JSON (python -m bench.attention)")
    parser.add_argument("--write", action="store_true", help="store the entry in the table file")
    parser.add_argument("--table", type=Path, default=AUTO_TABLE, help="the table file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        card = results["header"]["capability"]
        fitted = fit(results)
    except OSError as error:
        return fail(f"{args.results}: {error.strerror or error}")
    except (ValueError, KeyError, TypeError) as error:
        what = f"no {error} field" if isinstance(error, KeyError) else str(error).splitlines()[0]
        return fail(
            f"{args.results} is not an attention results file ({what}); make one with python -m bench.attention"
        )
    if not card or not card.startswith("sm"):
        return fail(f"{args.results} is not from a CUDA card (capability {card!r})")
    device_name = results["header"].get("device_name", card)
    source = f"fitted by python -m bench.attention fit from {args.results.name} ({device_name})"
    table = json.loads(args.table.read_text()) if args.table.exists() else {}
    cards = dict(table.get("cards", {}))  # card's entry refitted: maskings not in `fitted` kept
    cards[card] = {"first": "flash_attn_4", **cards.get(card, {}), **fitted, "source": source}
    table = {**table, "cards": cards}
    print(json.dumps({card: table["cards"][card]}, indent=1))
    if args.write:
        with atomic_path(args.table) as tmp:
            tmp.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.table}")
    return 0


def fail(message: str) -> int:
    """The tool's one error line; its exit code."""
    print(f"error: {message}", file=sys.stderr)
    return 2
