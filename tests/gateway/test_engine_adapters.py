"""Loading an adapter the engine already has is a success, not an error: a sync delivered twice
(or two syncs at once) must not mark a loaded adapter failed. Uses the suite's real engine, which
loads `acme--style` at start."""

from __future__ import annotations

from serving_app.engine.client import EngineClient, EngineReply, already_loaded
from tests.gateway.conftest import MODELS


def test_loading_an_adapter_the_engine_has_counts_as_loaded(engine):
    client = EngineClient(engine.url, engine.secret)
    reply = client.load_adapter("acme--style", str(MODELS / "tiny-llama-lora-a"))
    assert reply.ok, reply
    assert reply.status == 400 and "already been loaded" in reply.text  # what the engine said
    assert "acme--style" in {m["id"] for m in client.models()}


def test_other_load_failures_stay_failures(engine):
    client = EngineClient(engine.url, engine.secret)
    reply = client.load_adapter("acme--ghost", "/nonexistent/adapter")
    assert not reply.ok and reply.status == 404
    assert not already_loaded(EngineReply(False, 500, "LoRA rank 32 is greater than max_lora_rank"))
