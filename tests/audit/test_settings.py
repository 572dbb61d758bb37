"""One declaration per setting: the CLI's defaults are the dataclasses' defaults, the audit and eval configs share
their common fields and checks, one BM25 serves retrieval and re-retrieval, and benchmark methods are typed."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from pipeline.audit.settings import AuditConfig, RunSettings
from pipeline.bench.config import EvalConfig
from pipeline.bench.methods import Method, expand_methods
from pipeline.cli.main import build_parser
from pipeline.core.errors import ConfigError
from pipeline.retrieval.frozen import BM25


def _parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_audit_flags_default_to_the_config_defaults():
    args = _parser("audit").parse_args([])
    fields = {f.name for f in dataclasses.fields(AuditConfig)}
    shared = {k: v for k, v in vars(args).items() if k in fields}
    assert len(shared) >= 15  # every setting with a flag
    assert shared == {k: _declared(k) for k in shared}  # the declared defaults (0 permutations: resolved later)


def _declared(name: str):
    return next(f.default for f in dataclasses.fields(AuditConfig) if f.name == name)


def test_permutations_0_is_the_estimators_default_and_the_config_holds_the_number_used():
    assert AuditConfig().permutations == 16
    assert AuditConfig(estimator="adaptive").permutations == 96  # the cap measured at K=10
    assert AuditConfig(estimator="adaptive", permutations=32).permutations == 32
    args = _parser("audit").parse_args(["--estimator", "adaptive", "--top-k", "10"])
    assert AuditConfig(estimator=args.estimator, permutations=args.permutations, top_k=10).permutations == 96


def test_eval_flags_default_to_the_config_defaults():
    args = _parser("eval").parse_args(["--locomo", "x.json", "--out", "o"])
    default = EvalConfig(locomo="x.json")
    for name in ("top_k", "tau", "kappa", "seed", "dense", "agent", "actors", "gpus_per_actor", "max_cases",
                 "replicates", "filter_threshold"):
        assert getattr(args, name) == getattr(default, name), name
    # --redundancy is a comma list; empty means the config's rule (r=2, or r=2,3 with --budgets)
    assert args.redundancy == "" and default.redundancy == (2,) and args.budgets == "" and default.eval_budgets == ()
    assert args.permutation_budgets == ",".join(map(str, default.budgets))
    assert expand_methods(args.methods.split(","), default.budgets) == default.methods
    assert args.executor == "local"  # the eval command's own choice for small machines (see eval_cli)


def test_shared_settings_are_declared_and_checked_once():
    shared = {f.name for f in dataclasses.fields(RunSettings)}
    assert shared <= {f.name for f in dataclasses.fields(AuditConfig)}
    assert shared <= {f.name for f in dataclasses.fields(EvalConfig)}
    for name in shared:
        assert getattr(AuditConfig(), name) == getattr(EvalConfig(locomo="x"), name), name
    with pytest.raises(ConfigError, match=r"audit config: dense='sometimes'; allowed 'auto', 'on', 'off'"):
        AuditConfig(dense="sometimes")
    with pytest.raises(ConfigError, match=r"eval config: dense='sometimes'; allowed 'auto', 'on', 'off'"):
        EvalConfig(locomo="x", dense="sometimes")
    with pytest.raises(ConfigError, match=r"eval config: top_k=1; allowed 2\.\.63"):
        EvalConfig(locomo="x", top_k=1)


def test_bm25_extended_equals_a_fresh_index_over_the_extended_pool():
    pool = ["Ana moved to Valencia in May.", "Ben plays the violin.", "Ana's sister visits Valencia often.", ""]
    extra = ["Ana moved to Gdansk, not Valencia.", "violin lessons every Tuesday"]
    base = BM25(pool)
    grown, fresh = base.extended(extra), BM25(pool + extra)
    for q in ("Where did Ana move?", "Who plays violin?", "nothing matches zzz"):
        assert np.array_equal(grown.scores(q), fresh.scores(q))
        assert np.array_equal(base.scores(q), BM25(pool).scores(q))  # the pool's own index is left as it was
    assert grown.idf == fresh.idf and base.extended([]) is base


def test_methods_are_typed_and_keep_their_names():
    assert Method.parse("meclear_l8") == Method("meclear", 8) and Method("meclear", 8).name == "meclear_l8"
    assert Method.parse("meclear_exact") == Method("meclear") and Method("meclear").name == "meclear_exact"
    assert Method.parse("loo_threshold").name == "loo_threshold" and Method.parse("position").family == "position"
    for bad in ("meclear", "meclear_l0", "meclear_lx", "shapley"):
        with pytest.raises(ConfigError, match="is not a method"):
            Method.parse(bad)
    with pytest.raises(ConfigError, match="is not a method"):
        Method("loo", 4)  # only MeClear has a budget


def test_typed_clearance_rows_follow_the_clearances_schema():
    """The driver keeps clearances typed (`ClearanceRow`) until the writer; its fields are the schema's, in order."""
    import dataclasses

    from pipeline.audit.reduce import ClearanceRow
    from pipeline.store.schemas import CLEARANCES

    assert [f.name for f in dataclasses.fields(ClearanceRow)] == CLEARANCES.names


def test_eval_max_queries_bounds_the_queries_tried_per_conversation(tmp_path, capsys):
    """`meclear eval --max-queries N` clean-checks only the first N eligible queries of each conversation."""
    import json

    from pipeline.cli.main import main
    from tests.data_paths import LOCOMO

    if not LOCOMO.exists():
        pytest.skip("LoCoMo is not beside the checkout")
    out = tmp_path / "e"
    rc = main(["eval", "--locomo", str(LOCOMO), "--out", str(out), "--conversations", "conv-26", "--max-queries", "6",
               "--replicates", "20", "--dense", "off", "--executor", "local", "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["queries"]["eligible"] == 6 and summary["queries"]["checked"] <= 6
    assert main(["eval", "--locomo", str(LOCOMO), "--out", str(tmp_path / "f"), "--max-queries", "-1"]) == 2
    assert not (tmp_path / "f").exists()
