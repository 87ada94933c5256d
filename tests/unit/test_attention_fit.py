"""bench/attention_fit.py (python -m bench.attention fit): fitting auto's flash-attn-4 lengths from a results file
into the table that auto's order (kernels/auto.py) reads."""

from __future__ import annotations

import json

import pytest
import torch

import kernels
from bench import attention_fit
from model import AttentionUse

CUDA = torch.device("cuda")  # an object only: auto_order is asked about a card that is never touched


def row(backend, d, t, ms, docs=False):
    return {"backend": backend, "head_dim": d, "seq_len": t, "docs": docs, "fwd_bwd_ms": ms}


def on_card(monkeypatch, card: str):
    """auto_order sees a GPU of compute capability `card` ('sm80' -> (8, 0))."""
    capability = (int(card[2:-1]), int(card[-1]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def first(cards: dict, seq_len: int, head_dim: int = 64, documents: bool = False) -> str:
    """What auto tries first on the card on_card set, by the table `cards`."""
    need = AttentionUse(CUDA, torch.bfloat16, head_dim, documents, seq_len=seq_len)
    return kernels.auto.table_order(need, cards)[0][0]


def test_fit_takes_flash_attn_4_from_where_it_wins_at_every_longer_length():
    rows = [row("sdpa:auto", 64, t, 1.0) for t in (1024, 2048, 4096, 8192)]
    rows += [row("flash_attn_4", 64, t, ms) for t, ms in ((1024, 0.9), (2048, 1.1), (4096, 0.9), (8192, 0.8))]
    rows += [row("flex_attention", 128, t, 1.0, True) for t in (1024, 4096)]
    rows += [row("flash_attn_4", 128, 1024, 0.5, True), row("flash_attn_4", 128, 4096, 0.7, True)]
    # 1024 wins but 2048 loses: the table starts at 4096, the first length of the winning run to the end
    assert attention_fit.fit({"rows": rows}) == {"causal": [[64, 4096]], "documents": [[256, 1024]]}
    rows.append(row("flash_attn_4", 64, 16384, None))  # an unmeasured cell changes nothing
    rows += [row("sdpa:auto", 64, 32768, 1.0), row("flash_attn_4", 64, 32768, 2.0)]
    with pytest.raises(ValueError, match="does not beat sdpa:auto at the longest"):
        attention_fit.fit({"rows": rows})


def test_the_written_table_is_what_auto_orders_by(tmp_path, capsys, monkeypatch):
    """--write stores the card's entry in the given table file (other cards and keys kept, the committed table
    untouched); kernels.auto reads it back, and on that card auto puts flash_attn_4 first from the fitted
    length on, for the head dims and masking fitted, and keeps the default order elsewhere."""
    rows = [row("sdpa:auto", 64, t, 1.0) for t in (512, 1024)] + [row("flash_attn_4", 64, t, 0.5) for t in (512, 1024)]
    results = tmp_path / "a100-attention.json"
    results.write_text(json.dumps({"header": {"capability": "sm80", "device_name": "A100"}, "rows": rows}))
    table = tmp_path / "attention_auto.json"
    sm90 = {"first": "flash_attn_4", "causal": [[64, 1]]}
    table.write_text(json.dumps({"about": "kept", "cards": {"sm90": sm90}}))
    committed = kernels.auto.AUTO_TABLE.read_bytes()
    assert attention_fit.main([str(results), "--write", "--table", str(table)]) == 0
    assert '"sm80"' in capsys.readouterr().out
    assert kernels.auto.AUTO_TABLE.read_bytes() == committed, "--table names the only file written"
    assert json.loads(table.read_text())["about"] == "kept"
    cards = kernels.auto.read_auto_table(table)
    assert cards["sm90"] == sm90
    assert cards["sm80"]["first"] == "flash_attn_4" and cards["sm80"]["causal"] == [[64, 512]]
    on_card(monkeypatch, "sm80")
    default = kernels.auto.AUTO_ORDER[("cuda", "older", False)][0]
    assert default != "flash_attn_4"
    assert first(cards, 512) == first(cards, 8192) == "flash_attn_4"
    assert first(cards, 511) == default  # shorter than fitted
    assert first(cards, 8192, head_dim=128) == default  # wider heads than fitted
    assert first(cards, 8192, documents=True) == kernels.auto.AUTO_ORDER[("cuda", "older", True)][0]  # not fitted
    assert first({}, 8192) == default  # a card the table does not hold


def test_the_committed_table_has_an_entry_auto_reads_for_every_masking_it_fitted(monkeypatch):
    cards = kernels.auto.read_auto_table()
    assert cards, "config/attention_auto.json is missing or unreadable"
    for card, entry in cards.items():
        assert card.startswith("sm") and entry["first"] in ("flash_attn_4", "flash_attn_3", "flash_attn_2")
        on_card(monkeypatch, card)
        for masking in ("causal", "documents"):
            dims = [d for d, _ in entry.get(masking, [])]
            assert dims == sorted(dims), f"{card} {masking}: head dims must rise"
            for head_dim, start in entry.get(masking, []):
                documents = masking == "documents"
                assert first(cards, start, head_dim, documents) == entry["first"], (card, masking, head_dim)
                assert first(cards, start - 1, head_dim, documents) != entry["first"], (card, masking, head_dim)


@pytest.mark.parametrize(
    "content, says",
    [
        ("{}", "is not an attention results file (no 'header' field); make one with python -m bench.attention"),
        (json.dumps({"header": {"capability": None}, "rows": []}), "is not from a CUDA card (capability None)"),
        ("not json", "is not an attention results file (Expecting value"),
        (None, ": No such file or directory"),
    ],
)
def test_a_results_file_without_a_card_is_one_line_and_exit_2(tmp_path, capsys, content, says):
    """Each way a results file can be wrong is one line that says which, and the table is not written."""
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert attention_fit.main([str(path), "--table", str(tmp_path / "table.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "table.json").exists()
