"""Reading vLLM's /metrics into samples, on text captured from the real engine.

tests/unit/fixtures/vllm-metrics holds three captures of one vLLM 0.32.0 CPU engine serving the
tiny model with two LoRA adapters (`acme--style`, `globex--tone`) and `--max-num-seqs 2`:
`idle.txt` right after start, `busy.txt` while 12 completions (a shared ~900-character prompt
prefix, 48 tokens each, spread over the base model and both adapters) queued behind the two
running ones, and `after.txt` once all 12 had finished. The expected numbers below are read off
the captures by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from serving_app.engine import scrape
from serving_app.models.engine_metrics import merge_buckets, quantile_ms

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-metrics"


def capture(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


@pytest.fixture(scope="module")
def readings() -> dict[str, scrape.Reading]:
    return {name: scrape.parse(capture(name)) for name in ("idle", "busy", "after")}


def test_gauges_counters_and_adapters_are_read_as_the_engine_exposed_them(readings):
    busy = readings["busy"]
    assert busy.gauges == {"requests_running": 2.0, "requests_waiting": 6.0,
                           "kv_cache_usage": pytest.approx(0.0009766817238432424)}
    assert busy.counters == {"prompt_tokens": 827.0, "generation_tokens": 21.0,
                             "preemptions": 0.0, "prefix_cache_queries": 827.0,
                             "prefix_cache_hits": 0.0}
    assert busy.active_adapters == ("globex--tone",)
    after = readings["after"]
    assert after.counters == {"prompt_tokens": 4957.0, "generation_tokens": 576.0,
                              "preemptions": 0.0, "prefix_cache_queries": 4957.0,
                              "prefix_cache_hits": 3456.0}
    assert after.gauges["requests_running"] == after.gauges["requests_waiting"] == 0
    # Four adapter sets stay exposed after the run; the newest one (empty) is the current one.
    assert capture("after").count("vllm:lora_requests_info{") == 4
    assert after.active_adapters == ()
    assert readings["idle"].active_adapters == ()  # no LoRA request yet: no series at all


def test_histograms_are_read_cumulative_per_bound(readings):
    ttft = readings["after"].histograms["ttft"]
    assert ttft[0.25] == 2 and ttft[1.0] == 6 and ttft[2.5] == 12
    assert ttft[float("inf")] == 12
    assert readings["after"].histograms["itl"][float("inf")] == 564


def test_a_sample_holds_the_increases_rates_and_percentiles_of_its_interval(readings):
    fields = scrape.sample_fields(readings["after"], readings["idle"], 10.0)
    assert fields["interval_seconds"] == 10.0
    assert fields["requests_running"] == fields["requests_waiting"] == 0
    assert fields["prompt_tokens_total"] == fields["prompt_tokens"] == 4957
    assert fields["generation_tokens"] == 576
    assert fields["prefix_cache_queries"] == 4957 and fields["prefix_cache_hits"] == 3456
    assert fields["preemptions"] == 0
    # Only the buckets that received requests, with their lower bounds.
    assert fields["ttft_buckets"] == [[0.1, 0.25, 2], [0.5, 0.75, 2], [0.75, 1.0, 2],
                                      [1.0, 2.5, 6]]
    assert fields["itl_buckets"] == [[0.0, 0.01, 523], [0.01, 0.025, 39], [0.075, 0.1, 2]]
    # p50: rank 6 of 12 ends the (0.75, 1.0] bucket. p95: rank 11.4, 5.4 of the 6 in (1, 2.5].
    assert fields["ttft_p50_ms"] == pytest.approx(1000.0)
    assert fields["ttft_p95_ms"] == pytest.approx((1.0 + 1.5 * 5.4 / 6) * 1000)
    # ITL p50: rank 282 of the 523 in (0, 0.01]; p95: rank 535.8, 12.8 of the 39 in (0.01, 0.025].
    assert fields["itl_p50_ms"] == pytest.approx(0.01 * 282 / 523 * 1000)
    assert fields["itl_p95_ms"] == pytest.approx((0.01 + 0.015 * 12.8 / 39) * 1000)


def test_intervals_add_up_to_the_whole_run(readings):
    """Buckets of consecutive intervals summed are the buckets of the whole span, so charts can
    sum samples (and hours, and engines) before reading a percentile."""
    idle, busy, after = readings["idle"], readings["busy"], readings["after"]
    first = scrape.sample_fields(busy, idle, 5.0)
    second = scrape.sample_fields(after, busy, 5.0)
    whole = scrape.sample_fields(after, idle, 10.0)
    for name in ("ttft", "itl"):
        merged = merge_buckets(first[f"{name}_buckets"], second[f"{name}_buckets"])
        assert merged == whole[f"{name}_buckets"]
    for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_hits"):
        assert first[counter] + second[counter] == whole[counter]


def test_the_first_reading_of_an_engine_has_no_increases(readings):
    fields = scrape.sample_fields(readings["busy"], None, None)
    assert "interval_seconds" not in fields and "prompt_tokens" not in fields
    assert fields["prompt_tokens_total"] == 827 and fields["requests_waiting"] == 6


def test_counters_that_went_down_mean_a_restarted_engine(readings):
    assert scrape.restarted(readings["after"], readings["idle"])
    fields = scrape.sample_fields(readings["idle"], readings["after"], 10.0)
    assert "interval_seconds" not in fields and "ttft_buckets" not in fields


def test_data_parallel_ranks_are_summed_and_the_cache_usage_averaged():
    # A second rank's series beside each of the first's (a family's series stay together).
    lines: list[str] = []
    for line in capture("busy").splitlines():
        lines.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            lines.append(line.replace('engine="0"', 'engine="1"'))
    reading = scrape.parse("\n".join(lines) + "\n")
    assert reading.gauges["requests_running"] == 4 and reading.gauges["requests_waiting"] == 12
    assert reading.gauges["kv_cache_usage"] == pytest.approx(0.0009766817238432424)
    assert reading.counters["prompt_tokens"] == 2 * 827


def test_older_vllm_names_are_read_when_the_current_ones_are_absent():
    text = capture("busy").replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    text = re.sub(r"vllm:prefix_cache_(queries|hits)", r"vllm:gpu_prefix_cache_\1", text)
    reading = scrape.parse(text)
    assert reading.gauges["kv_cache_usage"] == pytest.approx(0.0009766817238432424)
    assert reading.counters["prefix_cache_queries"] == 827


BAD_BUCKET = ('vllm:num_requests_running 1\n# TYPE vllm:time_to_first_token_seconds histogram\n'
              'vllm:time_to_first_token_seconds_bucket{le="soon"} 1\n')


@pytest.mark.parametrize("text", ["", "hello", "<html><body>502</body></html>\n",
                                  "# TYPE x counter\nx_total 1\n",
                                  "vllm:num_requests_running{engine=\"0\" 2\n", BAD_BUCKET])
def test_text_that_is_not_a_vllm_exposition_is_refused(text):
    with pytest.raises(scrape.NotEngineMetrics):
        scrape.parse(text)


def test_quantiles_follow_prometheus_histogram_quantile():
    assert quantile_ms([], 0.5) is None
    # Linear inside the bucket; the first bucket starts at 0.
    assert quantile_ms([[0.0, 0.1, 4]], 0.5) == pytest.approx(50.0)
    # A rank in the +Inf bucket is the largest finite bound: nothing is known above it.
    assert quantile_ms([[0.0, 0.1, 1], [80.0, None, 9]], 0.95) == pytest.approx(80_000.0)
    # Unordered input is read in bound order.
    assert quantile_ms([[1.0, 2.5, 2], [0.0, 1.0, 2]], 0.25) == pytest.approx(500.0)


def test_merging_buckets_adds_counts_of_the_same_bounds():
    a = [[0.0, 0.01, 3], [0.01, 0.025, 1]]
    b = [[0.01, 0.025, 2], [80.0, None, 1]]
    assert merge_buckets(a, b) == [[0.0, 0.01, 3], [0.01, 0.025, 3], [80.0, None, 1]]
    assert merge_buckets([], []) == []
