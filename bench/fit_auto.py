"""From an sm90 attention results file: the sequence lengths from which `auto` puts flash-attn-4 first.

    python bench/fit_auto.py bench/results/h100-attention.json            # print the fitted table
    python bench/fit_auto.py bench/results/h100-attention.json --write    # and write it into model.py

For each (masking, head dim) in the file: the shortest measured T from which flash_attn_4's fwd+bwd time
beats what auto runs without it (sdpa:auto for causal cells, flex_attention for document cells) at that T
and at every longer measured T. model.SM90_FLASH_ATTN_4_FROM keys a head dim by the largest it covers
(64, 256); entries for maskings the file does not hold are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model  # noqa: E402

MODEL_FILE = Path(model.__file__)
WITHOUT_FLASH_ATTN_4 = {"causal": "sdpa:auto", "documents": "flex_attention"}


def fit(results: dict) -> dict[tuple[str, int], int]:
    """(masking, covered head dim) -> shortest T from which flash_attn_4 wins at every measured T."""
    times: dict[tuple[str, int, int], dict[str, float]] = {}
    for row in results["rows"]:
        if row.get("fwd_bwd_ms") is not None:
            masking = "documents" if row["docs"] else "causal"
            times.setdefault((masking, row["head_dim"], row["seq_len"]), {})[row["backend"]] = row["fwd_bwd_ms"]
    fitted = {}
    for masking, head_dim in sorted({(m, d) for m, d, _ in times}):
        rival = WITHOUT_FLASH_ATTN_4[masking]
        cells = sorted(
            (t, c)
            for (m, d, t), c in times.items()
            if (m, d) == (masking, head_dim) and "flash_attn_4" in c and rival in c
        )
        start = None
        for seq_len, cell in reversed(cells):  # longest first; stop at the first T where flash-attn-4 loses
            if cell["flash_attn_4"] >= cell[rival]:
                break
            start = seq_len
        if start is None:
            raise ValueError(
                f"{masking} D={head_dim}: flash_attn_4 does not beat {rival} at the longest "
                f"measured T, so no threshold fits; edit SM90_FLASH_ATTN_4_FROM by hand"
            )
        fitted[(masking, 64 if head_dim <= 64 else 256)] = start
    return fitted


def table_source(table: dict[tuple[str, int], int]) -> str:
    entries = [f'("{m}", {d}): {t}' for (m, d), t in sorted(table.items())]
    lines = ["SM90_FLASH_ATTN_4_FROM = {" + ", ".join(entries[:2])]
    lines += ["                          " + ", ".join(entries[i : i + 2]) for i in range(2, len(entries), 2)]
    return ",\n".join(lines) + "}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="an attention results JSON of an sm90 card")
    parser.add_argument("--write", action="store_true", help=f"write the table into {MODEL_FILE.name}")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    if results["header"].get("capability") != "sm90":
        print(
            f"error: {args.results} is from {results['header'].get('capability')}, and only sm90 has a fitted table",
            file=sys.stderr,
        )
        return 2
    try:
        table = {**model.SM90_FLASH_ATTN_4_FROM, **fit(results)}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    source = table_source(table)
    print(source)
    if args.write:
        text = MODEL_FILE.read_text()
        MODEL_FILE.write_text(re.sub(r"SM90_FLASH_ATTN_4_FROM = \{[^}]*\}", lambda _: source, text, count=1))
        print(f"wrote {MODEL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
