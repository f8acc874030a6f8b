"""Request bodies checked before anything reaches an engine, with OpenAI's 400s.

Fields are those of OpenAI's API and the vLLM sampling extras its OpenAI server accepts; an
unknown field is refused like OpenAI does ("Unrecognized request argument supplied"), a wrongly
typed one with `invalid_type`. Fields that would let a tenant step outside its lane (`priority`,
`request_id`, a custom `chat_template`, raw `prompt_embeds`, KV-transfer parameters) are refused
too: the gateway sets what must be set. A client's `cache_salt` is accepted but never sent as is:
the gateway combines it with the tenant's secret (`TenantEntry.salt_for`).

Prompt tokens are estimated without the engine's tokenizer as a safe upper bound: every tokenizer
vLLM serves emits at most one token per UTF-8 byte of text (byte-level BPE and SentencePiece with
byte fallback alike), plus special tokens, so bytes plus a fixed overhead per message is never
below the real count. The estimate reserves tokens at admission; the engine's usage settles them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway_app.errors import GatewayError, invalid

# Upper bound of template tokens around one chat message (role markers, separators) and around
# the whole conversation (BOS, generation prompt). Generous on purpose.
TOKENS_PER_MESSAGE = 8
TOKENS_PER_CONVERSATION = 8
TOKENS_PER_PROMPT = 4


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, str) for i in v)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(i) for i in v)


Check = tuple[Callable[[Any], bool], str]
INT: Check = (_is_int, "an integer")
NUM: Check = (_is_num, "a number")
BOOL: Check = (lambda v: isinstance(v, bool), "a boolean")
STR: Check = (lambda v: isinstance(v, str), "a string")
OBJ: Check = (lambda v: isinstance(v, dict), "an object")
ARR: Check = (lambda v: isinstance(v, list), "an array")
INTS: Check = (_is_int_list, "an array of integers")
STRS: Check = (_is_str_list, "an array of strings")
STOP: Check = (lambda v: isinstance(v, str) or _is_str_list(v), "a string or array of strings")
STR_OR_OBJ: Check = (lambda v: isinstance(v, str | dict), "a string or an object")
INT_OR_BOOL: Check = (lambda v: isinstance(v, int), "an integer or a boolean")
ANY: Check = (lambda v: True, "any value")

_COMMON: dict[str, Check] = {
    "model": STR,
    "frequency_penalty": NUM,
    "presence_penalty": NUM,
    "logit_bias": OBJ,
    "max_tokens": INT,
    "n": INT,
    "seed": INT,
    "stop": STOP,
    "stream": BOOL,
    "stream_options": OBJ,
    "temperature": NUM,
    "top_p": NUM,
    "user": STR,
    "response_format": OBJ,
    "metadata": OBJ,
    "store": BOOL,
    "service_tier": STR,
    # vLLM extras
    "use_beam_search": BOOL,
    "top_k": INT,
    "min_p": NUM,
    "repetition_penalty": NUM,
    "length_penalty": NUM,
    "stop_token_ids": INTS,
    "include_stop_str_in_output": BOOL,
    "ignore_eos": BOOL,
    "min_tokens": INT,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "truncate_prompt_tokens": INT,
    "truncation_side": STR,
    "allowed_token_ids": INTS,
    "prompt_logprobs": INT,
    "bad_words": STRS,
    "add_special_tokens": BOOL,
    "structured_outputs": OBJ,
    "return_tokens_as_token_ids": BOOL,
    "return_token_ids": BOOL,
    "cache_salt": STR,
}

CHAT_FIELDS: dict[str, Check] = {
    **_COMMON,
    "messages": ARR,
    "logprobs": BOOL,
    "top_logprobs": INT,
    "max_completion_tokens": INT,
    "tools": ARR,
    "tool_choice": STR_OR_OBJ,
    "parallel_tool_calls": BOOL,
    "reasoning_effort": STR,
    "include_reasoning": BOOL,
    "thinking_token_budget": INT,
    "echo": BOOL,
    "add_generation_prompt": BOOL,
    "continue_final_message": BOOL,
    "documents": ARR,
    "chat_template_kwargs": OBJ,
}

COMPLETION_FIELDS: dict[str, Check] = {
    **_COMMON,
    "prompt": ANY,
    "echo": BOOL,
    "logprobs": INT,
    "suffix": STR,
}

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


@dataclass(slots=True)
class ParsedRequest:
    """A checked request and what admission needs to know about it."""

    endpoint: str
    upstream_path: str
    body: dict[str, Any]
    model: str
    stream: bool
    wants_usage: bool
    max_tokens: int | None
    max_tokens_param: str
    n: int
    num_prompts: int
    prompt_upper: int
    size: int = 0  # the body's bytes
    # The field that has the engine compute the prompt's logprobs (`prompt_logprobs_field`),
    # None when nothing does: not every engine can (dispatch sends it only to one that can).
    prompt_logprobs: str | None = None


def _unparsable(reason: str) -> GatewayError:
    return invalid(
        f"We could not parse the JSON body of your request ({reason}). The OpenAI API expects "
        "a JSON payload.",
        code="invalid_json",
    )


_TOO_DEEP = "it is nested too deeply"
# A \\uD800-\\uDFFF escape: half of a UTF-16 pair, or a lone one (checked then).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError as exc:  # a body nested deeper than the interpreter's stack allows
        raise _unparsable(_TOO_DEEP) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise _unparsable(str(exc)) from exc
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:  # a lone surrogate (half a UTF-16 pair) is no character: it cannot be encoded
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise _unparsable("a string holds a lone UTF-16 surrogate, which is not a "
                              "character") from None
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    """The body as sent upstream. A body parsed just below the recursion limit may not encode
    from a deeper stack: that is the client's unparsable body, not a gateway failure."""
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except RecursionError as exc:
        raise _unparsable(_TOO_DEEP) from exc


def _check_fields(body: dict[str, Any], fields: dict[str, Check]) -> None:
    for name, value in body.items():
        spec = fields.get(name)
        if spec is None:
            raise GatewayError(
                400, f"Unrecognized request argument supplied: {name}", param=name,
                code="unknown_parameter",
            )
        if value is None and name not in ("model", "messages", "prompt"):
            continue
        check, expected = spec
        if not check(value):
            raise invalid(
                f"Invalid type for '{name}': expected {expected}, but got "
                f"{_json_type(value)} instead.",
                param=name,
                code="invalid_type",
            )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if value is None:
        return 0
    return len(json.dumps(value, ensure_ascii=False).encode())


def _chat_prompt_upper(messages: list[Any]) -> int:
    if not messages:
        raise invalid("'messages' must contain at least one message.", param="messages")
    total = TOKENS_PER_CONVERSATION
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(
                f"Invalid type for 'messages[{i}]': expected an object.",
                param=f"messages[{i}]", code="invalid_type",
            )
        role = message.get("role")
        if role not in _ROLES:
            raise invalid(
                f"Invalid value for 'messages[{i}].role': expected one of "
                f"{', '.join(sorted(_ROLES))}.",
                param=f"messages[{i}].role", code="invalid_value",
            )
        content = message.get("content")
        if isinstance(content, str) or content is None:
            size = _bytes(content)
        elif isinstance(content, list):
            size = 0
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise invalid(
                        f"Invalid content part in 'messages[{i}].content'.",
                        param=f"messages[{i}].content", code="invalid_type",
                    )
                size += _bytes(part.get("text")) if part["type"] == "text" else _bytes(part)
        else:
            raise invalid(
                f"Invalid type for 'messages[{i}].content': expected a string or an array of "
                "content parts.",
                param=f"messages[{i}].content", code="invalid_type",
            )
        extra = sum(_bytes(v) for k, v in message.items() if k not in ("role", "content"))
        total += size + extra + len(role) + TOKENS_PER_MESSAGE
    return total


def _completion_prompts(prompt: Any) -> tuple[int, int]:
    """(number of prompts, upper bound of their tokens in all)."""
    if isinstance(prompt, str):
        return 1, len(prompt.encode()) + TOKENS_PER_PROMPT
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt), sum(len(p.encode()) + TOKENS_PER_PROMPT for p in prompt)
        if _is_int_list(prompt):
            return 1, len(prompt) + TOKENS_PER_PROMPT
        if all(_is_int_list(p) and p for p in prompt):
            return len(prompt), sum(len(p) + TOKENS_PER_PROMPT for p in prompt)
    raise invalid(
        "Invalid type for 'prompt': expected a string, an array of strings, an array of "
        "tokens or an array of token arrays.",
        param="prompt", code="invalid_type",
    )


def prompt_logprobs_field(chat: bool, body: dict[str, Any]) -> str | None:
    """The field through which a request has the engine compute its prompt's logprobs, as
    vLLM's OpenAI server decides (`to_sampling_params` of its chat and completion requests):
    `prompt_logprobs` set; or `echo` with the completions API's `logprobs` set; or `echo` on a
    chat, whose `top_logprobs` becomes the prompt's logprobs (default 0, null read as 0).
    None when the engine computes none."""
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("echo") and (chat or body.get("logprobs") is not None):
        return "echo"
    return None


def parse_request(endpoint: str, raw: bytes) -> ParsedRequest:
    """Check a chat or completions body; raise a GatewayError (400) for a bad one."""
    try:
        return _parse_request(endpoint, raw)
    except RecursionError as exc:  # measuring a deeply nested field (`_bytes`)
        raise _unparsable(_TOO_DEEP) from exc


def _parse_request(endpoint: str, raw: bytes) -> ParsedRequest:
    body = parse_json(raw)
    chat = endpoint == "chat.completions"
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    if body.get("cache_salt") == "":  # as vLLM refuses it (the gateway never sends it as is)
        raise invalid(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt", code="invalid_value",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("You must provide a model parameter.", param="model", code="missing_model")
    if chat:
        if "messages" not in body:
            raise invalid("Missing required parameter: 'messages'.", param="messages")
        if not isinstance(body["messages"], list):
            raise invalid(
                "Invalid type for 'messages': expected an array.", param="messages",
                code="invalid_type",
            )
        num_prompts = 1
        prompt_upper = _chat_prompt_upper(body["messages"])
        prompt_upper += _bytes(body.get("tools")) + _bytes(body.get("documents"))
        if body.get("max_completion_tokens") is not None:
            max_tokens, param = body["max_completion_tokens"], "max_completion_tokens"
        else:
            max_tokens, param = body.get("max_tokens"), "max_tokens"
    else:
        if "prompt" not in body:
            raise invalid("Missing required parameter: 'prompt'.", param="prompt")
        num_prompts, prompt_upper = _completion_prompts(body["prompt"])
        param = "max_tokens"
        # vLLM's completions default is 16 when the field is absent (null means "up to the
        # context length").
        max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and max_tokens < 1:
        raise invalid(
            f"Invalid '{param}': integer below minimum value. Expected a value >= 1, but got "
            f"{max_tokens} instead.",
            param=param, code="integer_below_min_value",
        )
    n = body.get("n")
    n = 1 if n is None else n
    if n < 1 or n > 128:
        raise invalid("Invalid 'n': expected a value between 1 and 128.", param="n",
                      code="invalid_value")
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("The 'stream_options' parameter is only allowed when 'stream' is "
                          "enabled.", param="stream_options", code="invalid_value")
        for key, value in options.items():
            if key not in ("include_usage", "continuous_usage_stats"):
                raise GatewayError(
                    400, f"Unrecognized stream option supplied: {key}",
                    param=f"stream_options.{key}", code="unknown_parameter",
                )
            if not isinstance(value, bool):
                raise invalid(f"Invalid type for 'stream_options.{key}': expected a boolean.",
                              param=f"stream_options.{key}", code="invalid_type")
    wants_usage = bool(options and options.get("include_usage"))
    return ParsedRequest(
        endpoint=endpoint,
        upstream_path="/v1/chat/completions" if chat else "/v1/completions",
        body=body,
        model=model,
        stream=stream,
        wants_usage=wants_usage,
        max_tokens=max_tokens,
        max_tokens_param=param,
        n=n,
        num_prompts=num_prompts,
        prompt_upper=prompt_upper,
        size=len(raw),
        prompt_logprobs=prompt_logprobs_field(chat, body),
    )
