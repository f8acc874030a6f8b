"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import Any

# HTTP status -> OpenAI error type.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class GatewayError(Exception):
    """A refusal the gateway answers itself; `headers` are added to the response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.code, self.param)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled whole (a guard process's refusal comes back to its worker this way).
        return _rebuilt, (self.status, self.message, self.code, self.param, self.error_type,
                          self.headers)


def _rebuilt(status: int, message: str, code: str | None, param: str | None,
             error_type: str, headers: dict[str, str]) -> GatewayError:
    return GatewayError(status, message, code=code, param=param, error_type=error_type,
                        headers=headers)


def error_body(message: str, error_type: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    ).encode()


def message_of(body: bytes) -> str:
    """The message of an error body in OpenAI's shape (`error_body`'s), or "" if it has none."""
    try:
        inner = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(inner.get("message") or "") if isinstance(inner, dict) else ""


def invalid(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def model_not_found(name: str) -> GatewayError:
    """Unknown model, another tenant's adapter and a model the key may not use answer alike."""
    return GatewayError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def normalize_upstream_error(status: int, raw: bytes) -> bytes:
    """An engine's error body in OpenAI's shape, whatever vLLM version produced it."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return error_body(
                str(inner.get("message")),
                str(inner.get("type") or _TYPES.get(status, "server_error")),
                None if inner.get("code") is None else str(inner.get("code")),
                inner.get("param"),
            )
        if "message" in data:  # older vLLM: {"object": "error", "message", "type", "code"}
            return error_body(
                str(data["message"]),
                str(data.get("type") or _TYPES.get(status, "server_error")),
                None if data.get("code") is None else str(data.get("code")),
                data.get("param"),
            )
    text = raw.decode(errors="replace")[:500] or f"The engine answered {status}."
    return error_body(text, _TYPES.get(status, "server_error"), None)
