"""The guarded stage's classifier call: ask the policy's guard deployment for a verdict on the
request's text (after redaction), waiting at most the policy's timeout.

A blocking verdict answers the 400 naming the category; no verdict (timeout, no ready instance,
an answer that is not a verdict) blocks only when the policy fails closed. The guard call is its
own usage event (`endpoint: guard`, its tokens and time) of the tenant whose request it judged;
the verdict is counted on the request's event (`input:block|pass|failopen:CLASSIFIER`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from gateway_app.cache import GatewayCache
from gateway_app.catalog import GuardTarget
from gateway_app.context import Context
from gateway_app.dispatch import Dispatcher
from gateway_app.guard import refusal
from gateway_app.proxy import Upstream, read_usage
from gateway_app.routing import Router
from gateway_app.validation import ParsedRequest, encode_body
from guardrails_app import classifier
from guardrails_app.policy import Classifier

log = logging.getLogger(__name__)


class Screen:
    def __init__(self, cache: GatewayCache, upstream: Upstream, router: Router,
                 dispatcher: Dispatcher) -> None:
        self.cache = cache
        self.upstream = upstream
        self.router = router
        self.dispatcher = dispatcher

    async def classify(self, ctx: Context, parsed: ParsedRequest, setting: Classifier) -> None:
        assert ctx.guard is not None
        target = self.cache.snapshot.guard_models.get(setting.deployment)
        instances = self.cache.snapshot.instances.get(setting.deployment, ())
        verdict: str | None = None
        if target is not None and instances:
            call = Context(ctx.request_id + "-guard", time.time(), time.perf_counter(),
                           endpoint="guard", tenant=ctx.tenant, key=ctx.key,
                           model=target.public_name, deployment_id=target.deployment_id)
            inst = min(instances, key=lambda i: self.router.in_flight.get(i.id, 0))
            call.instance_id = inst.id
            text = ctx.guard.judged_text(ctx.endpoint, parsed.body)
            request = target.spec.request(target.upstream_model, text)
            if ctx.tenant is not None:  # prefix-cache isolation on the guard engine too
                request["cache_salt"] = ctx.tenant.cache_salt
            body = encode_body(request)
            self.router.acquire(inst.id)
            try:
                verdict = await asyncio.wait_for(
                    self._ask(call, inst.url, inst.secret, body, target),
                    setting.timeout_ms / 1000.0)
            except TimeoutError:
                call.status, call.error_code = 504, "guard_timeout"
            except Exception as exc:  # noqa: BLE001 - unreachable or broken: no verdict
                log.warning("guard model instance %s failed: %r", inst.id, exc)
                call.status, call.error_code = 502, "guard_unreachable"
            finally:
                self.router.release(inst.id)
            await self.dispatcher.record(call)
        decision = classifier.decide(target.spec if target is not None else None, verdict,
                                     fail_open=setting.fail_open)
        outcome = ("block" if decision.blocked is not None
                   else "failopen" if decision.failed_open else "pass")
        ctx.guard.counts[f"input:{outcome}:{classifier.CATEGORY}"] += 1
        if decision.blocked is not None:
            raise refusal(decision.blocked)

    async def _ask(self, call: Context, url: str, secret: str, body: bytes,
                   target: GuardTarget) -> str | None:
        resp = await self.upstream.post(url + "/v1/chat/completions", secret, body,
                                        call.request_id)
        try:
            raw = await resp.read()
        finally:
            resp.close()
        call.status = resp.status
        usage = read_usage(raw) if resp.status == 200 else None
        if usage:
            call.take_usage(usage)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        verdict = target.spec.verdict(answer) if resp.status == 200 else None
        if verdict is None:
            call.error_code = "guard_no_verdict"
        return verdict
