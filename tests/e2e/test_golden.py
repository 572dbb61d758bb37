"""Outputs stay the same rows across restructurings: `meclear audit` on the sample pool and a reduced `meclear eval`
(one LoCoMo conversation, two cases per mechanism) against rows recorded before issue 10's restructuring.
A deliberate change of behaviour regenerates them (`python tests/golden.py --write`) in its own commit."""

from __future__ import annotations

import pytest

from tests import golden
from tests.data_paths import LOCOMO


def _diff(expected: list, actual: list) -> str:
    missing = [r for r in expected if r not in actual][:2]
    extra = [r for r in actual if r not in expected][:2]
    return f"{len(expected)} rows expected, {len(actual)} found; first missing {missing}; first unexpected {extra}"


def test_audit_rows_unchanged(tmp_path):
    expected = golden.load("audit")
    actual = golden.audit_rows(tmp_path / "audit")
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name] == expected[name], f"{name}/: {_diff(expected[name], actual[name])}"


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_eval_rows_unchanged(tmp_path):
    expected = golden.load("eval")
    actual = golden.eval_rows(tmp_path / "eval")
    assert actual["cases"] == expected["cases"], _diff(expected["cases"], actual["cases"])
    assert actual["summary"] == expected["summary"]
