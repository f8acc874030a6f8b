"""Guardrails on the `/v1/` path (docs/guardrails.md): a request's input checked and redacted
before admission, its answer redacted (and the input's placeholders restored) before the client
sees it, streamed or not.

The key's effective policy is compiled when the catalog is read (`catalog.GuardEntry`), never
per request; a request without a policy never reaches this module. Per request there is one
`RequestGuard` with one `Vault`. What it did is counted per direction, action and category for
the usage event (`counts`); the matched text is never recorded, logged or answered.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from gateway_app.catalog import GuardEntry
from gateway_app.errors import GatewayError
from guardrails_app.policy import Direction, Finding, Result, Vault
from guardrails_app.streaming import OutputStream


class RequestGuard:
    """One request's guardrails: its vault and what they did."""

    def __init__(self, entry: GuardEntry) -> None:
        self.entry = entry
        self.guard = entry.guard
        self.vault = Vault(salt=entry.salt)
        self.counts: Counter[str] = Counter()

    # -- input ---------------------------------------------------------------------------------
    def check_stream(self) -> None:
        """A policy whose output cannot be decided on a stream refuses `stream: true`."""
        reason = self.guard.output.stream_refusal
        if reason is not None:
            raise GatewayError(
                400, f"This key's guardrail policy cannot be applied to a stream ({reason}); "
                "send the request without `stream`.", code="guardrail_stream_refused",
                param="stream")

    def input(self, endpoint: str, body: dict[str, Any]) -> None:
        """Check and redact the request's text in place; a `block` finding raises the 400.

        A chat message's content parts that are not text (`image_url`, `input_audio`, `file`,
        ...) cannot be read by the detectors nor the guard model: they pass unread, or, when
        the policy says `refuse_non_text`, the request is refused (400,
        `guardrail_non_text_refused`) before anything else is checked."""
        if endpoint == "chat.completions":
            self._non_text(body)
        elif self.guard.input.detectors or self.guard.policy.classifier is not None:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
                # Token ids cannot be checked: they would pass the input rules unseen.
                raise GatewayError(
                    400, "This key's guardrail policy checks prompts as text; send the "
                    "prompt as text rather than token ids.", code="guardrail_needs_text",
                    param="prompt")
        if not self.guard.input.detectors:
            return
        if endpoint == "chat.completions":
            for message in body.get("messages") or ():
                if not isinstance(message, dict):
                    continue
                content = message.get("content")
                if isinstance(content, str):
                    message["content"] = self._input(content)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            part["text"] = self._input(part["text"])
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                body["prompt"] = self._input(prompt)
            elif isinstance(prompt, list):
                body["prompt"] = [self._input(p) for p in prompt]

    def _non_text(self, body: dict[str, Any]) -> None:
        if not self.guard.policy.refuse_non_text:
            return
        for i, message in enumerate(body.get("messages") or ()):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and not isinstance(part.get("text"), str):
                    self.counts[f"{Direction.INPUT}:block:NON_TEXT"] += 1
                    kind = str(part.get("type") or "unknown")[:40]
                    raise GatewayError(
                        400, f"This key's guardrail policy accepts text content only; "
                        f"messages[{i}] has a `{kind}` part, which it cannot check.",
                        code="guardrail_non_text_refused", param=f"messages[{i}].content")

    def judged_text(self, endpoint: str, body: dict[str, Any]) -> str:
        """What the guard model judges: the request's text as the engine will see it
        (after redaction), a chat's messages' text one after another, a completion's
        prompts likewise. Non-text parts are not part of it."""
        texts: list[str] = []
        if endpoint == "chat.completions":
            for message in body.get("messages") or ():
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, str):
                    texts.append(content)
                elif isinstance(content, list):
                    texts.extend(part["text"] for part in content
                                 if isinstance(part, dict) and isinstance(part.get("text"), str))
        else:
            prompt = body.get("prompt")
            prompts = [prompt] if isinstance(prompt, str) else prompt or ()
            texts.extend(p for p in prompts if isinstance(p, str))
        return "\n\n".join(texts)

    def _input(self, text: str) -> str:
        result = self.guard.apply(text, Direction.INPUT, self.vault)
        self.count(Direction.INPUT, result.findings)
        if result.blocked is not None:
            raise blocked(result)
        return result.text

    # -- output --------------------------------------------------------------------------------
    @property
    def rewrites_output(self) -> bool:
        return bool(self.guard.output.detectors) or (
            self.guard.policy.restore and bool(self.vault.mapping))

    def output_body(self, endpoint: str, raw: bytes) -> bytes:
        """A whole answer: each choice's text and its tool calls' arguments redacted with the
        output rules, then the input's placeholders restored. A blocked choice ends with
        `finish_reason: content_filter`, without text or tool calls. A choice whose text the
        policy changed loses its `logprobs` (its tokens are the original text)."""
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list):
            return raw
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            holder, field = _text_of(endpoint, choice, "message")
            texts = [(holder, field)] if holder is not None else []
            texts += _arguments_of(choice.get("message"))
            changed = False
            for where, key in texts:
                result = self.guard.apply(where[key], Direction.OUTPUT, self.vault)
                self.count(Direction.OUTPUT, result.findings)
                if result.blocked is not None:
                    _block(choice, holder, field)
                    break
                text = (result.restore(result.text) if self.guard.policy.restore
                        else result.text)
                changed = changed or text != where[key]
                where[key] = text
            if changed:
                choice["logprobs"] = None
        return json.dumps(data, separators=(",", ":")).encode()

    def stream(self, endpoint: str) -> StreamGuard:
        return StreamGuard(self, endpoint)

    def count(self, direction: Direction, findings: Iterable[Finding]) -> None:
        for f in findings:
            self.counts[f"{direction}:{f.action}:{f.category}"] += 1


def blocked(result: Result) -> GatewayError:
    return refusal(result.error())


def refusal(body: dict[str, Any]) -> GatewayError:
    """The gateway's 400 from a guardrail's OpenAI-shaped error body."""
    error = body["error"]
    return GatewayError(400, error["message"], code=error["code"], error_type=error["type"])


def _arguments_of(message: Any) -> list[tuple[dict[str, Any], str]]:
    """Where a chat message (or delta) holds tool-call arguments: each `tool_calls[].function`
    and the legacy `function_call`, as (dict, "arguments")."""
    if not isinstance(message, dict):
        return []
    functions = [call.get("function") for call in message.get("tool_calls") or ()
                 if isinstance(call, dict)]
    functions.append(message.get("function_call"))
    return [(f, "arguments") for f in functions
            if isinstance(f, dict) and isinstance(f.get("arguments"), str)]


def _block(choice: dict[str, Any], holder: dict[str, Any] | None, field: str) -> None:
    """A choice blocked on output: no text, no tool call, no logprobs; `content_filter`."""
    choice["finish_reason"] = "content_filter"
    choice["logprobs"] = None
    if holder is not None:
        holder[field] = ""
    for key in ("message", "delta"):
        inner = choice.get(key)
        if isinstance(inner, dict):
            inner.pop("tool_calls", None)
            inner.pop("function_call", None)


def _text_of(endpoint: str, choice: dict[str, Any], key: str
             ) -> tuple[dict[str, Any] | None, str]:
    """The dict holding a choice's text and its field: `message`/`delta`.content for chat,
    `text` for completions."""
    if endpoint == "chat.completions":
        inner = choice.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("content"), str):
            return inner, "content"
        return None, "content"
    if isinstance(choice.get("text"), str):
        return choice, "text"
    return None, "text"


class StreamGuard:
    """Rewrites a stream's whole SSE events (`proxy.StreamRelay`'s `rewrite`): each choice's
    text, and each of its tool calls' arguments, goes through its own `OutputStream`; what one
    holds back is sent with the choice's `finish_reason` event, or in an event of its own
    before `[DONE]`. An event's `logprobs` go on only when its text went out exactly as it came
    (else they would show text the policy held back or redacted)."""

    def __init__(self, request: RequestGuard, endpoint: str) -> None:
        self.request = request
        self.endpoint = endpoint
        # (choice index, tool call index or None for the text) -> its stream
        self.streams: dict[tuple[int, int | None], OutputStream] = {}
        self.stopped: set[int] = set()  # choices blocked or finished
        self._template: dict[str, Any] | None = None

    def __call__(self, complete: bytes) -> bytes:
        out: list[bytes] = []
        for event in complete.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b"data: [DONE]"):
                out.append(self._flush_all())
                out.append(event + b"\n\n")
            elif event.startswith(b"data: {"):
                out.append(self._event(event))
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _stream(self, key: tuple[int, int | None]) -> OutputStream:
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = OutputStream(self.request.guard, self.request.vault)
        return stream

    def _pass(self, key: tuple[int, int | None], text: str, finishing: bool
              ) -> tuple[str, str | None]:
        """Feed one piece of a choice's text (or a tool call's arguments); with `finishing`
        flush it too. (what goes out now, the blocking category or None)."""
        stream = self._stream(key)
        piece = stream.feed(text)
        findings, released = list(piece.findings), piece.text
        if piece.blocked is None and finishing:
            last = stream.flush()
            findings += last.findings
            released += last.text
            piece = last
        self.request.count(Direction.OUTPUT, findings)
        return released, piece.blocked

    def _event(self, event: bytes) -> bytes:
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            return event + b"\n\n"
        if self._template is None:
            self._template = {k: v for k, v in data.items() if k not in ("choices", "usage")}
        kept = [choice for choice in choices if self._choice(choice)]
        data["choices"] = kept
        if not kept and "usage" not in data:
            return b""
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Rewrite one choice of an event in place; False: leave it out (stopped before)."""
        index = int(choice.get("index") or 0)
        if index in self.stopped:
            return False
        finishing = choice.get("finish_reason") is not None
        holder, field = _text_of(self.endpoint, choice, "delta")
        text = holder[field] if holder is not None else ""
        released, blocked_by = self._pass((index, None), text, finishing)
        unchanged = released == text
        if blocked_by is None:
            if holder is not None:
                holder[field] = released
            elif released:
                self._set_text(choice, released)
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            seen = set()
            for call in calls if isinstance(calls, list) else ():
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(
                        function.get("arguments"), str):
                    continue
                call_index = int(call.get("index") or 0)
                seen.add(call_index)
                arguments = function["arguments"]
                function["arguments"], blocked_by = self._pass((index, call_index), arguments,
                                                               finishing)
                unchanged = unchanged and function["arguments"] == arguments
                if blocked_by is not None:
                    break
            if blocked_by is None and finishing:
                self._flush_calls(index, seen, choice)
        if finishing or blocked_by is not None:
            self.stopped.add(index)
        if blocked_by is not None:
            _block(choice, holder, field)
        elif not unchanged and choice.get("logprobs") is not None:
            choice["logprobs"] = None
        return True

    def _flush_calls(self, index: int, seen: set[int], choice: dict[str, Any]) -> None:
        """At a choice's end: what its other tool calls' streams still hold, into its delta."""
        for (owner, call_index), stream in sorted(self.streams.items(), key=_order):
            if owner != index or call_index is None or call_index in seen:
                continue
            piece = stream.flush()
            self.request.count(Direction.OUTPUT, piece.findings)
            if piece.blocked is not None:
                _block(choice, None, "content")
                return
            if piece.text:
                delta = choice.setdefault("delta", {})
                delta.setdefault("tool_calls", []).append(
                    {"index": call_index, "function": {"arguments": piece.text}})

    def _set_text(self, choice: dict[str, Any], text: str) -> None:
        if self.endpoint == "chat.completions":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = choice["delta"] = {}
            delta["content"] = text
        else:
            choice["text"] = text

    def _flush_all(self) -> bytes:
        """What choices without a `finish_reason` event still hold, before `[DONE]`."""
        out = []
        for (index, call_index), stream in sorted(self.streams.items(), key=_order):
            if index in self.stopped:
                continue
            piece = stream.flush()
            self.request.count(Direction.OUTPUT, piece.findings)
            if not piece.text and piece.blocked is None:
                continue
            choice: dict[str, Any] = {"index": index}
            if piece.blocked is not None:
                self.stopped.add(index)
                choice["finish_reason"] = "content_filter"
            elif call_index is None:
                self._set_text(choice, piece.text)
            else:
                choice["delta"] = {"tool_calls": [{"index": call_index,
                                                   "function": {"arguments": piece.text}}]}
            data = {**(self._template or {}), "choices": [choice]}
            out.append(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
        self.stopped.update(index for index, _ in self.streams)
        return b"".join(out)


def _order(item: tuple[tuple[int, int | None], Any]) -> tuple[int, int]:
    """Streams in order: by choice, its text first, then its tool calls."""
    (index, call_index), _ = item
    return index, -1 if call_index is None else call_index
