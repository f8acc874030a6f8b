"""Bursty customer service beside a flood (issue 44): customer service on for `on` seconds and
off for `off` beside the content-generation flood and the code assistant, for `seconds` in all,
under one mode of the deployment (FCFS, a static dispatch budget, or the admission controller
with customer service's latency objectives). `gpu_bench.py fair --bursty` runs it on a GPU
host; the figures are computed here from vLLM's per-request detail, so that they are tested on
the CPU (`tests/unit/test_bursts.py`).

Per mode:
- customer service's p95 end-to-end latency over the requests that started after each burst's
  first `settle` seconds (the first seconds of a burst meet a batch already full: a flood
  request holds its slot about 3 s), and over its p95 alone; also over all of its requests,
  the burst's first seconds included (issue 45's figure: what an engine-side lever changes);
- total output tokens/s over the background load's window;
- output tokens/s over the `after` seconds that follow each burst's last customer-service
  completion (the throughput given back when the latency tenant goes idle), pooled over the
  bursts: the tokens *generated* in those seconds, each request's first at its first-token
  time and the others spread evenly from there to its end (the detail gives no time per
  token). Counted at completion instead, as before 2026-12-07, one 512-token flood request
  ending just inside or outside a 2 s window moved the figure by hundreds of tokens per second:
  FCFS gave 973 tok/s in one H100 run and 13,005 in another of the same configuration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Detail = dict[str, Any]  # vLLM's per-request detail of one tenant: starts, e2els, output_lens


def _finishes(detail: Detail) -> list[tuple[float, int]]:
    return [(s + e, n) for s, e, n in zip(detail["starts"], detail["e2els"],
                                          detail["output_lens"], strict=True)]


def _generated(detail: Detail, low: float, high: float) -> float:
    """Output tokens generated in (low, high]: each request's first token at its start plus its
    time to first token, the rest evenly over the time from there to its end. A detail without
    first-token times counts each request's tokens at its end."""
    if "ttfts" not in detail:
        return float(sum(n for f, n in _finishes(detail) if low < f <= high))
    total = 0.0
    for start, ttft, e2el, n in zip(detail["starts"], detail["ttfts"], detail["e2els"],
                                    detail["output_lens"], strict=True):
        first, end = start + ttft, start + e2el
        total += 1 if low < first <= high else 0
        if n > 1:
            if end <= first:
                total += (n - 1) if low < end <= high else 0
            else:
                overlap = max(0.0, min(end, high) - max(first, low))
                total += (n - 1) * overlap / (end - first)
    return total


def _p95_ms(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000


def figures(background: dict[str, Detail], bursts: list[Detail], alone_p95_ms: float | None,
            settle: float = 4.0, after: float = 2.0) -> dict[str, Any]:
    """The figures of one mode: `background` the flood's and the code assistant's detail over
    the whole run, `bursts` customer service's detail per burst."""
    everything = [*background.values(), *bursts]
    begin = min(min(d["starts"]) for d in background.values() if d["starts"])
    end = min(max(f for f, _ in _finishes(d)) for d in background.values() if d["starts"])
    finished = [(f, n) for d in everything for f, n in _finishes(d)]
    total = sum(n for f, n in finished if begin <= f <= end)
    settled: list[float] = []
    every = [e for burst in bursts for e in burst["e2els"]]
    after_tokens, after_seconds = 0.0, 0.0
    for burst in bursts:
        if not burst["starts"]:
            continue
        first = min(burst["starts"])
        settled += [e for s, e in zip(burst["starts"], burst["e2els"], strict=True)
                    if s >= first + settle]
        last = max(f for f, _ in _finishes(burst))
        if last + after <= end:
            after_tokens += sum(_generated(d, last, last + after) for d in everything)
            after_seconds += after
    p95, p95_all = _p95_ms(settled), _p95_ms(every)
    return {
        "window_s": end - begin,
        "bursts": len([b for b in bursts if b["starts"]]),
        "cs_requests_after_settle": len(settled),
        "cs_p95_ms": p95,
        "cs_p95_vs_alone": p95 / alone_p95_ms if p95 and alone_p95_ms else None,
        "cs_requests": len(every),
        "cs_p95_all_ms": p95_all,
        "cs_p95_all_vs_alone": p95_all / alone_p95_ms if p95_all and alone_p95_ms else None,
        "tok_s": total / (end - begin) if end > begin else None,
        "after_burst_tok_s": after_tokens / after_seconds if after_seconds else None,
    }


def versus(modes: dict[str, dict[str, Any]], reference: str = "fcfs",
           base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each mode's throughput over the reference mode's (or over `base`, FCFS's figures from
    another engine's run), overall and after the bursts, and whether issue 44's targets are
    met (p95 within 1.3x of alone, at least 0.7 of FCFS's throughput, at least 0.95 of its
    throughput after each burst) and issue 45's go (p95 over every request, burst starts
    included, within 1.3x of alone, at least 0.7 of FCFS's throughput)."""
    base = base if base is not None else modes.get(reference, {})
    for fig in modes.values():
        fig["vs_fcfs"] = (fig["tok_s"] / base["tok_s"]
                          if fig.get("tok_s") and base.get("tok_s") else None)
        fig["after_vs_fcfs"] = (fig["after_burst_tok_s"] / base["after_burst_tok_s"]
                                if fig.get("after_burst_tok_s")
                                and base.get("after_burst_tok_s") else None)
        fig["target_met"] = bool((fig.get("cs_p95_vs_alone") or 99) <= 1.3
                                 and (fig["vs_fcfs"] or 0) >= 0.7
                                 and (fig["after_vs_fcfs"] or 0) >= 0.95)
        fig["go_all_requests"] = bool((fig.get("cs_p95_all_vs_alone") or 99) <= 1.3
                                      and (fig["vs_fcfs"] or 0) >= 0.7)
    return modes


def run(load: Callable[[list[tuple[str, int]], float, float], dict[str, Detail]],
        background: list[tuple[str, int]], burst: tuple[str, int], seconds: float,
        on: float = 15.0, off: float = 35.0) -> tuple[dict[str, Detail], list[Detail]]:
    """Run `background` ((slug, clients)) for `seconds` and, beside it, `burst` for `on`
    seconds every `on + off` (the first after `off / 2`), through `load`
    (`fairness_bench.Loads.run`). Returns the background's detail and each burst's."""
    out: dict[str, Detail] = {}
    errors: list[BaseException] = []

    def flood() -> None:
        try:
            out.update(load(background, seconds, 0.0))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    started = time.monotonic()
    bursts: list[Detail] = []
    time.sleep(off / 2)
    while time.monotonic() - started + on + off / 2 < seconds and not errors:
        bursts.append(load([burst], on, 0.0)[burst[0]])
        time.sleep(off)
    thread.join(seconds + 300)
    if errors:
        raise errors[0]
    return out, bursts
