"""A capacity test as the node agent runs it, against the session's real CPU vLLM engine (the
`engine` fixture, shared with the gateway suites): vLLM's own benchmark client in the engine's
interpreter, over TLS with the console's certificate and the instance's secret, each level
saved as it finishes; and how it fails (a wrong secret, an engine gone, a client that cannot
start) or stops when cancelled. The runner is called as the Celery task calls it, in this
process: the routing of the task to the node's queue is tests/api/test_capacity_api.py's."""

from __future__ import annotations

import pytest

from benchmarks.gateway_bench import free_port
from serving_app import frontier
from serving_app.engine import capacity
from serving_app.models import BaseModel, CapacityTest, Deployment, Instance, Node
from serving_app.models.capacity import costs_on
from tests.engines import MODELS

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

TINY = {"input_tokens": 32, "output_tokens": 8, "concurrency": [1, 2], "requests_per_level": 4}


@pytest.fixture
def deployment(engine, acme):
    """A deployment whose one ready instance is the session's engine, on a node of this host
    (its engine interpreter: the engine environment, as the agent's default)."""
    base = BaseModel(name="tiny-llama", path=str(MODELS / "tiny-llama"))
    base.full_clean()
    base.save()
    deployment = Deployment.objects.create(name="tiny-capacity", base_model=base,
                                           desired_state="running", max_model_len=1024,
                                           max_num_seqs=4)
    deployment.tenants.set([acme.tenant])
    node = Node.objects.create(name="capacity-host", queue="node.capacity-host",
                               address="127.0.0.1")
    Instance.objects.create(deployment=deployment, node=node, port=engine.port, state="ready",
                            secret=engine.secret, command=[f"--model={base.path}"])
    return deployment


def run(deployment, by, **settings) -> CapacityTest:
    test = CapacityTest.objects.start(deployment, by, **{**TINY, **settings})
    capacity.run_capacity_test(test.pk)
    test.refresh_from_db()
    return test


def test_each_level_is_measured_on_the_engine_with_vllms_client(deployment, platform_admin,
                                                                 acme):
    test = run(deployment, platform_admin)
    assert (test.state, test.error, test.levels_done) == ("succeeded", "", 2)
    assert test.started_at is not None and test.finished_at >= test.started_at
    points = list(test.points.all())
    assert [p.concurrency for p in points] == [1, 2]
    for p in points:
        assert (p.completed, p.failed, p.errors) == (4, 0, [])
        assert p.output_tokens == 4 * 8  # --ignore-eos: every request its 8 tokens
        assert p.tokens_per_s > 0 and p.duration_s > 0
        assert 0 < p.ttft_p50_ms <= p.ttft_p95_ms <= p.e2e_p95_ms
        assert 0 < p.tpot_p50_ms <= p.tpot_p95_ms
    # The deployment's curve now, and what an objective costs on it.
    (row,) = costs_on([deployment], frontier.Objectives())
    assert row.curve == test and row.cost is not None and row.cost.reach == frontier.WHOLE
    (none,) = costs_on([deployment], frontier.Objectives(ttft_ms=0.001))
    assert none.cost is not None and none.cost.reach == frontier.NONE


def test_an_engine_refusing_every_request_fails_the_test_with_its_answer(deployment,
                                                                          platform_admin):
    Instance.objects.filter(deployment=deployment).update(secret="not-the-engines-secret")
    test = run(deployment, platform_admin)
    assert test.state == "failed" and test.points.count() == 0
    assert "No request at 1 concurrent completed" in test.error
    assert "Unauthorized" in test.error  # the engine refused the key


def test_an_engine_gone_fails_the_test_with_what_was_seen(deployment, platform_admin):
    Instance.objects.filter(deployment=deployment).update(port=free_port())
    test = run(deployment, platform_admin)
    assert test.state == "failed"
    assert "does not answer /health" in test.error


def test_a_client_that_cannot_start_fails_the_test_not_the_agent(deployment, platform_admin):
    Node.objects.filter(name="capacity-host").update(engine_python="/nowhere/bin/python")
    test = run(deployment, platform_admin)
    assert test.state == "failed"
    assert "vLLM's benchmark client could not start (/nowhere/bin/python)" in test.error


def test_a_test_cancelled_while_it_runs_saves_nothing_more(deployment, platform_admin,
                                                           monkeypatch):
    """Cancelled as the first level is saved (no timing): the second is never measured."""
    saved = CapacityTest.add_point

    def add_then_cancel(self, point, errors):
        added = saved(self, point, errors)
        CapacityTest.objects.get(pk=self.pk).cancel()
        return added

    monkeypatch.setattr(CapacityTest, "add_point", add_then_cancel)
    test = run(deployment, platform_admin)
    assert (test.state, test.error) == ("cancelled", "")
    assert [p.concurrency for p in test.points.all()] == [1]
