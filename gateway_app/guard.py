"""Guardrails on the `/v1/` path (docs/guardrails.md): a request's input checked and redacted
before admission, its answer redacted (and the input's placeholders restored) before the client
sees it, streamed or not.

The key's effective policy is compiled when the catalog is read (`catalog.GuardEntry`), never
per request; a request without a policy never reaches this module. Per request there is one
`RequestGuard` with one `Vault`. What it did is counted per direction, action and category for
the usage event (`counts`), and per field of the request or answer (`fields`: which detector
fired where, its category and action); the matched text is never recorded, logged or answered.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway_app.catalog import GuardEntry
from gateway_app.errors import GatewayError
from gateway_app.extraction import Extraction, TextField, extract
from guardrails_app.policy import (
    Action,
    Direction,
    Finding,
    Result,
    Vault,
    blocked_error,
)
from guardrails_app.streaming import OutputStream
from guardrails_app.texts import apply_texts
from serving_app.models.usage import GUARDRAIL_FIELDS_KEPT

# Request fields that make the engine answer with token ids (the text's, or each
# logprob token's), which decode to the answer before the guardrails rewrote it.
TOKEN_ID_FIELDS = ("return_token_ids", "return_tokens_as_token_ids")

# The refusals before any detector, counted as categories of their own.
_REFUSAL_CATEGORIES = {"guardrail_non_text_refused": "NON_TEXT",
                       "guardrail_field_refused": "FIELD"}


class FieldFindings(Counter[tuple[str, str, str, str, str]]):
    """How many findings each field had: (direction, field path, detector, category, action)
    -> count. A field is named as an error's `param` names it (`messages[2].tool_calls[0].
    function.arguments.to`; `choices[0].message.content` on output); never its value."""

    def add(self, direction: Direction, path: str, finding: Finding) -> None:
        self[(str(direction), path, finding.detector, finding.category, str(finding.action))] += 1

    def records(self) -> list[dict[str, Any]]:
        """The usage event's form: one dict per entry, in the order they were first found."""
        return [{"direction": d, "field": f, "detector": det, "category": c, "action": a,
                 "count": n}
                for (d, f, det, c, a), n in list(self.items())[:GUARDRAIL_FIELDS_KEPT]]


@dataclass(slots=True)
class InputCheck:
    """What the input rules decided about a request (`RequestGuard.read_input`)."""

    vault: Vault  # the redactions' (a vault of its own: the thread may be late)
    fields: list[TextField] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the fields' texts after redaction
    counts: Counter[str] = field(default_factory=Counter)
    fields_found: FieldFindings = field(default_factory=FieldFindings)
    error: GatewayError | None = None


class RequestGuard:
    """One request's guardrails: its vault and what they did."""

    def __init__(self, entry: GuardEntry) -> None:
        self.entry = entry
        self.guard = entry.guard
        self.vault = Vault(salt=entry.salt)
        self.counts: Counter[str] = Counter()
        self.judged: str | None = None  # the text the guard model judges
        self.fields = FieldFindings()  # per field, input and output; never the value

    # -- input ---------------------------------------------------------------------------------
    def check_stream(self) -> None:
        """A policy whose output cannot be decided on a stream refuses `stream: true`."""
        reason = self.guard.output.stream_refusal
        if reason is not None:
            raise GatewayError(
                400, f"This key's guardrail policy cannot be applied to a stream ({reason}); "
                "send the request without `stream`.", code="guardrail_stream_refused",
                param="stream")

    def check_output_fields(self, body: dict[str, Any]) -> None:
        """A policy that may rewrite the answer (output rules, or input placeholders restored)
        refuses the fields that would return it as token ids: they decode to the text before
        the rewrite."""
        restores = self.guard.policy.restore and any(
            rule.action is Action.REDACT for rule in self.guard.input.rules)
        if not (self.guard.output.detectors or restores):
            return
        for name in TOKEN_ID_FIELDS:
            if body.get(name):
                raise GatewayError(
                    400, f"This key's guardrail policy rewrites answers; `{name}` would "
                    "return them as token ids, which it cannot rewrite. Send the request "
                    f"without `{name}`.", code="guardrail_token_ids_refused", param=name)

    def input(self, endpoint: str, body: dict[str, Any]) -> None:
        """Check and redact the request's text in place; a `block` finding raises the 400
        (`read_input`, then `take_input`)."""
        self.take_input(self.read_input(endpoint, body))

    def read_input(self, endpoint: str, body: dict[str, Any]) -> InputCheck:
        """What the input rules decide about the request's texts (`extraction.extract`),
        without changing the body or this guard: safe to run in a worker thread.

        A chat message's content parts that are not text by their `type` (`image_url`,
        `input_audio`, `file`, ...) cannot be read by the detectors nor the guard model: they
        pass unread, or, when the policy says `refuse_non_text`, the request is refused (400,
        `guardrail_non_text_refused`). Texts are read normalised (`guardrails_app.normalise`),
        each on its own and across the boundaries between them (`guardrails_app.texts`)."""
        check = InputCheck(Vault(salt=self.entry.salt))
        reads = bool(self.guard.input.detectors) or self.guard.policy.classifier is not None
        if not reads and not (endpoint == "chat.completions"
                              and self.guard.policy.refuse_non_text):
            return check
        try:
            found = extract(endpoint, body)
            self._non_text(found)
        except GatewayError as exc:
            check.error = exc
            if exc.code in _REFUSAL_CATEGORIES:
                category = _REFUSAL_CATEGORIES[exc.code]
                check.counts[f"{Direction.INPUT}:block:{category}"] += 1
                check.fields_found[(str(Direction.INPUT), exc.param or "", "", category,
                                    str(Action.BLOCK))] += 1
            return check
        check.fields, check.texts = found.fields, found.texts()
        if not self.guard.input.detectors:
            return check
        result = apply_texts(self.guard.input, check.texts, check.vault)
        for found_in in result.findings:
            f = found_in.finding
            check.counts[f"{Direction.INPUT}:{f.action}:{f.category}"] += 1
            check.fields_found.add(Direction.INPUT, check.fields[found_in.text].path, f)
        if result.blocked is not None:
            check.error = refusal(blocked_error(result.blocked))
        else:
            check.texts = result.texts
        return check

    def take_input(self, check: InputCheck, endpoint: str = "",
                   body: dict[str, Any] | None = None) -> None:
        """Apply what `read_input` decided: count it, raise its refusal or write its
        redactions into the body. A check from a guard process comes without its fields:
        they are found again in `body` (the same extraction, in the same order)."""
        self.counts.update(check.counts)
        self.fields.update(check.fields_found)
        self.vault = check.vault
        if check.error is not None:
            raise check.error
        if check.texts and not check.fields and body is not None:
            check.fields = extract(endpoint, body).fields
        # Last first: a dict key is renamed after its value is written.
        for where, text in reversed(list(zip(check.fields, check.texts, strict=True))):
            if text != where.text:
                where.set(text)
        self.judged = "\n\n".join(check.texts)

    def _non_text(self, found: Extraction) -> None:
        if not self.guard.policy.refuse_non_text or not found.non_text:
            return
        path, kind = found.non_text[0]
        raise GatewayError(
            400, f"This key's guardrail policy accepts text content only; {path} is a "
            f"`{kind}` part, which it cannot check.",
            code="guardrail_non_text_refused", param=path.rsplit("[", 1)[0])

    def judged_text(self, endpoint: str, body: dict[str, Any]) -> str:
        """What the guard model judges: the texts the input rules read, as the engine will
        see them (after redaction), one after another. Non-text parts are not part of it."""
        if self.judged is None:
            self.judged = "\n\n".join(extract(endpoint, body).texts())
        return self.judged

    # -- output --------------------------------------------------------------------------------
    @property
    def rewrites_output(self) -> bool:
        return bool(self.guard.output.detectors) or (
            self.guard.policy.restore and bool(self.vault.mapping))

    def output_body(self, endpoint: str, raw: bytes) -> bytes:
        """A whole answer: each choice's text and its tool calls' arguments redacted with the
        output rules (read normalised, as input is), then the input's placeholders restored.
        A blocked choice ends with `finish_reason: content_filter`, without text or tool
        calls. A choice whose text the policy changed loses its `logprobs` (its tokens are the
        original text). An answer nothing changed goes out as the engine wrote it."""
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list):
            return raw
        rewritten = False
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            holder, field = _text_of(endpoint, choice, "message")
            at = f"choices[{choice.get('index', i)}]"
            texts = [(holder, field, f"{at}.{_text_path(endpoint, 'message')}")
                     ] if holder is not None else []
            texts += [(where, key, f"{at}.message.{path}")
                      for where, key, path in _arguments_of(choice.get("message"))]
            changed = False
            for where, key, path in texts:
                result = apply_texts(self.guard.output, [where[key]], self.vault)
                self.count(Direction.OUTPUT, (f.finding for f in result.findings), path)
                if result.blocked is not None:
                    _block(choice, holder, field)
                    rewritten = True
                    break
                text = (self.vault.restore(result.texts[0]) if self.guard.policy.restore
                        else result.texts[0])
                changed = changed or text != where[key]
                where[key] = text
            if changed:
                choice["logprobs"] = None
                rewritten = True
        if not rewritten:
            return raw
        return json.dumps(data, separators=(",", ":")).encode()

    def stream(self, endpoint: str) -> StreamGuard:
        return StreamGuard(self, endpoint)

    def count(self, direction: Direction, findings: Iterable[Finding], path: str) -> None:
        """Count findings in the field at `path`."""
        for f in findings:
            self.counts[f"{direction}:{f.action}:{f.category}"] += 1
            self.fields.add(direction, path, f)


def blocked(result: Result) -> GatewayError:
    return refusal(result.error())


def refusal(body: dict[str, Any]) -> GatewayError:
    """The gateway's 400 from a guardrail's OpenAI-shaped error body."""
    error = body["error"]
    return GatewayError(400, error["message"], code=error["code"], error_type=error["type"])


def _arguments_of(message: Any) -> list[tuple[dict[str, Any], str, str]]:
    """Where a chat message (or delta) holds tool-call arguments: each `tool_calls[].function`
    and the legacy `function_call`, as (dict, "arguments", its path in the message)."""
    if not isinstance(message, dict):
        return []
    functions = [(call.get("function"), f"tool_calls[{k}].function.arguments")
                 for k, call in enumerate(message.get("tool_calls") or ())
                 if isinstance(call, dict)]
    functions.append((message.get("function_call"), "function_call.arguments"))
    return [(f, "arguments", path) for f, path in functions
            if isinstance(f, dict) and isinstance(f.get("arguments"), str)]


def _text_path(endpoint: str, key: str) -> str:
    """A choice's text field, as a path inside the choice (`message.content`, `text`)."""
    return f"{key}.content" if endpoint == "chat.completions" else "text"


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

    def _path(self, key: tuple[int, int | None]) -> str:
        index, call_index = key
        if call_index is None:
            return f"choices[{index}].{_text_path(self.endpoint, 'delta')}"
        return f"choices[{index}].delta.tool_calls[{call_index}].function.arguments"

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
        self.request.count(Direction.OUTPUT, findings, self._path(key))
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
            self.request.count(Direction.OUTPUT, piece.findings, self._path((owner, call_index)))
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
            self.request.count(Direction.OUTPUT, piece.findings, self._path((index, call_index)))
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
