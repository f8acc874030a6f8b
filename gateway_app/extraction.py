"""Every text a request carries into the engine's prompt, with its place in the body: what the
guardrails read, redact in place and send to the guard model (docs/guardrails.md, "What is
read").

Each field the gateway accepts (`validation.CHAT_FIELDS`, `COMPLETION_FIELDS`) has a rule here:
`TEXT` (every string in it is read, dict keys included, and redacted where it is), `NO_TEXT`
(numbers and flags, or strings the engine never renders into the prompt: stop sequences, the
`user` id, metadata). A field without a rule is refused under a guarding policy, as is a
message key that vLLM's chat parser does not know (it could reach a template); the module's
tests check that every accepted field has one.

Chat content parts are text or not by their `type` alone, as vLLM's parser decides
(`TEXT_PARTS`): a text part's every string is read (vLLM passes a text part's extra keys to the
template); any other part (`image_url`, `input_audio`, `file`, ...) is non-text whatever it
holds, listed in `Extraction.non_text` for `refuse_non_text`, and not read. A tool call's
`arguments` are read as the JSON the engine decodes them into (escapes such as `\\u0031` read
as the characters they stand for), and written back as JSON.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway_app.errors import GatewayError


class Rule(enum.StrEnum):
    TEXT = "text"
    NO_TEXT = "no_text"


_COMMON: dict[str, Rule] = {
    "model": Rule.NO_TEXT, "frequency_penalty": Rule.NO_TEXT, "presence_penalty": Rule.NO_TEXT,
    "logit_bias": Rule.NO_TEXT, "max_tokens": Rule.NO_TEXT, "n": Rule.NO_TEXT,
    "seed": Rule.NO_TEXT, "stop": Rule.NO_TEXT, "stream": Rule.NO_TEXT,
    "stream_options": Rule.NO_TEXT, "temperature": Rule.NO_TEXT, "top_p": Rule.NO_TEXT,
    "user": Rule.NO_TEXT, "metadata": Rule.NO_TEXT, "store": Rule.NO_TEXT,
    "service_tier": Rule.NO_TEXT, "use_beam_search": Rule.NO_TEXT, "top_k": Rule.NO_TEXT,
    "min_p": Rule.NO_TEXT, "repetition_penalty": Rule.NO_TEXT, "length_penalty": Rule.NO_TEXT,
    "stop_token_ids": Rule.NO_TEXT, "include_stop_str_in_output": Rule.NO_TEXT,
    "ignore_eos": Rule.NO_TEXT, "min_tokens": Rule.NO_TEXT, "skip_special_tokens": Rule.NO_TEXT,
    "spaces_between_special_tokens": Rule.NO_TEXT, "truncate_prompt_tokens": Rule.NO_TEXT,
    "truncation_side": Rule.NO_TEXT, "allowed_token_ids": Rule.NO_TEXT,
    "prompt_logprobs": Rule.NO_TEXT, "bad_words": Rule.NO_TEXT,
    "add_special_tokens": Rule.NO_TEXT, "return_tokens_as_token_ids": Rule.NO_TEXT,
    "return_token_ids": Rule.NO_TEXT, "cache_salt": Rule.NO_TEXT,
    # Schemas and grammars: a template or a structured-output backend may show them to the
    # model, and their strings (descriptions, enum values) can hold anything.
    "response_format": Rule.TEXT, "structured_outputs": Rule.TEXT,
}

CHAT_RULES: dict[str, Rule] = {
    **_COMMON,
    "messages": Rule.TEXT, "tools": Rule.TEXT, "tool_choice": Rule.TEXT,
    "documents": Rule.TEXT, "chat_template_kwargs": Rule.TEXT,
    "logprobs": Rule.NO_TEXT, "top_logprobs": Rule.NO_TEXT,
    "max_completion_tokens": Rule.NO_TEXT, "parallel_tool_calls": Rule.NO_TEXT,
    "reasoning_effort": Rule.NO_TEXT, "include_reasoning": Rule.NO_TEXT,
    "thinking_token_budget": Rule.NO_TEXT, "echo": Rule.NO_TEXT,
    "add_generation_prompt": Rule.NO_TEXT, "continue_final_message": Rule.NO_TEXT,
}

COMPLETION_RULES: dict[str, Rule] = {
    **_COMMON,
    "prompt": Rule.TEXT, "suffix": Rule.TEXT, "echo": Rule.NO_TEXT, "logprobs": Rule.NO_TEXT,
}

# Part types vLLM's chat parser reads as text (`TEXT_PART_TYPES`, and `tool_reference`, whose
# `name` the template expands); every other type is non-text.
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                        "tool_reference"})
# A message's keys vLLM's parser reads (`role` is checked by validation); `content` is read part
# by part, the others whole.
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                          "function_call", "reasoning", "reasoning_content", "refusal", "task",
                          "tools"})

Setter = Callable[[str], None]


@dataclass(slots=True)
class TextField:
    """One string of the request: where it is (`path`, as an error's `param` names it), its
    text, and how to write a redacted one back."""

    path: str
    text: str
    set: Setter = field(repr=False)


@dataclass(slots=True)
class Extraction:
    fields: list[TextField] = field(default_factory=list)
    non_text: list[tuple[str, str]] = field(default_factory=list)  # (path, part type)

    def texts(self) -> list[str]:
        return [f.text for f in self.fields]


def refused(path: str, why: str) -> GatewayError:
    return GatewayError(
        400, f"This key's guardrail policy cannot check `{path}`: {why}.",
        code="guardrail_field_refused", param=path)


def extract(endpoint: str, body: dict[str, Any]) -> Extraction:
    """Every text of a (validated) request body, in order, and its non-text parts."""
    rules = CHAT_RULES if endpoint == "chat.completions" else COMPLETION_RULES
    out = Extraction()
    try:
        for name, value in body.items():
            rule = rules.get(name)
            if rule is None:
                raise refused(name, "the field is unknown to the guardrails")
            if rule is Rule.NO_TEXT or value is None:
                continue
            if name == "messages":
                _messages(out, value)
            elif name == "prompt":
                _prompt(out, body)
            else:
                _walk(out, value, name, _item_setter(body, name))
    except RecursionError:
        raise refused("body", "it is nested too deeply") from None
    return out


def _messages(out: Extraction, messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict):
            continue
        for key, value in message.items():
            path = f"messages[{i}].{key}"
            if key not in MESSAGE_KEYS:
                if value is None:
                    continue
                raise refused(path, "vLLM may pass an unknown message key to the template")
            if key == "role" or value is None:
                continue
            if key == "content" and isinstance(value, list):
                _parts(out, value, path)
            else:
                _walk(out, value, path, _item_setter(message, key))


def _parts(out: Extraction, parts: list[Any], path: str) -> None:
    for j, part in enumerate(parts):
        where = f"{path}[{j}]"
        if isinstance(part, str):
            _walk(out, part, where, _item_setter(parts, j))
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            out.non_text.append((where, str(kind)[:40]))
            continue
        for key, value in part.items():
            if key != "type":
                _walk(out, value, f"{where}.{key}", _item_setter(part, key))


def _prompt(out: Extraction, body: dict[str, Any]) -> None:
    prompt = body["prompt"]
    if isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        # Token ids cannot be read: they would pass the input rules unseen.
        raise GatewayError(
            400, "This key's guardrail policy checks prompts as text; send the prompt as "
            "text rather than token ids.", code="guardrail_needs_text", param="prompt")
    _walk(out, prompt, "prompt", _item_setter(body, "prompt"))


def _item_setter(holder: Any, key: Any) -> Setter:
    def set_item(text: str) -> None:
        holder[key] = text
    return set_item


def _key_setter(holder: dict[str, Any], key: str) -> Setter:
    """Renames a dict key in place, keeping the order of the keys."""
    def rename(text: str) -> None:
        items = [(text if k == key else k, v) for k, v in holder.items()]
        holder.clear()
        holder.update(items)
    return rename


def _walk(out: Extraction, value: Any, path: str, setter: Setter | None) -> None:
    """Every string in `value`: the value itself, a list's items, a dict's keys and values."""
    if isinstance(value, str):
        if setter is not None:
            out.fields.append(TextField(path, value, setter))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(out, item, f"{path}[{i}]", _item_setter(value, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                out.fields.append(TextField(f"{path}.{key}", key, _key_setter(value, key)))
            where = f"{path}.{key}"
            if key == "arguments" and isinstance(item, str):
                _arguments(out, value, item, where)
            else:
                _walk(out, item, where, _item_setter(value, key))


def _arguments(out: Extraction, holder: dict[str, Any], raw: str, path: str) -> None:
    """A tool call's arguments: read as the JSON the engine decodes, written back as JSON."""
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict | list):
        _walk(out, raw, path, _item_setter(holder, "arguments"))
        return
    inner = Extraction()
    _walk(inner, decoded, path, None)
    for found in inner.fields:
        found.set = _redump(found.set, holder, decoded)
        out.fields.append(found)


def _redump(set_inner: Setter, holder: dict[str, Any], decoded: Any) -> Setter:
    def set_and_encode(text: str) -> None:
        set_inner(text)
        holder["arguments"] = json.dumps(decoded, ensure_ascii=False)
    return set_and_encode
