"""The gateway's settings, read once per worker from Django settings (see console/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str
    fail_open: bool
    redis_timeout: float
    max_body_bytes: int
    key_ttl: float
    negative_key_ttl: float
    catalog_refresh: float
    connect_timeout: float
    upstream_timeout: float
    upstream_retries: int
    usage_stream: str
    event_buffer_max: int
    flow_control: bool = True
    flow_queue_timeout: float = 30.0
    flow_strict: bool = False
    flow_band_weights: tuple[float, ...] = (8.0, 4.0, 2.0, 1.0)
    flow_input_weight: float = 1.0
    flow_output_weight: float = 2.0
    flow_reserved_slots: int = 0
    flow_settled_hold_ms: int = 0
    wake_timeout: float = 180.0
    guard_processes: int = 2
    guard_timeout: float = 2.0
    window_ms: int = 60_000

    @property
    def lease_ms(self) -> int:
        """A concurrency lease outlives the longest request by a margin, then expires on its own
        (so a gateway that dies does not hold its tenant's slots forever)."""
        return int((self.upstream_timeout + 30.0) * 1000)

    @classmethod
    def from_settings(cls) -> GatewayConfig:
        return cls(
            redis_url=settings.GATEWAY["REDIS_URL"],
            fail_open=settings.GATEWAY["REDIS_FAILURE_POLICY"] == "open",
            redis_timeout=settings.GATEWAY["REDIS_TIMEOUT_SECONDS"],
            max_body_bytes=settings.GATEWAY["MAX_BODY_BYTES"],
            key_ttl=settings.GATEWAY["KEY_CACHE_SECONDS"],
            negative_key_ttl=settings.GATEWAY["NEGATIVE_KEY_CACHE_SECONDS"],
            catalog_refresh=settings.GATEWAY["CATALOG_REFRESH_SECONDS"],
            connect_timeout=settings.GATEWAY["UPSTREAM_CONNECT_TIMEOUT_SECONDS"],
            upstream_timeout=settings.GATEWAY["UPSTREAM_TIMEOUT_SECONDS"],
            upstream_retries=settings.GATEWAY["UPSTREAM_RETRIES"],
            usage_stream=settings.GATEWAY["USAGE_STREAM"],
            event_buffer_max=settings.GATEWAY["EVENT_BUFFER_MAX"],
            flow_control=settings.GATEWAY["FLOW_CONTROL"],
            flow_queue_timeout=settings.GATEWAY["FLOW_QUEUE_TIMEOUT_SECONDS"],
            flow_strict=settings.GATEWAY["FLOW_BANDS"] == "strict",
            flow_band_weights=tuple(settings.GATEWAY["FLOW_BAND_WEIGHTS"]),
            flow_input_weight=settings.GATEWAY["FLOW_INPUT_TOKEN_WEIGHT"],
            flow_output_weight=settings.GATEWAY["FLOW_OUTPUT_TOKEN_WEIGHT"],
            flow_reserved_slots=settings.GATEWAY["FLOW_RESERVED_SLOTS"],
            flow_settled_hold_ms=settings.GATEWAY["FLOW_SETTLED_HOLD_MS"],
            wake_timeout=settings.GATEWAY["WAKE_TIMEOUT_SECONDS"],
            guard_processes=settings.GATEWAY["GUARD_PROCESSES"],
            guard_timeout=settings.GATEWAY["GUARD_TIMEOUT_SECONDS"],
        )
