"""The gateway's ASGI app: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

A raw ASGI app (no framework in the request path): this module is the shell. It answers the
lifespan messages, gives each request its context, sends the pipeline's errors in OpenAI's
shape and has every request metered, whatever stage it stopped at; the stages themselves are
the pipeline's (`pipeline.py`). One instance per worker process; the pipeline's caches, Redis
client and upstream session start on the ASGI lifespan startup or, where the server sends none,
on the first request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from gateway_app.config import GatewayConfig
from gateway_app.context import ClientDisconnected, Context, Receive, Scope, Send, send_json
from gateway_app.errors import GatewayError
from gateway_app.pipeline import Pipeline

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}


class GatewayApp:
    def __init__(self) -> None:
        self.pipeline: Pipeline | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> Pipeline:
        if self.pipeline is None:
            self.pipeline = Pipeline(GatewayConfig.from_settings())
            await self.pipeline.start()
        return self.pipeline

    async def shutdown(self) -> None:
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            await pipeline.stop()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline or await self.startup()
        ctx = Context("req-" + os.urandom(12).hex(), time.time(), time.perf_counter())
        method = scope["method"]
        path = scope["path"]
        try:
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None:
                ctx.endpoint = endpoint
                if method != "POST":
                    raise GatewayError(405, f"Method {method} not allowed on {path}; use POST.")
                await pipeline.completion(scope, receive, send, ctx)
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                ctx.endpoint = "models"
                if method != "GET":
                    raise GatewayError(405, f"Method {method} not allowed on {path}; use GET.")
                await pipeline.models(scope, send, ctx, path[len("/v1/models/") :])
            else:
                raise GatewayError(404, f"Invalid URL ({method} {path})")
        except GatewayError as err:
            ctx.status = err.status
            ctx.error_code = err.code or err.error_type
            ctx.error_message = err.message
            await _send_error(send, ctx, err)
        except ClientDisconnected:
            ctx.status = 499
            ctx.error_code = "client_disconnected"
            ctx.error_message = "The client closed the connection before the answer ended."
        except Exception:
            log.exception("gateway request %s failed", ctx.request_id)
            ctx.status = 500
            ctx.error_code = "internal_error"
            ctx.error_message = "The gateway failed to handle the request."
            with contextlib.suppress(Exception):
                await _send_error(
                    send, ctx, GatewayError(500, "The gateway failed to handle the request.")
                )
        finally:
            await pipeline.metered(ctx)


async def _send_error(send: Send, ctx: Context, err: GatewayError) -> None:
    await send_json(send, err.status, err.body(), ctx.request_id,
                    {**ctx.rate_headers, **err.headers})


application = GatewayApp()
