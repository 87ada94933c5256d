"""bench/fit_auto.py: fitting auto's flash-attn-4 lengths from a results file into the table the model reads."""

from __future__ import annotations

import json

import pytest

import attention
from bench import fit_auto


def row(backend, d, t, ms, docs=False):
    return {"backend": backend, "head_dim": d, "seq_len": t, "docs": docs, "fwd_bwd_ms": ms}


def test_fit_takes_flash_attn_4_from_where_it_wins_at_every_longer_length():
    rows = [row("sdpa:auto", 64, t, 1.0) for t in (1024, 2048, 4096, 8192)]
    rows += [row("flash_attn_4", 64, t, ms) for t, ms in ((1024, 0.9), (2048, 1.1), (4096, 0.9), (8192, 0.8))]
    rows += [row("flex_attention", 128, t, 1.0, True) for t in (1024, 4096)]
    rows += [row("flash_attn_4", 128, 1024, 0.5, True), row("flash_attn_4", 128, 4096, 0.7, True)]
    # 1024 wins but 2048 loses: the table starts at 4096, the first length of the winning run to the end
    assert fit_auto.fit({"rows": rows}) == {"causal": [[64, 4096]], "documents": [[256, 1024]]}
    rows.append(row("flash_attn_4", 64, 16384, None))  # an unmeasured cell changes nothing
    rows += [row("sdpa:auto", 64, 32768, 1.0), row("flash_attn_4", 64, 32768, 2.0)]
    with pytest.raises(ValueError, match="does not beat sdpa:auto at the longest"):
        fit_auto.fit({"rows": rows})


def test_write_stores_the_card_entry_the_resolver_reads(tmp_path, capsys):
    rows = [row("sdpa:auto", 64, t, 1.0) for t in (512, 1024)] + [row("flash_attn_4", 64, t, 0.5) for t in (512, 1024)]
    results = tmp_path / "a100-attention.json"
    results.write_text(json.dumps({"header": {"capability": "sm80", "device_name": "A100"}, "rows": rows}))
    table = tmp_path / "attention_auto.json"
    table.write_text(json.dumps({"about": "kept", "cards": {"sm90": {"first": "flash_attn_4", "causal": [[64, 1]]}}}))
    source_files = {p: p.read_text() for p in (attention.AUTO_TABLE.parent.parent / "attention.py",)}
    assert fit_auto.main([str(results), "--write", "--table", str(table)]) == 0
    written = json.loads(table.read_text())
    assert written["about"] == "kept" and written["cards"]["sm90"]["causal"] == [[64, 1]]
    assert attention.read_auto_table(table)["sm80"]["causal"] == [[64, 512]]
    assert all(p.read_text() == text for p, text in source_files.items()), "no source file is rewritten"
    assert '"sm80"' in capsys.readouterr().out


def test_the_committed_table_has_an_entry_for_every_masking_it_fitted():
    cards = attention.read_auto_table()
    assert cards, "config/attention_auto.json is missing or unreadable"
    for card, entry in cards.items():
        assert card.startswith("sm") and entry["first"] in ("flash_attn_4", "flash_attn_3", "flash_attn_2")
        for masking in ("causal", "documents"):
            dims = [d for d, _ in entry.get(masking, [])]
            assert dims == sorted(dims), f"{card} {masking}: head dims must rise"


@pytest.mark.parametrize("content", ["{}", json.dumps({"header": {"capability": None}, "rows": []}), "not json"])
def test_a_results_file_without_a_card_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "results.json"
    path.write_text(content)
    assert fit_auto.main([str(path), "--table", str(tmp_path / "table.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "table.json").exists()
