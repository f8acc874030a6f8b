"""The batch writer: usage events from the Redis stream into PostgreSQL, with rollups.

Events are read through a consumer group, so several writers share the work and an event is
removed from the stream only after the transaction holding it has committed (XACK + XDEL after
commit). While PostgreSQL is down the events stay in the stream (this consumer's pending list)
and the same batch is retried with backoff; nothing in the request path waits for it.
Redelivery after a crash between commit and acknowledgement is harmless: events already stored
(unique `request_id`) are skipped, and rollups are incremented only for events inserted by the
same transaction. The writer also stamps `ApiKey.last_used_at`, so the request path never writes
to the database.

Redis restarted empty (no persistence) or the stream deleted: the consumer group is gone and
every read answers NOGROUP. The writer then creates the group again from the stream's start (id
0), so every entry the stream holds now is read, and carries on; nothing needs a manual step.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Model, Q

from serving_app.models import Deployment, LoraAdapter, PriceTable
from serving_app.models.usage import (
    GUARDRAIL_FIELDS_KEPT,
    LATENCY_FIELDS,
    ROLLUP_COUNTERS,
    TOTAL_BUCKET,
    TTFT_FIELDS,
    GuardrailHour,
    GuardrailMinute,
    GuardrailTotal,
    KeyUsage,
    UsageEvent,
    UsageHour,
    UsageMinute,
    UsageTenSecond,
    UsageTotal,
    bucket_index,
    key_usage_bucket,
)
from tenants_app.models import ApiKey

if TYPE_CHECKING:  # redis-py's reply types (not in every redis-py the project allows)
    from redis.typing import XReadGroupResponse

log = logging.getLogger(__name__)

_COUNTERS = ROLLUP_COUNTERS
_MAXIMA = ("latency_ms_max", "ttft_ms_max")
# A usage rollup's row: (bucket, tenant, model, deployment or 0).
RollupKey = tuple[datetime, int, str, int]
# A guardrail rollup's row: (bucket, tenant, direction, action, category).
GuardrailKey = tuple[datetime, int, str, str, str]
GuardrailCounts = tuple[int, int]  # findings, requests
# A stream entry as the writer's client reads it (bytes, not decoded): its id and its fields.
Entry = tuple[bytes, dict[bytes, bytes]]
# Each rollup and how it truncates an event's time to its bucket.
_ROLLUPS: tuple[tuple[type[Model], Callable[[datetime], datetime]], ...] = (
    (UsageTenSecond, lambda d: d.replace(second=d.second - d.second % 10, microsecond=0)),
    (UsageMinute, lambda d: d.replace(second=0, microsecond=0)),
    (UsageHour, lambda d: d.replace(minute=0, second=0, microsecond=0)),
    (UsageTotal, lambda d: TOTAL_BUCKET),
)
CLAIM_IDLE_MS = 60_000
# The guardrail rollups and their buckets (the usage rollups' truncations).
_GUARDRAIL_ROLLUPS: tuple[tuple[type[Model], Callable[[datetime], datetime]], ...] = (
    (GuardrailMinute, _ROLLUPS[1][1]),
    (GuardrailHour, _ROLLUPS[2][1]),
    (GuardrailTotal, _ROLLUPS[3][1]),
)
NO_COUNTER = b"gw:{none}:u"  # entries without a budget counter (never incremented)


# Acknowledge and delete stored entries; for each entry actually deleted, lower the budget's
# `unwritten` counter it names (see admission.SETTLE_LUA) by its tokens. Only an entry this Redis
# still held counts: after a restart that lost the stream, the counter went with it.
# KEYS: the stream, then each entry's counter; ARGV: the group, the ids, then the tokens.
# `allow-oom`: a full Redis (noeviction) must still let the writer empty the stream.
ACK_LUA = """#!lua flags=allow-oom
local n = #KEYS - 1
for i = 1, n do
  local id = ARGV[1 + i]
  local tokens = tonumber(ARGV[1 + n + i])
  redis.call('XACK', KEYS[1], ARGV[1], id)
  if redis.call('XDEL', KEYS[1], id) == 1 and tokens > 0 then
    if redis.call('DECRBY', KEYS[1 + i], tokens) <= 0 then redis.call('DEL', KEYS[1 + i]) end
  end
end
return n
"""


# Create the consumer group from the stream's start (the stream too, if missing). A script so that
# it runs on a full Redis too (XGROUP CREATE alone is refused there).
CREATE_GROUP_LUA = """#!lua flags=allow-oom
local ok = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(ok) == 'table' and ok.err and not string.find(ok.err, 'BUSYGROUP') then return ok end
return 1
"""


def _group_lost(exc: redis.ResponseError) -> bool:
    """Redis lost the stream or its consumer group (a restart without persistence, a flush)."""
    return str(exc).startswith("NOGROUP")


def _read_entries(reply: XReadGroupResponse) -> list[Entry]:
    """The entries of an XREADGROUP reply for the writer's one stream. redis-py types the reply
    of either protocol; the writer's client speaks RESP2: `[[stream, [(id, fields), ...]]]`,
    or nothing when no entry came."""
    if not reply:
        return []
    if not isinstance(reply, list):
        raise TypeError(f"XREADGROUP replied with a {type(reply).__name__}, not RESP2's list")
    entries: list[Entry] = reply[0][1]
    return entries


def _event_row(event: dict[str, Any]) -> UsageEvent:
    return UsageEvent(
        request_id=str(event["id"])[:64],
        created_at=datetime.fromtimestamp(float(event["at"]), UTC),
        tenant_id=event.get("tenant"),
        api_key_id=event.get("key"),
        endpoint=str(event.get("endpoint") or "")[:32],
        model=str(event.get("model") or "")[:200],
        adapter=str(event.get("adapter") or "")[:200],
        deployment_id=event.get("deployment"),
        instance_id=event.get("instance"),
        status_code=int(event.get("status") or 0),
        error_code=str(event.get("error") or "")[:64],
        error_message=str(event.get("message") or "")[:500],
        stream=bool(event.get("stream")),
        prompt_tokens=max(0, int(event.get("prompt") or 0)),
        completion_tokens=max(0, int(event.get("completion") or 0)),
        reserved_tokens=max(0, int(event.get("reserved") or 0)),
        cached_tokens=max(0, int(event.get("cached") or 0)),
        ttft_ms=event.get("ttft_ms"),
        latency_ms=float(event.get("latency_ms") or 0.0),
        guardrails=_guardrail_counts(event.get("guardrails")),
        guardrail_fields=_guardrail_fields(event.get("guardrail_fields")),
        stages=_stage_times(event.get("stages")),
    )


def _stage_times(value: Any) -> list[list[str | float]]:
    """The event's stages, keeping only `[name, milliseconds]` pairs."""
    if not isinstance(value, list):
        return []
    return [[str(pair[0])[:32], float(pair[1])] for pair in value
            if isinstance(pair, list | tuple) and len(pair) == 2
            and isinstance(pair[1], int | float) and not isinstance(pair[1], bool)]


def _guardrail_counts(value: Any) -> dict[str, int]:
    """The event's guardrail counts, keeping only `direction:action:CATEGORY` -> count."""
    if not isinstance(value, dict):
        return {}
    return {str(k)[:80]: int(v) for k, v in value.items()
            if isinstance(v, int) and v > 0 and str(k).count(":") == 2}


# An entry of an event's `guardrail_fields`: these keys, strings of at most these lengths.
_FIELD_KEYS = {"direction": 16, "field": 200, "detector": 64, "category": 64, "action": 16}


def _guardrail_fields(value: Any) -> list[dict[str, str | int]]:
    """The event's per-field findings, keeping only well-formed entries (strings cut to their
    limits, a positive count), at most `GUARDRAIL_FIELDS_KEPT`."""
    if not isinstance(value, list):
        return []
    out: list[dict[str, str | int]] = []
    for entry in value[:GUARDRAIL_FIELDS_KEPT]:
        if not isinstance(entry, dict):
            continue
        count = entry.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            continue
        kept: dict[str, str | int] = {k: str(entry.get(k) or "")[:n]
                                      for k, n in _FIELD_KEYS.items()}
        kept["count"] = count
        out.append(kept)
    return out


def _rollups(rows: list[UsageEvent]) -> list[dict[RollupKey, dict[str, Any]]]:
    """For each of _ROLLUPS: counters and maxima per (bucket, tenant, model, deployment)."""
    groups: list[dict[RollupKey, dict[str, Any]]] = [{} for _ in _ROLLUPS]
    over = len(LATENCY_FIELDS)  # above the last bound: counted in the requests, in no bucket
    for row in rows:
        if row.tenant_id is None:
            continue
        latency_bucket = bucket_index(row.latency_ms)
        ttft = row.ttft_ms
        ttft_bucket = None if ttft is None else bucket_index(ttft)
        server_error = row.status_code >= 500
        for (_, truncate), by_key in zip(_ROLLUPS, groups, strict=True):
            key = (truncate(row.created_at), row.tenant_id, row.model, row.deployment_id or 0)
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = dict.fromkeys((*_COUNTERS, *_MAXIMA), 0)
            g["requests"] += 1
            g["errors"] += row.status_code >= 400
            g["server_errors"] += server_error
            g["rate_limited"] += row.status_code == 429
            g["prompt_tokens"] += row.prompt_tokens
            g["completion_tokens"] += row.completion_tokens
            g["cached_tokens"] += row.cached_tokens
            g["cost"] += row.cost or 0
            g["latency_ms_total"] += row.latency_ms
            g["latency_ms_max"] = max(g["latency_ms_max"], row.latency_ms)
            if latency_bucket < over:
                g[LATENCY_FIELDS[latency_bucket]] += 1
            if ttft is not None and ttft_bucket is not None:
                g["ttft_ms_total"] += ttft
                g["ttft_count"] += 1
                g["ttft_ms_max"] = max(g["ttft_ms_max"], ttft)
                if ttft_bucket < over:
                    g[TTFT_FIELDS[ttft_bucket]] += 1
    return groups


def _price(rows: list[UsageEvent]) -> None:
    """Each event's cost at the price card in force when it arrived (its adapter's card, else
    its base model's), exact in Decimal; none when no card was in force. Three queries a batch:
    the cards, the batch's deployments' base models, its adapters."""
    table = PriceTable.load()
    if not table:
        return
    deployments = {row.deployment_id for row in rows if row.deployment_id}
    base_of = dict(Deployment.objects.filter(pk__in=deployments)
                   .values_list("pk", "base_model_id"))
    named = {(row.tenant_id, row.adapter.partition("--")[2]) for row in rows if row.adapter}
    adapters: dict[tuple[int | None, str], int] = {}
    if named:
        found = LoraAdapter.objects.filter(
            tenant_id__in={t for t, _ in named}, name__in={n for _, n in named})
        adapters = {(t, n): pk for pk, t, n in found.values_list("pk", "tenant_id", "name")}
    for row in rows:
        if not row.deployment_id:
            continue
        adapter_id = adapters.get((row.tenant_id, row.adapter.partition("--")[2])) \
            if row.adapter else None
        price = table.price_at(base_of.get(row.deployment_id), adapter_id,
                               row.created_at.timestamp())
        if price is not None:
            row.cost = price.cost(row.prompt_tokens, row.cached_tokens, row.completion_tokens)
            row.price_card_id = price.card_id


def _upsert_key_usage(rows: list[UsageEvent]) -> None:
    """Requests, tokens and cost per (15-minute bucket, tenant, key): a key's spend is a sum
    of its buckets."""
    groups: dict[tuple[datetime, int, int], dict[str, Any]] = {}
    for row in rows:
        if row.tenant_id is None:
            continue
        key = (key_usage_bucket(row.created_at), row.tenant_id, row.api_key_id or 0)
        g = groups.setdefault(key, dict.fromkeys(KeyUsage.COUNTERS, 0))
        g["requests"] += 1
        g["prompt_tokens"] += row.prompt_tokens
        g["cached_tokens"] += row.cached_tokens
        g["completion_tokens"] += row.completion_tokens
        g["cost"] += row.cost or 0
    if not groups:
        return
    qn = connection.ops.quote_name
    table = qn(KeyUsage._meta.db_table)
    keys = ["bucket", "tenant_id", "api_key_id"]
    counters = list(KeyUsage.COUNTERS)
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(c) for c in [*keys, *counters])}) "
        f"VALUES ({', '.join(['%s'] * (len(keys) + len(counters)))}) "
        f"ON CONFLICT ({', '.join(qn(c) for c in keys)}) DO UPDATE SET "
        + ", ".join(f"{qn(c)} = {table}.{qn(c)} + EXCLUDED.{qn(c)}" for c in counters)
    )
    params = [[connection.ops.adapt_datetimefield_value(bucket), tenant_id, key_id,
               *(values[c] for c in counters)]
              for (bucket, tenant_id, key_id), values in sorted(groups.items())]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def _guardrail_rollups(rows: list[UsageEvent]) -> list[dict[GuardrailKey, GuardrailCounts]]:
    """For each of _GUARDRAIL_ROLLUPS: (findings, requests) per (bucket, tenant, direction,
    action, category), from the events' `direction:action:CATEGORY` counts."""
    groups: list[dict[GuardrailKey, GuardrailCounts]] = [{} for _ in _GUARDRAIL_ROLLUPS]
    for row in rows:
        if row.tenant_id is None or not row.guardrails:
            continue
        for name, count in row.guardrails.items():
            direction, action, category = name.split(":", 2)
            for (_, truncate), by_key in zip(_GUARDRAIL_ROLLUPS, groups, strict=True):
                key = (truncate(row.created_at), row.tenant_id, direction[:8], action[:8],
                       category[:60])
                found, requests = by_key.get(key, (0, 0))
                by_key[key] = (found + count, requests + 1)
    return groups


def _upsert_guardrails(model: type[Model], groups: dict[GuardrailKey, GuardrailCounts]) -> None:
    if not groups:
        return
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    keys = ["bucket", "tenant_id", "direction", "action", "category"]
    counters = ["count", "requests"]
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(c) for c in [*keys, *counters])}) "
        f"VALUES ({', '.join(['%s'] * (len(keys) + len(counters)))}) "
        f"ON CONFLICT ({', '.join(qn(c) for c in keys)}) DO UPDATE SET "
        + ", ".join(f"{qn(c)} = {table}.{qn(c)} + EXCLUDED.{qn(c)}" for c in counters)
    )
    params = [[connection.ops.adapt_datetimefield_value(bucket), tenant_id, direction, action,
               category, count, requests]
              for (bucket, tenant_id, direction, action, category), (count, requests)
              in sorted(groups.items())]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def _upsert(model: type[Model], groups: dict[RollupKey, dict[str, Any]]) -> None:
    if not groups:
        return
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    columns = ["bucket", "tenant_id", "model", "deployment_id", *_COUNTERS, *_MAXIMA]
    greatest = "GREATEST" if connection.vendor == "postgresql" else "MAX"
    updates = [f"{qn(c)} = {table}.{qn(c)} + EXCLUDED.{qn(c)}" for c in _COUNTERS]
    updates += [f"{qn(c)} = {greatest}({table}.{qn(c)}, EXCLUDED.{qn(c)})" for c in _MAXIMA]
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(c) for c in columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))}) "
        f"ON CONFLICT ({qn('bucket')}, {qn('tenant_id')}, {qn('model')}, {qn('deployment_id')}) "
        f"DO UPDATE SET {', '.join(updates)}"
    )
    params: list[list[str | int | float | None]] = []
    # Sorted, so that two writers lock the rows they share in the same order (no deadlock).
    for (bucket, tenant_id, name, deployment_id), values in sorted(groups.items()):
        params.append([
            connection.ops.adapt_datetimefield_value(bucket), tenant_id, name, deployment_id,
            *(values[c] for c in _COUNTERS), *(values[c] for c in _MAXIMA),
        ])
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def persist(events: list[dict[str, Any]]) -> int:
    """Store events not stored yet, their rollups and keys' last use, in one transaction.
    Returns how many were new."""
    rows: dict[str, UsageEvent] = {}
    for event in events:
        row = _event_row(event)
        rows.setdefault(row.request_id, row)
    with transaction.atomic():
        existing = set(
            UsageEvent.objects.filter(request_id__in=list(rows)).values_list(
                "request_id", flat=True
            )
        )
        new = [row for rid, row in rows.items() if rid not in existing]
        _price(new)
        UsageEvent.objects.bulk_create(new, batch_size=1000)
        _upsert_key_usage(new)
        for (rollup, _), groups in zip(_ROLLUPS, _rollups(new), strict=True):
            _upsert(rollup, groups)
        for (rollup, _), counts in zip(_GUARDRAIL_ROLLUPS, _guardrail_rollups(new), strict=True):
            _upsert_guardrails(rollup, counts)
        last_used: dict[int, datetime] = {}
        for row in new:
            if row.api_key_id and row.status_code < 400:
                last_used[row.api_key_id] = max(last_used.get(row.api_key_id, row.created_at),
                                                row.created_at)
        for key_id, at in last_used.items():
            ApiKey.objects.filter(pk=key_id).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lt=at)
            ).update(last_used_at=at)
    return len(new)


class UsageWriter:
    """Moves events from the stream to the database, one batch per `run_once()`."""

    def __init__(
        self,
        client: redis.Redis | None = None,
        *,
        stream: str | None = None,
        group: str | None = None,
        consumer: str | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.redis = client or redis.Redis.from_url(
            settings.GATEWAY["REDIS_URL"], socket_timeout=10.0, socket_connect_timeout=5.0
        )
        self.stream = stream or settings.GATEWAY["USAGE_STREAM"]
        self.group = group or settings.GATEWAY["USAGE_GROUP"]
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.batch_size = batch_size or settings.GATEWAY["USAGE_BATCH_SIZE"]
        self._group_ready = False
        self._ack = self.redis.register_script(ACK_LUA)
        self._create_group = self.redis.register_script(CREATE_GROUP_LUA)
        self.group_recreated = 0  # how often Redis lost the group under this writer

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        # From the stream's start: events appended before any writer existed count too.
        self._create_group(keys=[self.stream], args=[self.group])
        self._group_ready = True

    def _recreate_group(self, exc: redis.ResponseError) -> None:
        log.warning("usage stream %s lost its consumer group (%s): creating it again from the "
                    "stream's start", self.stream, exc)
        self._group_ready = False
        self.group_recreated += 1
        self._ensure_group()

    def _next_batch(self, block_ms: int) -> list[Entry]:
        # 1. Our own pending entries (read before, not stored yet: the database was down).
        entries = _read_entries(self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: "0"}, count=self.batch_size
        ))
        if entries:
            return entries
        # 2. Entries left pending by a writer that died.
        claimed = self.redis.xautoclaim(
            self.stream, self.group, self.consumer, CLAIM_IDLE_MS, "0-0", count=self.batch_size
        )
        if claimed and claimed[1]:
            return [e for e in claimed[1] if e and e[1] is not None]
        # 3. New entries.
        return _read_entries(self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=self.batch_size,
            block=block_ms or None,
        ))

    def run_once(self, block_ms: int = 1000) -> int:
        """Persist one batch; returns the number of stream entries handled. Raises on a
        database error (the entries stay pending and are retried)."""
        self._ensure_group()
        try:
            entries = self._next_batch(block_ms)
        except redis.ResponseError as exc:
            if not _group_lost(exc):
                raise
            self._recreate_group(exc)
            entries = self._next_batch(block_ms)
        if not entries:
            return 0
        ids = [entry_id for entry_id, _ in entries]
        counters = [fields.get(b"u") or NO_COUNTER for _, fields in entries]
        tokens = [int(fields.get(b"n") or 0) for _, fields in entries]
        events = []
        for entry_id, fields in entries:
            try:
                events.append(json.loads(fields[b"e"]))
            except (KeyError, ValueError, TypeError):
                log.error("dropping malformed usage entry %s: %r", entry_id, fields)
        try:
            persist(events)
        except (OperationalError, InterfaceError):
            connection.close()  # reconnect next time
            raise
        except DatabaseError:
            connection.close()
            self._persist_one_by_one(events)
        self._acknowledge(ids, counters, tokens)
        return len(entries)

    def _acknowledge(self, ids: list[bytes], counters: list[bytes], tokens: list[int]) -> None:
        """Remove stored entries from the stream (one script, atomic with the budget's
        `unwritten` counters). After a Redis restart between the read and here they may be gone
        already, and the group with them: the group is created again and the script run once
        more (it deletes nothing then); ids of entries added since are later than these."""
        keys: list[str | bytes] = [self.stream, *counters]
        args: list[str | bytes | int] = [self.group, *ids, *tokens]
        try:
            self._ack(keys=keys, args=args)
        except redis.ResponseError as exc:
            if not _group_lost(exc):
                raise
            self._recreate_group(exc)
            self._ack(keys=keys, args=args)

    def _persist_one_by_one(self, events: list[dict[str, Any]]) -> None:
        """A batch the database refuses (not a connection problem): keep every good event."""
        for event in events:
            try:
                persist([event])
            except (OperationalError, InterfaceError):
                connection.close()
                raise
            except (DatabaseError, ValueError, TypeError) as exc:
                connection.close()
                log.error("dropping usage event the database refuses: %r (%s)", event, exc)

    def drain(self, max_seconds: float = 50.0) -> int:
        """Persist until the stream is empty or time is up (the periodic task's body)."""
        deadline = time.monotonic() + max_seconds
        total = 0
        while time.monotonic() < deadline:
            handled = self.run_once(block_ms=0)
            total += handled
            if handled == 0:
                break
        return total

    def run_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """The writer loop: batches as they come, backing off while the database is down."""
        backoff = 0.5
        while not should_stop():
            try:
                self.run_once(block_ms=1000)
                backoff = 0.5
            except (OperationalError, InterfaceError, redis.RedisError) as exc:
                log.warning("usage writer waiting (%s); retrying in %.1fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
