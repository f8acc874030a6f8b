"""`gpu_bench.py plot` merges the `fair` results of several calls on the GPU host: a
`--pair-only` call adds its pair to a configuration measured in another call, and the
frontier is computed again over everything merged. Read from the committed H200 results."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_bench

RUN = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs" / "2026-12-05-h200-bench"


def test_a_pair_only_run_joins_its_configuration_and_replaces_only_the_pair(tmp_path):
    first = json.loads((RUN / "fair.json").read_text())
    prio = first["configs"]["prio-8k"]
    pair = {"pair-fcfs": dict(prio["pair-fcfs"], jain=0.5),
            "pair-flow-32": dict(prio["pair-flow-32"], jain=0.99)}
    later = tmp_path / "pair.json"
    later.write_text(json.dumps({"args": {"pair_only": True}, "configs": {"prio-8k": pair}}))

    merged = gpu_bench.merged([str(RUN / "fair.json"), str(later)])

    assert set(merged["configs"]["prio-8k"]) == set(prio)  # no point of the first run lost
    assert merged["pair_jain"]["prio-8k pair-flow-32"] == 0.99
    assert merged["pair_jain"]["prio-8k pair-fcfs"] == 0.5
    flow8 = [r for r in merged["frontier"] if (r["config"], r["point"]) == ("prio-8k", "flow-8")]
    alone = prio["alone"]["tenants"][gpu_bench.CS]["e2e_p95"]
    assert flow8[0]["cs_p95_vs_alone"] == prio["flow-8"]["tenants"][gpu_bench.CS]["e2e_p95"] / alone
    assert [r["file"] for r in merged["runs"]] == ["fair.json", "pair.json"]
