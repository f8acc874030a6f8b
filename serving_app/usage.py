"""Usage metering models (events and rollups). Filled in by the gateway work."""

from __future__ import annotations

__all__: list[str] = []
