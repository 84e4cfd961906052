"""benchmarks/suite/bench_quality.py: the token F1 scorer (exact values) and the verdict's
targets (greedy agreement reported, never a target)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bq() -> Any:
    # Imported by name: the tests reach its internals through Any.
    return importlib.import_module("benchmarks.suite.bench_quality")


@pytest.mark.parametrize(
    ("prediction", "reference", "f1"),
    [
        # "cat sat" against "cat sat down": precision 2/2, recall 2/3, F1 = 2 * 2/3 / (5/3).
        ("The cat sat.", "a cat sat down", 0.8),
        # Multiplicity counts: one shared "cat"; precision 1/3, recall 1/2, F1 = (1/3) / (5/6).
        ("cat cat cat", "cat sat", 0.4),
        ("Paris, FRANCE!", "  paris   france ", 1.0),
        # Articles only as whole words ("theatre" stays); punctuation removed before them.
        ("The theatre", "theatre an", 1.0),
        ("the-end", "end", 0.0),
        ("dog", "cat", 0.0),
        ("", "cat", 0.0),
        ("cat", "", 0.0),
        ("", "", 1.0),
        ("The, a an!", "...", 1.0),  # both empty after normalisation
    ],
)
def test_token_f1_is_squads_normalised_word_overlap_f1(
    bq: Any, prediction: str, reference: str, f1: float
) -> None:
    assert bq.token_f1(prediction, reference) == f1


def _table(accuracy: float, f1: float, agree: float, share: float = 0.1) -> dict[str, float]:
    return {"accuracy": accuracy, "token_f1": f1, "greedy_agreement": agree, "recomputed_share": share}


def test_greedy_agreement_is_no_target_and_the_pick_ranks_accuracy_then_f1(bq: Any) -> None:
    assert bq.TARGETS == {"accuracy_points_below_full": 2.0, "ttft_ratio_2k": 0.4}
    full = _table(0.8, 1.0, 1.0, 1.0)
    q = {
        "by_protocol": {
            "alone": {
                "full": full,
                "blend_0.05": _table(0.78, 0.6, 0.9),
                "query_0.10": _table(0.78, 0.7, 0.2),
                "query_0.30": _table(0.8, 0.9, 0.9, 0.3),  # over 15 %: never picked
            },
            "prefix": {"full": full, "blend_0.15": _table(0.7, 0.95, 1.0)},
        }
    }
    assert bq.pick(q) == ("alone", "query_0.10")
    heldout = {"full": full, "query_0.10": _table(0.76, 0.65, 0.1)}
    result = {
        "quality": q,
        "heldout": {"sets": 5, "protocol": "alone", "method": "query_0.10", "methods": heldout},
        "ttft": {"2048": {"ratio_to_full": {"query_0.10": 0.3}}},
    }
    assert bq.verdict(result) == {
        "protocol": "alone",
        "method": "query_0.10",
        "heldout_sets": 5,
        "dev_accuracy_points_below_full": 2.0,
        "dev_greedy_agreement": 0.2,
        "accuracy_points_below_full": 4.0,
        "accuracy_met": False,
        "token_f1": 0.65,
        "greedy_agreement": 0.1,
        "ttft_ratio_2k": 0.3,
        "ttft_met": True,
    }
