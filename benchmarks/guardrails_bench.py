"""Guardrails benchmark: the per-request cost of a typical policy on 1 KB and 8 KB prompts,
without and with PII, against the same requests without guardrails, in the same run.

Usage::

    python benchmarks/guardrails_bench.py [--requests 2000] [--seed 1] [--chunk 4]

A request here is what the gateway does with a chat body anyway: decode the JSON, and encode it
again for the engine. "without guardrails" is exactly that; "with guardrails" adds the input
policy on every message's content (`Guard.apply`, one vault per request). Both are timed request
by request, interleaved, so they share the machine's noise; the ratio is p50 over p50 (and p99
over p99).

The typical policy: the platform floor blocks API keys and private keys on input and redacts
them on output; the tenant redacts emails, phone numbers (E.164 and China mobile), resident
IDs, bank cards, IBANs and IP addresses with placeholders, counts credit codes, and has a
deny-list of three code names. Prompts are English text with the numbers, times, versions and
punctuation that prompts have anyway ("without PII": no entity, but candidates such as years
for the prefilter to look at), "with PII" adds six entities.

The last rows stream an answer of each size through the output policy in `--chunk`-character
pieces (about one token each) and report the cost per answer and per piece, against redacting
the whole answer at once.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guardrails_app.detectors import builtin, deny_list  # noqa: E402
from guardrails_app.policy import Direction, Guard, Policy, Vault, effective  # noqa: E402
from guardrails_app.streaming import StreamRedactor  # noqa: E402

FLOOR = Policy.from_dict({
    "name": "platform",
    "input": {"api_key": "block", "private_key": "block"},
    "output": {"api_key": "redact", "private_key": "redact"},
})
TENANT = Policy.from_dict({
    "name": "tenant",
    "input": {"email": "redact", "phone": "redact", "cn_mobile": "redact",
              "cn_resident_id": "redact", "bank_card": "redact", "iban": "redact",
              "ip_address": "redact", "cn_uscc": "detect", "codenames": "redact"},
    "output": {"email": "redact", "phone": "redact", "cn_mobile": "redact",
               "bank_card": "redact", "codenames": "redact"},
})
PII = ["john.doe@example.com", "+1 415 555 2671", "13812345678", "110101199003074514",
       "4111 1111 1111 1111", "GB82 WEST 1234 5698 7654 32"]
TEXT = ("the a model request answer please summarize this report for our team in 2024 with "
        "results of Q3 revenue grew by 12.5% compared to last year; meeting at 10:30 on "
        "Monday, version 1.2.3 of the service, see section 4 and table 2. Thanks!")
WORDS = TEXT.split(" ")


def prose(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


def with_pii(rng: random.Random, text: str) -> str:
    cuts = sorted(rng.sample(range(len(text)), len(PII)))
    out, at = [], 0
    for cut, value in zip(cuts, PII, strict=True):
        cut = text.rfind(" ", 0, cut) + 1 or cut
        out += [text[at:cut], value, " "]
        at = cut
    return "".join(out) + text[at:]


def body(prompt: str) -> bytes:
    return json.dumps({
        "model": "tiny-llama",
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": prompt}],
        "max_tokens": 256,
    }).encode()


def plain(raw: bytes) -> bytes:
    return json.dumps(json.loads(raw)).encode()


def guarded(guard: Guard) -> Callable[[bytes], bytes]:
    def run(raw: bytes) -> bytes:
        data = json.loads(raw)
        vault = Vault()
        for message in data["messages"]:
            result = guard.apply(message["content"], Direction.INPUT, vault)
            if result.blocked:
                raise AssertionError("the benchmark's prompts are not meant to be blocked")
            message["content"] = result.text
        return json.dumps(data).encode()
    return run


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_pair(first: Callable[[bytes], bytes], second: Callable[[bytes], bytes],
               raws: list[bytes], requests: int) -> tuple[list[float], list[float]]:
    a, b = [], []
    clock = time.perf_counter_ns
    for i in range(requests):
        raw = raws[i % len(raws)]
        t0 = clock()
        first(raw)
        t1 = clock()
        second(raw)
        t2 = clock()
        a.append((t1 - t0) / 1000)
        b.append((t2 - t1) / 1000)
    return a, b


def stream_cost(guard: Guard, answers: list[str], chunk: int) -> tuple[float, float, int]:
    """(µs per answer streamed, µs per answer redacted whole, pieces per answer)."""
    streamed, whole = [], []
    for answer in answers:
        t0 = time.perf_counter_ns()
        redactor = StreamRedactor(guard.output, Vault())
        for at in range(0, len(answer), chunk):
            redactor.feed(answer[at:at + chunk])
        redactor.flush()
        t1 = time.perf_counter_ns()
        guard.apply(answer, Direction.OUTPUT, Vault())
        t2 = time.perf_counter_ns()
        streamed.append((t1 - t0) / 1000)
        whole.append((t2 - t1) / 1000)
    pieces = -(-len(answers[0]) // chunk)
    return statistics.median(streamed), statistics.median(whole), pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=4, help="characters per streamed piece")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    detectors = {**builtin(), "codenames": deny_list("codenames",
                                                     ["Project Falcon", "Bluebird", "Orca-7"])}
    guard = effective(FLOOR, TENANT).compile(detectors)
    run = guarded(guard)
    print(f"policy: {len(guard.input.detectors)} input detectors, {len(guard.output.detectors)} "
          f"output detectors (window {guard.output.window} characters); {args.requests} "
          "requests per row; times in µs per request")
    print(f"{'prompt':<16} {'no guardrails p50/p99':>22} {'guardrails p50/p99':>20} "
          f"{'ratio p50':>9} {'ratio p99':>9} {'added p50':>9}")
    for size in (1024, 8192):
        clean = [prose(rng, size) for _ in range(20)]
        dirty = [with_pii(rng, text) for text in clean]
        for label, prompts in (("without PII", clean), ("with PII", dirty)):
            raws = [body(p) for p in prompts]
            timed_pair(plain, run, raws, 50)  # warm-up
            base, with_guard = timed_pair(plain, run, raws, args.requests)
            b50, b99 = percentile(base, 0.5), percentile(base, 0.99)
            g50, g99 = percentile(with_guard, 0.5), percentile(with_guard, 0.99)
            print(f"{size // 1024} KB {label:<11} {b50:>10.1f} / {b99:>9.1f} {g50:>9.1f} / "
                  f"{g99:>8.1f} {g50 / b50:>9.1f} {g99 / b99:>9.1f} {g50 - b50:>9.1f}")
    print()
    print(f"output streamed in {args.chunk}-character pieces vs redacted whole "
          "(answers with PII; µs per answer)")
    for size in (1024, 8192):
        answers = [with_pii(rng, prose(rng, size)) for _ in range(10)]
        streamed, whole, pieces = stream_cost(guard, answers, args.chunk)
        print(f"{size // 1024} KB answer: streamed {streamed:>9.0f} ({pieces} pieces, "
              f"{streamed / pieces:.1f} per piece), whole {whole:>7.0f}")


if __name__ == "__main__":
    main()
