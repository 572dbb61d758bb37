"""Arrow schema of the FI-LoCoMo per-case output (`cases.parquet`), defined once.

One row per (case, method, utility mode). Memory ids are LoCoMo dia_ids for real turns and '<case_id>#f<j>' for
injected fault records. Rows say how they were made: run_id keys the run's config, agent is the agent fingerprint,
estimator/permutations say how MeClear's values were computed, seed is the run seed.
"""

from __future__ import annotations

import pyarrow as pa

CASES = pa.schema(
    [
        ("run_id", pa.string()),
        ("case_id", pa.string()),  # '<query_id>:<mechanism>'
        ("conversation", pa.string()),  # LoCoMo sample_id: the bootstrap cluster
        ("query_id", pa.string()),
        ("mechanism", pa.string()),  # direct | redundant | joint
        ("method", pa.string()),  # meclear_l4 ... meclear_exact, loo, loo_threshold, contextcite, proxyspex, filter,
        # position, random, oracle (controls)
        ("utility", pa.string()),  # probability | correct
        ("faults", pa.list_(pa.string())),  # M, the injected records (all inside the frozen context)
        ("ranking", pa.list_(pa.string())),  # memories the method flags as harmful, most harmful first
        ("full_ranking", pa.list_(pa.string())),  # all K memories, most harmful first, ties by the case seed
        ("cleared", pa.list_(pa.string())),  # memories the clearance removed
        ("recovered", pa.bool_()),  # the agent answers correctly on the cleared context
        ("evaluations", pa.int64()),  # distinct coalitions the method evaluated, clearance checks included
        ("baseline_utility", pa.float64()),  # v(N) in this utility mode; null where the method never evaluates N
        ("cleared_utility", pa.float64()),  # v(N minus cleared)
        ("estimator", pa.string()),  # exact | permutation (MeClear); the method's family otherwise
        ("permutations", pa.int32()),  # L for permutation MeClear; null otherwise
        ("agent", pa.string()),
        ("seed", pa.int64()),
    ]
)
