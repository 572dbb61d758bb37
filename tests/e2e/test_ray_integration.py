"""Real Ray, started once: the audit on the bundled sample pool through an actor pool, every dataset read back."""

from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline.audit.run import InputSpec
from pipeline.cli.main import main
from pipeline.store.schemas import DATASETS

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def sample_run(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-audit") / "run"
    code = main(["audit", "--utility", "correct", "--out", str(out), "--no-progress", "--actors", "2"])
    assert code == 0
    return out


def test_every_dataset_reads_back_with_its_schema(sample_run):
    for name, schema in DATASETS.items():
        df = pl.scan_parquet(sample_run / name).collect()
        assert df.columns == schema.names, name
        assert df.height > 0 or name == "errors", name  # errors/ is empty on a clean run
    manifest = json.loads((sample_run / "manifest.json").read_text())
    assert manifest["counts"]["cases"] == 36 and manifest["config"]["executor"] == "ray"
    assert manifest["counts"]["max_evaluations_per_case"] <= 32
    assert set(manifest["timings"]) >= {"retrieval_s", "evaluate_s", "write_s", "total_s"}


def test_planted_redundant_copies_flagged_harmful_while_loo_misses_them(sample_run):
    pools, _, _ = InputSpec().load()
    planted = {
        m.memory_id: m.metadata
        for p in pools.values()
        for m in p.memories
        if m.metadata and m.metadata.get("planted") == "redundant"
    }
    att = pl.scan_parquet(sample_run / "attributions").collect()
    rows = att.filter(pl.col("memory_id").is_in(list(planted)))
    rows = rows.filter(
        pl.struct(["memory_id", "query_id"]).map_elements(
            lambda s: planted[s["memory_id"]]["query_id"] == s["query_id"], return_dtype=pl.Boolean)
    )
    assert rows.height == len(planted)  # every planted copy was retrieved for its query
    assert rows["harmful"].all()  # Shapley sees the shared harm
    assert (rows["loo"] == 0.0).all() and rows["loo_inconclusive"].all()  # LOO alone is blind to masked copies
    cl = pl.scan_parquet(sample_run / "clearances").collect()
    targets = {m["query_id"] for m in planted.values()}
    hit = cl.filter(pl.col("query_id").is_in(list(targets)))
    assert hit["recovered"].all() and (~hit["baseline_correct"]).all() and (hit["gain"] > 0).all()
    for row in hit.iter_rows(named=True):  # every copy of the group is cleared together
        group = {m for m, meta in planted.items() if meta["query_id"] == row["query_id"]}
        assert group <= set(row["cleared"])


def test_interactions_label_redundant_pairs_as_substitution(sample_run):
    inter = pl.scan_parquet(sample_run / "interactions").collect()
    pair = inter.filter((pl.col("query_id") == "ben-q1") & pl.col("memory_a").is_in(["ben-02", "ben-03"])
                        & pl.col("memory_b").is_in(["ben-02", "ben-03"]))
    assert pair.height == 1 and pair["label"][0] == "substitution" and pair["interaction"][0] > 0


def test_rerun_through_ray_evaluates_nothing_new(sample_run, capsys):
    before = pl.scan_parquet(sample_run / "utilities").collect().height
    assert main(["audit", "--utility", "correct", "--out", str(sample_run), "--no-progress"]) == 0
    assert pl.scan_parquet(sample_run / "utilities").collect().height == before
    assert f"0 ({before})" in capsys.readouterr().out
