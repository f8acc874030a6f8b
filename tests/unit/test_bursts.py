"""The bursty benchmark's figures (`benchmarks/bursts.py`) from vLLM's per-request detail, on
a made-up run: what `gpu_bench.py fair --bursty` reports on a GPU host."""

from __future__ import annotations

from benchmarks import bursts


def detail(requests: list[tuple[float, float, int]]) -> dict:
    return {"starts": [r[0] for r in requests], "e2els": [r[1] for r in requests],
            "output_lens": [r[2] for r in requests]}


def test_a_bursts_first_seconds_are_left_out_and_the_throughput_after_it_is_counted():
    # The flood: a request of 100 tokens ending every second from 1 to 60.
    flood = detail([(t - 3.0, 3.0, 100) for t in range(1, 61)])
    # A burst at 10-25 s: its first 4 s slow (2 s), then 1 s; its last ends at 25.
    burst = detail([(10.0, 2.0, 10), (12.0, 2.0, 10), (14.5, 1.0, 10), (20.0, 1.0, 10),
                    (24.0, 1.0, 10)])
    fig = bursts.figures({"flood": flood}, [burst], alone_p95_ms=800.0)
    assert fig["cs_requests_after_settle"] == 3 and fig["cs_p95_ms"] == 1000.0
    assert fig["cs_p95_vs_alone"] == 1.25
    # Over every request, the burst's slow first seconds included (issue 45's figure).
    assert fig["cs_requests"] == 5 and fig["cs_p95_all_ms"] == 2000.0
    assert fig["cs_p95_all_vs_alone"] == 2.5
    # 2 s after 25: the flood's completions at 26 and 27.
    assert fig["after_burst_tok_s"] == 100.0
    window = fig["window_s"]
    assert window == 62.0 and fig["tok_s"] == (60 * 100 + 5 * 10) / window


def test_the_throughput_after_a_burst_counts_the_tokens_generated_in_it_not_the_requests_ending():
    # The flood: one request of 101 tokens, first token at 1 s, the other 100 from 1 to 11 s.
    flood = {"starts": [0.0, 0.0], "ttfts": [1.0, 0.5], "e2els": [11.0, 40.0],
             "output_lens": [101, 1]}
    burst = {"starts": [2.0], "ttfts": [0.1], "e2els": [1.0], "output_lens": [1]}
    fig = bursts.figures({"flood": flood}, [burst], alone_p95_ms=1000.0)
    # The burst's last ends at 3 s: from 3 to 5 s, 20 of the flood's tokens were generated,
    # though no flood request ended then (counted at completion it read 0).
    assert fig["after_burst_tok_s"] == 10.0
    assert fig["tok_s"] == 103 / 40.0  # the window's total still counts completions


def test_each_mode_is_compared_with_fcfs_against_issue_44s_targets():
    modes = bursts.versus({
        "fcfs": {"cs_p95_vs_alone": 2.3, "tok_s": 1000.0, "after_burst_tok_s": 1000.0},
        "static": {"cs_p95_vs_alone": 1.2, "tok_s": 400.0, "after_burst_tok_s": 400.0},
        "objectives": {"cs_p95_vs_alone": 1.25, "tok_s": 800.0, "after_burst_tok_s": 960.0},
    })
    assert [m["target_met"] for m in modes.values()] == [False, False, True]
    assert modes["objectives"]["vs_fcfs"] == 0.8 and modes["static"]["after_vs_fcfs"] == 0.4


def test_issue_45s_go_counts_every_request_against_fcfs_from_another_engine():
    fcfs = {"cs_p95_vs_alone": 2.3, "cs_p95_all_vs_alone": 2.5, "tok_s": 1000.0,
            "after_burst_tok_s": 1000.0}
    modes = bursts.versus({
        "capped": {"cs_p95_vs_alone": 1.1, "cs_p95_all_vs_alone": 1.25, "tok_s": 750.0,
                   "after_burst_tok_s": 990.0},
        "slow-start": {"cs_p95_vs_alone": 1.1, "cs_p95_all_vs_alone": 1.9, "tok_s": 900.0,
                       "after_burst_tok_s": 990.0},
    }, base=fcfs)
    assert modes["capped"]["go_all_requests"] and modes["capped"]["vs_fcfs"] == 0.75
    assert not modes["slow-start"]["go_all_requests"] and modes["slow-start"]["target_met"]
