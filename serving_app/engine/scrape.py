"""Reading each engine's own `/metrics` into compact samples (`serving_app.models.engine_metrics`).

The node agent calls `scrape_node()` every `ENGINE_METRICS_INTERVAL_SECONDS`: each ready engine
of its node is read once, parsed with `prometheus_client`'s parser, and compared with the
previous reading of the same engine process (kept here, in the agent's memory) to turn the
engine's counters and histograms into the interval's increases. What vLLM 0.32 exposes and what
is taken from it (tests/unit/fixtures/vllm-metrics holds real captures):

- gauges `vllm:num_requests_running`, `vllm:num_requests_waiting` (summed over the engine's
  data-parallel ranks, the `engine` label) and `vllm:kv_cache_usage_perc` (their mean, a 0-1
  fraction);
- counters `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`
  (tokens looked up in the prefix cache and found: their ratio is the hit rate);
- histograms `vllm:time_to_first_token_seconds` and `vllm:inter_token_latency_seconds`: the
  increase of each bucket over the interval gives that interval's latencies, whose p50 and p95
  are read off the buckets as Prometheus' `histogram_quantile` does;
- `vllm:lora_requests_info`: a gauge whose value is the time it was set and whose labels name the
  adapters with requests in the engine (`running_lora_adapters`, comma-separated). Every set of
  names vLLM ever reported stays exposed, so the current one is the newest. vLLM reports names,
  not counts.

Older vLLM names (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`,
`vllm:time_per_output_token_seconds`) are read when the current ones are absent. A reading whose
counters went down is a restarted engine: that sample has no increases, like the first one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from django.utils import timezone
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from serving_app.engine.client import EngineClient
from serving_app.models import Instance
from serving_app.models.engine_metrics import COUNTERS, Bucket, EngineSample, quantile_ms

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_SECONDS = 2.0

# Our name -> the engine's metric family names, newest first.
GAUGES: dict[str, tuple[str, ...]] = {
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTER_FAMILIES: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "preemptions": ("vllm:num_preemptions",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
HISTOGRAM_FAMILIES: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
LORA_INFO = "vllm:lora_requests_info"
# Gauges that are a fraction per data-parallel rank: averaged, not summed.
MEAN_GAUGES = frozenset({"kv_cache_usage"})


class NotEngineMetrics(ValueError):
    """The text is not a vLLM `/metrics` exposition."""


@dataclass(frozen=True)
class Reading:
    """One engine's `/metrics`, reduced to what a sample needs. Histograms are cumulative
    counts per upper bound, as exposed (`math.inf` for `+Inf`)."""

    gauges: dict[str, float]
    counters: dict[str, float]
    histograms: dict[str, dict[float, float]]
    active_adapters: tuple[str, ...]


def parse(text: str) -> Reading:
    """Parse a vLLM `/metrics` exposition; NotEngineMetrics if it is none (or unparsable)."""
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise NotEngineMetrics(f"unparsable metrics: {exc}") from exc
    if GAUGES["requests_running"][0] not in families:
        raise NotEngineMetrics("no vllm:num_requests_running: not a vLLM engine's /metrics")
    try:
        return _reduce(families)
    except (KeyError, ValueError) as exc:  # a bucket without a numeric `le`
        raise NotEngineMetrics(f"malformed vLLM metrics: {exc!r}") from exc


def _reduce(families: dict[str, Metric]) -> Reading:
    gauges = {}
    for name, candidates in GAUGES.items():
        values = _values(_first(families, candidates), "")
        if name in MEAN_GAUGES:
            gauges[name] = sum(values) / len(values) if values else 0.0
        else:
            gauges[name] = sum(values)
    counters = {name: sum(_values(_first(families, candidates), "_total"))
                for name, candidates in COUNTER_FAMILIES.items()}
    histograms = {name: _cumulative_buckets(_first(families, candidates))
                  for name, candidates in HISTOGRAM_FAMILIES.items()}
    return Reading(gauges, counters, histograms, _active_adapters(families.get(LORA_INFO)))


def _first(families: dict[str, Metric], candidates: Iterable[str]) -> Metric | None:
    return next((families[name] for name in candidates if name in families), None)


def _values(family: Metric | None, suffix: str) -> list[float]:
    """The values of the family's own series (not `_created`), one per label set."""
    if family is None:
        return []
    return [s.value for s in family.samples if s.name == family.name + suffix]


def _cumulative_buckets(family: Metric | None) -> dict[float, float]:
    buckets: dict[float, float] = defaultdict(float)
    if family is None:
        return {}
    for s in family.samples:
        if s.name == family.name + "_bucket":
            buckets[float(s.labels["le"])] += s.value  # float("+Inf") is inf
    return dict(buckets)


def _active_adapters(family: Metric | None) -> tuple[str, ...]:
    """The adapters named by the newest `vllm:lora_requests_info` series (its value is when it
    was set)."""
    if family is None or not family.samples:
        return ()
    newest = max(family.samples, key=lambda s: s.value)
    names: set[str] = set()
    for label in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(n for n in newest.labels.get(label, "").split(",") if n)
    return tuple(sorted(names))


# -- the interval between two readings -----------------------------------------------------------
def interval_buckets(before: dict[float, float], after: dict[float, float]) -> list[Bucket]:
    """The non-empty buckets of what a histogram observed between two cumulative readings, as
    `[[lower, upper, count], ...]` (seconds; upper None for `+Inf`)."""
    buckets: list[Bucket] = []
    lower = 0.0
    below = 0.0  # the interval's cumulative count up to `lower`
    for bound in sorted(after):
        cumulative = after[bound] - before.get(bound, 0.0)
        count = cumulative - below
        if count > 0:
            buckets.append([lower, None if math.isinf(bound) else bound, int(round(count))])
        below = max(cumulative, below)
        lower = bound
    return buckets


def restarted(before: Reading, after: Reading) -> bool:
    """Whether a counter went down between the readings: the engine process started again."""
    if any(after.counters[name] < before.counters[name] for name in after.counters):
        return True
    return any(
        after.histograms[name].get(math.inf, 0.0) < before.histograms[name].get(math.inf, 0.0)
        for name in after.histograms
    )


def sample_fields(current: Reading, previous: Reading | None,
                  seconds: float | None) -> dict[str, Any]:
    """The `EngineSample` fields for `current`, with the increases since `previous` (the last
    reading of the same engine process, `seconds` before) when there is one."""
    fields: dict[str, Any] = {
        "requests_running": int(round(current.gauges["requests_running"])),
        "requests_waiting": int(round(current.gauges["requests_waiting"])),
        "kv_cache_usage": current.gauges["kv_cache_usage"],
        "active_adapters": list(current.active_adapters),
    }
    for name in COUNTERS:
        fields[f"{name}_total"] = int(current.counters[name])
    if previous is None or not seconds or restarted(previous, current):
        return fields
    fields["interval_seconds"] = seconds
    for name in COUNTERS:
        fields[name] = int(current.counters[name] - previous.counters[name])
    for name in HISTOGRAM_FAMILIES:
        buckets = interval_buckets(previous.histograms[name], current.histograms[name])
        fields[f"{name}_buckets"] = buckets
        fields[f"{name}_p50_ms"] = quantile_ms(buckets, 0.50)
        fields[f"{name}_p95_ms"] = quantile_ms(buckets, 0.95)
    return fields


# -- scraping a node's engines ------------------------------------------------------------------
@dataclass(frozen=True)
class _Last:
    pid: int | None
    monotonic: float
    reading: Reading


_last: dict[int, _Last] = {}
_lock = threading.Lock()


def scrape_node(node_name: str) -> list[EngineSample]:
    """Read every ready engine of the node once and store one sample each; the samples stored.

    An engine that does not answer within SCRAPE_TIMEOUT_SECONDS (or answers something that is
    not vLLM's metrics) gets no sample this round; its health is the supervisor's business.
    """
    instances = list(Instance.objects.select_related("node").filter(
        node__name=node_name, state=Instance.State.READY))
    samples: list[EngineSample] = []
    with _lock:
        for instance in instances:
            sample = _scrape(instance)
            if sample is not None:
                samples.append(sample)
        for pk in set(_last) - {i.pk for i in instances}:
            del _last[pk]  # stopped or failed: a later engine starts from a first reading
    EngineSample.objects.bulk_create(samples)
    return samples


def _scrape(instance: Instance) -> EngineSample | None:
    client = EngineClient(instance.base_url, instance.secret)
    try:
        text = client.metrics(timeout=SCRAPE_TIMEOUT_SECONDS)
        at, now = timezone.now(), time.monotonic()
        reading = parse(text)
    except (httpx.HTTPError, NotEngineMetrics) as exc:
        log.info("no metrics from %s this round: %s", instance, exc)
        return None
    last = _last.get(instance.pk)
    same_engine = last is not None and last.pid == instance.pid
    previous = last.reading if last is not None and same_engine else None
    seconds = now - last.monotonic if last is not None and same_engine else None
    _last[instance.pk] = _Last(instance.pid, now, reading)
    return EngineSample(instance=instance, deployment_id=instance.deployment_id, at=at,
                        **sample_fields(reading, previous, seconds))
