"""A deployment's LoRA adapters on this node's engines: each checked before an engine is given
it (a bad `--lora-modules` entry takes a shared engine down at start), loaded and unloaded at run
time to follow the deployment (`sync_adapters()`), and each proven by its canary generation
before it is routed to (`probe_adapters()`, tried again by `retry_canaries()`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError

from serving_app import signals, storage
from serving_app.artifacts import staging
from serving_app.engine import canary
from serving_app.engine.client import EngineClient
from serving_app.engine.config import AgentConfig, current_config
from serving_app.engine.failures import write_log
from serving_app.engine.launch import adapter_capacity
from serving_app.enginespec import EngineSpec
from serving_app.modelfiles import ModelFilesError, expected_module_shapes, read_adapter
from serving_app.models import Deployment, Instance, LoraAdapter, canaries, events

log = logging.getLogger(__name__)
State = Instance.State
NO_FREE_SLOT = "No free adapter slot"
CANARY_FAILED = "Canary generation failed"


# -- checked before an engine is given them ------------------------------------------------------
def _adapter_folder(adapter: LoraAdapter, node_name: str | None,
                    instance: Instance | None = None) -> Path:
    """The folder to give the engine: the adapter's version in this node's cache (fetched with
    its progress on `instance`, the one staging), or (legacy) its host path, checked."""
    if adapter.artifact_version_id and node_name:
        try:
            return staging.adapter_folder(
                adapter, staging.NodeCacheConfig.from_environment(node_name), instance)
        except staging.StagingError as exc:
            raise ModelFilesError(f"Staging {exc}") from exc
    return adapter.check_path()


def adapter_problem(adapter: LoraAdapter, deployment: Deployment, max_lora_rank: int,
                    node_name: str | None = None,
                    staging_for: Instance | None = None) -> tuple[str, str] | None:
    """Why the engines of `deployment` started with `max_lora_rank` must not be given `adapter`
    now, or None if they may.

    A shared engine exits at start on one bad `--lora-modules` entry (a rank above its
    max_lora_rank, tensors that do not match the base model, unreadable files), taking every
    tenant on it down; so each adapter is checked here, as its files are now (they may have
    changed since it was registered), and one that fails is left out. Returns (what the
    adapter's tenant is shown, the detail for the engine log): a problem with the host path
    itself is shown to tenants as the generic message only.
    """
    if adapter.base_model_id != deployment.base_model_id:
        message = f"It is an adapter for {adapter.base_model}, not {deployment.base_model}."
        return message, message
    try:
        folder = _adapter_folder(adapter, node_name, staging_for)
        info = read_adapter(str(folder))
    except ValidationError as exc:
        detail = "; ".join(exc.messages)
        return storage.GENERIC_PATH_ERROR, detail
    except ModelFilesError as exc:
        return (storage.GENERIC_PATH_ERROR if exc.host_path else str(exc)), str(exc)
    if info.rank > max_lora_rank:
        message = f"Its rank {info.rank} is above the deployment's max_lora_rank {max_lora_rank}."
        return message, message
    base = deployment.base_model
    if base.hidden_size:
        expected = expected_module_shapes(base)
        for module, shapes in info.module_shapes.items():
            if module in expected and any(s != expected[module] and s[1] for s in shapes):
                message = (f"Its {module} shapes do not match the base model {base.name}: it "
                           "was trained for another model.")
                return message, message
    adapter.path = str(folder)  # the engine is given the folder that was checked (in memory)
    return None


def usable_adapters(instance: Instance, log_path: Path, engine: EngineSpec
                    ) -> tuple[list[LoraAdapter], dict[str, str]]:
    """The deployment's adapters that validate for an engine with the settings `engine` (the
    instance's), and an error for each one left out (also set on the adapter's `last_error`,
    and written to the engine log with its detail)."""
    deployment = instance.deployment
    max_lora_rank = engine.max_lora_rank
    good: list[LoraAdapter] = []
    errors: dict[str, str] = {}
    for adapter in deployment.adapters.with_tenant("base_model"):
        problem = adapter_problem(adapter, deployment, max_lora_rank,
                                  instance.node.name if instance.node else None, instance)
        if problem is None:
            good.append(adapter)
            continue
        shown, detail = problem
        message = f"Left out of {instance} at its start: {shown}"
        errors[adapter.engine_name] = message
        LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
        write_log(log_path, f"adapter {adapter.engine_name} left out: {detail}")
    return good, errors


# -- runtime loads and unloads -------------------------------------------------------------------
def sync_adapters(instance_id: int, config: AgentConfig | None = None) -> dict[str, str]:
    """Load the deployment's adapters that the engine lacks and unload those it should not have.

    A load that fails leaves the engine serving; the error goes on the adapter and the instance.
    """
    config = config or current_config()
    # Two syncs of one instance (the reconciler's and a periodic one, on this agent's threads)
    # would each read, change and write the instance's adapter lists: one at a time, each
    # reading what the previous one wrote.
    with _sync_lock(instance_id):
        return _sync_adapters(instance_id, config)


_sync_locks: dict[int, threading.Lock] = {}
_sync_locks_guard = threading.Lock()


def _sync_lock(instance_id: int) -> threading.Lock:
    with _sync_locks_guard:
        return _sync_locks.setdefault(instance_id, threading.Lock())


def _sync_adapters(instance_id: int, config: AgentConfig | None) -> dict[str, str]:
    instance = (Instance.objects.select_related("deployment__base_model", "node", "revision")
                .filter(pk=instance_id).first())
    if instance is None or config is None or instance.state != State.READY:
        return {}
    if instance.node is None or instance.node.name != config.name:
        return {}
    wanted = {a.engine_name: a for a in
              instance.deployment.adapters.with_tenant("base_model")}
    loaded = set(instance.loaded_adapters)
    errors = dict(instance.adapter_errors)
    entries = dict(instance.canary or {})
    routable_before = instance.routable_adapters
    capacity = adapter_capacity(instance.command, instance.gpus.all())
    max_lora_rank = instance.engine_spec().max_lora_rank
    client = EngineClient(instance.base_url, instance.secret)
    outcome: dict[str, str] = {}
    # Unloads first: they free slots for the loads.
    for name in sorted(loaded - set(wanted)):
        reply = client.unload_adapter(name)
        if reply.ok or reply.status == 404:
            loaded.discard(name)
            entries.pop(name, None)
            outcome[name] = "unloaded"
    for name, adapter in wanted.items():
        if name in loaded or (name in errors and not errors[name].startswith(NO_FREE_SLOT)):
            continue  # a load that failed is not retried on this engine; a refusal is
        if capacity is not None and len(loaded) >= capacity:
            message = (f"{NO_FREE_SLOT} on {instance}: a CPU engine keeps its last LoRA slot "
                       f"spare (a full last slot would apply this adapter to other tenants' "
                       f"base-model requests), so it holds at most {capacity} adapter(s); "
                       f"restart the deployment to start with a slot for every adapter.")
            errors[name] = message
            outcome[name] = "refused"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
            continue
        problem = adapter_problem(adapter, instance.deployment, max_lora_rank,
                                  instance.node.name)
        if problem is not None:
            message = f"Not loaded into {instance}: {problem[0]}"
            errors[name] = message
            outcome[name] = "failed"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
            log.warning("adapter %s not loaded into %s: %s", name, instance, problem[1])
            continue
        reply = client.load_adapter(name, adapter.path)
        if reply.ok:
            loaded.add(name)
            errors.pop(name, None)
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error="")
            # Loaded is not routable: its canary generation says whether it serves.
            entries = probe_adapters(instance, client, [name], entries)
            outcome[name] = "loaded" if canaries.passed(entries, name) else "canary failed"
        else:
            message = f"Loading into {instance} failed (HTTP {reply.status}): {reply.text[:500]}"
            errors[name] = message
            outcome[name] = "failed"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
    for name in list(errors):
        if name not in wanted:
            errors.pop(name)
    for name in list(entries):
        if name not in loaded and name != instance.deployment.base_model.name:
            entries.pop(name)
    if Instance.objects.filter(pk=instance.pk, state=State.READY).update(
        loaded_adapters=sorted(loaded), adapter_errors=errors, canary=entries
    ):
        instance.loaded_adapters, instance.canary = sorted(loaded), entries
        if instance.routable_adapters != routable_before:
            signals.instance_routing_changed.send(sender=Instance, instance=instance)
    return outcome


# -- canaries -----------------------------------------------------------------------------------
def probe_adapters(instance: Instance, client: EngineClient, names: Iterable[str],
                   entries: dict[str, Any]) -> dict[str, Any]:
    """Send each adapter in `names` its canary generation on `instance`'s engine; returns
    `entries` with the results. An adapter whose canary fails is out of routing on this instance
    until one passes (`Instance.routable_adapters`); its tenant reads why on the adapter."""
    adapters: dict[str, LoraAdapter] | None = None
    for name in names:
        result = canary.probe(client, name)
        was = entries.get(name) or {}
        entries = canaries.record(entries, name, result.ok, result.error)
        if result.ok == bool(was.get("ok")) and (was or result.ok):
            continue  # no change to tell (a failure tried again, or a pass confirmed)
        if adapters is None:
            adapters = {a.engine_name: a for a in
                        instance.deployment.adapters.with_tenant()}
        adapter = adapters.get(name)
        if result.ok:
            if was:  # it had failed: it enters routing now
                events.record(events.Kind.CANARY_PASSED,
                              f"Canary passed for adapter {name} on instance "
                              f"#{instance.ordinal}: it is routed there now.", instance=instance)
                if adapter is not None:
                    LoraAdapter.objects.filter(pk=adapter.pk,
                                               last_error__startswith=CANARY_FAILED).update(
                        last_error="")
            continue
        message = (f"{CANARY_FAILED} on {instance}: {result.error}; it is not routed there "
                   "until a canary passes (tried again with backoff).")
        log.warning("%s: canary failed for adapter %s: %s", instance, name, result.error)
        events.record(events.Kind.CANARY_FAILED,
                      f"Canary failed for adapter {name} on instance #{instance.ordinal}: "
                      f"{result.error}", instance=instance, level=events.Level.WARNING,
                      data={"adapter": name, "error": result.error})
        if adapter is not None:
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
    return entries


def retry_canaries(instance: Instance) -> list[str]:
    """Try again the canaries of a ready instance's adapters that are due (failed, their backoff
    over, or never sent); returns the names tried. Skipped while a sync of the instance runs
    (it sends its own canaries); the gateway hears at once when an adapter enters routing."""
    if not canaries.due(instance.canary or {}, instance.loaded_adapters or []):
        return []
    lock = _sync_lock(instance.pk)
    if not lock.acquire(blocking=False):
        return []
    try:
        fresh = (Instance.objects.select_related("deployment__base_model", "node")
                 .filter(pk=instance.pk, state=State.READY).first())
        if fresh is None:
            return []
        entries = fresh.canary or {}
        names = canaries.due(entries, fresh.loaded_adapters or [])
        client = EngineClient(fresh.base_url, fresh.secret)
        before = fresh.routable_adapters
        entries = probe_adapters(fresh, client, names, entries)
        Instance.objects.filter(pk=fresh.pk, state=State.READY).update(canary=entries)
        fresh.canary = entries
        if fresh.routable_adapters != before:
            signals.instance_routing_changed.send(sender=Instance, instance=fresh)
        return names
    finally:
        lock.release()
