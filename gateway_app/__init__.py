"""The tenant gateway: one OpenAI-compatible endpoint under `/v1/` (see docs/gateway.md).

A raw ASGI app (`app.GatewayApp`) mounted by `console.asgi` in front of Django. Per request:
key lookup in an in-process cache (`cache`), model resolution in the tenant's catalog
(`catalog`), one atomic Redis script for admission (`admission`), the least-busy ready instance
(`routing`), the upstream call relayed chunk by chunk (`proxy`), and one Redis script that settles
the tokens and appends the usage event to a stream (`metering`). The batch writer (`writer`)
persists the events and rollups. Importing this package is cheap; nothing here runs at import.
"""
