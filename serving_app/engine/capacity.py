"""A capacity test as its node agent runs it: vLLM's own benchmark client against one engine.

The test (`serving_app.models.capacity.CapacityTest`) was queued on the node agent's queue of
the node running the instance it measures. The agent starts vLLM's benchmark client in the
node's engine interpreter (serving_app/engine/benchclient.py; the node's engine Python and vLLM
folder, as its engines are started) and loads the engine directly, as the gateway calls it:
its address, TLS with this node's certificate of the console CA, the instance's secret as the
API key, the deployment's served model name. Each level is one run of vLLM's client with the
random dataset (`--ignore-eos`, the base model's tokenizer: the engine's own `--model` folder),
`requests_per_level` requests at that concurrency; its figures are saved as it finishes, so
the page shows progress. Each level's prompts come from a seed of their own, so that no level
finds another's prompts in the prefix cache.

A cancelled test sends no more requests (the client's stop file: those in flight complete) and
saves nothing more. Whatever goes wrong ends as the test's error, never as the agent's crash:
the instance not ready, the engine not answering, every request of a level failing (with the
instance's state and last error when it has gone), the client dying (with its log's tail), a
level past CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS. A test left running by an agent that stopped is
failed when the agent starts again (`fail_interrupted`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from django.conf import settings

from serving_app import frontier, pki
from serving_app.engine import environment, supervisor
from serving_app.engine.benchclient import ROOT, BenchClient, ClientDied
from serving_app.engine.client import EngineClient
from serving_app.models import CapacityTest, Instance

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_SECONDS = 10.0
WARMUPS = 4  # requests at each level before it is measured, as many at once as it allows


def run_capacity_test(test_id: int) -> str:
    """Run the queued test `test_id` on this node; its final state (a test already begun or
    cancelled is left as it is: Celery may deliver twice)."""
    test = (CapacityTest.objects.select_related("deployment__base_model", "instance__node")
            .filter(pk=test_id).first())
    if test is None:
        return "gone"
    if not test.begin():
        return test.state
    try:
        error = measure(test)
    except Exception as exc:  # the agent goes on whatever one test hit
        log.exception("capacity test %s", test_id)
        error = f"The capacity test stopped on an unexpected error: {type(exc).__name__}: {exc}"
    test.finish(error)
    test.refresh_from_db(fields=["state"])
    log.info("capacity test %s of %s: %s %s", test.pk, test.deployment, test.state, error)
    return test.state


def measure(test: CapacityTest) -> str:
    """Measure every level of `test`, saving each; the error that ended it ("" when it got
    through, or was cancelled)."""
    instance = test.instance
    if instance is not None:
        instance.refresh_from_db()
    if instance is None or instance.state != Instance.State.READY or instance.node is None \
            or instance.port is None:
        state = instance.get_state_display().lower() if instance is not None else "gone"
        return (f"The instance to measure is no longer ready ({state}): run the test again "
                "once the deployment has a ready instance.")
    if not EngineClient(instance.base_url, instance.secret).healthy(HEALTH_TIMEOUT_SECONDS):
        return (f"The engine at {instance.base_url} does not answer /health: check the "
                "instance's log, then run the test again.")
    node = instance.node
    python = environment.interpreter(node.engine_env, node.engine_python)
    env = supervisor.engine_environment(dict(os.environ),
                                        environment.pythonpath_env(node.engine_pythonpath))
    with tempfile.TemporaryDirectory(prefix=f"capacity-{test.pk}-") as folder:
        try:
            client = BenchClient(Path(folder) / "client.log", python, env=env, cwd=ROOT)
        except ClientDied as exc:
            return str(exc)
        try:
            return _levels(test, instance, client, Path(folder))
        except ClientDied as exc:
            return str(exc)
        finally:
            client.close()


def _levels(test: CapacityTest, instance: Instance, client: BenchClient, folder: Path) -> str:
    tls = engine_tls()
    for index, concurrency in enumerate(test.concurrency):
        if test.is_cancelled():
            return ""
        try:
            got = client.run(vllm_argv(test, instance, concurrency, seed=test.pk * 100 + index),
                             instance.secret, str(folder / f"stop-{concurrency}"), tls=tls,
                             timeout=settings.CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS,
                             stopping=test.is_cancelled)
        except TimeoutError as exc:
            return (f"{concurrency} concurrent requests did not finish: {exc} "
                    "(CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS); check the engine.")
        if test.is_cancelled():
            return ""
        if not got["completed"]:
            return no_request_completed(instance, concurrency, got["errors"])
        point = frontier.summarise(concurrency, got["duration"], ttfts_s=got["ttfts"],
                                   e2els_s=got["e2els"], output_lens=got["output_lens"],
                                   failed=got["failed"])
        if not test.add_point(point, got["errors"]):
            return ""
    return ""


def no_request_completed(instance: Instance, concurrency: int, errors: list[str]) -> str:
    """A level where every request failed: what the client saw, and what became of the
    engine's instance (the supervisor may have seen it go)."""
    instance.refresh_from_db(fields=["state", "last_error"])
    seen = "; ".join(errors[:3]) or "no error reported"
    where = ""
    if instance.state != Instance.State.READY:
        where = f" The instance is {instance.get_state_display().lower()} now"
        where += f": {instance.last_error}" if instance.last_error else "."
    return (f"No request at {concurrency} concurrent completed: {seen}.{where} Check the "
            "engine's log, then run the test again.")


def vllm_argv(test: CapacityTest, instance: Instance, concurrency: int, seed: int) -> list[str]:
    """vLLM's client arguments for one level of `test` against `instance`."""
    deployment = test.deployment
    return ["--backend", "openai-chat", "--base-url", instance.base_url,
            "--endpoint", "/v1/chat/completions", "--model", deployment.base_model.name,
            "--tokenizer", tokenizer(instance), "--dataset-name", "random",
            "--random-input-len", str(test.input_tokens),
            "--random-output-len", str(test.output_tokens), "--random-range-ratio", "0",
            "--num-prompts", str(test.requests_per_level), "--max-concurrency", str(concurrency),
            "--num-warmups", str(min(WARMUPS, concurrency)), "--ready-check-timeout-sec", "0",
            "--seed", str(seed), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--save-detailed"]


def tokenizer(instance: Instance) -> str:
    """The folder the engine loaded its model (and so its tokenizer) from: its own `--model`,
    else the base model's path."""
    for arg in instance.command or []:
        if isinstance(arg, str) and arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return instance.deployment.base_model.path


def engine_tls() -> dict[str, str] | None:
    """The files this node calls its engines with (serving_app/pki.py): none without TLS."""
    if not settings.ENGINE_TLS:
        return None
    pki.shared_client_context()  # makes them where they are this host's to make
    certfile, keyfile = pki.client_paths()
    return {"cafile": str(pki.ca_cert_path()), "certfile": str(certfile),
            "keyfile": str(keyfile)}


def fail_interrupted(node_name: str) -> int:
    """Fail the tests this node's agent was running when it stopped (their client went with
    it); how many."""
    failed = 0
    for test in CapacityTest.objects.filter(node_name=node_name,
                                            state=CapacityTest.State.RUNNING):
        failed += test.finish("The node agent restarted while the test ran: run it again.")
    return failed
