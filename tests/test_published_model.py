"""The model against published measurements: benchmarks/model_vs_published.py's rows
(FlashAttention-2 and -3 on H100 at d = 128, causal and not) priced with the bundled profile,
whose constants all come from documentation or microbenchmarks (none is fitted on these rows).
"""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import ROOT

spec = importlib.util.spec_from_file_location("model_vs_published", ROOT / "benchmarks" / "model_vs_published.py")
published = importlib.util.module_from_spec(spec)
spec.loader.exec_module(published)


@pytest.fixture(scope="module")
def priced_rows():
    import csv

    with published.CSV.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    results = [dict(row, **published.price(row)) for row in rows]
    return results


def test_every_published_row_is_priced(priced_rows):
    assert [r.get("skipped") for r in priced_rows if "skipped" in r] == []
    assert len(priced_rows) == 24


@pytest.mark.parametrize("causal", ["false", "true", None])
def test_the_model_tracks_published_attention(priced_rows, causal):
    chosen = [r for r in priced_rows if causal in (None, r["causal"])]
    stats = published._summary(chosen)
    assert stats["median_abs_error"] <= 0.12, stats
    assert stats["spearman"] >= 0.9, stats


def test_spearman_ranks_ties_by_their_mean():
    assert published.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert published.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert published.spearman([1, 1, 2, 3], [5, 6, 7, 8]) == pytest.approx(0.9486832980505138)


def test_the_script_prints_a_row_per_measurement_and_the_summary(capsys):
    assert published.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("FA2 ") == 12 and out.count("FA3 ") == 12
    assert "all        24 rows priced" in out
