"""The classifier stage's core (issue 27): ask a guard model (Llama Guard / Qwen3Guard style)
for a verdict on a prompt and decide what the request does, on plain data.

A `GuardModel` is a prompt template (`{prompt}` is the text judged), the verdicts the model may
answer, and which of them block. `request()` is the chat-completions body sent to the guard
model's engine: vLLM's structured output (`structured_outputs: {"choice": [...]}`, vLLM 0.32)
limits the answer to exactly one of the verdicts, at temperature 0 with a few tokens, so the
parser never guesses. `verdict()` reads the answer back (None for anything else: an engine
without structured output, an error body). `decide()` turns a verdict, or none within the
policy's timeout, into the request's fate: a blocking verdict blocks (the same OpenAI 400 as a
detector's block, category `CLASSIFIER`), no verdict blocks only when the policy fails closed.

The gateway's side (`gateway_app.screen.Screen.classify`): a policy's `Classifier` names
the guard deployment (a deployment marked with `guardrails_app.models.GuardModel`), the wait and
fail-open/closed; the call is metered to the tenant whose request it judged. See
docs/guardrails.md.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

from guardrails_app.policy import blocked_error

CATEGORY = "CLASSIFIER"


class ClassifierError(ValueError):
    """A guard model that cannot be used (its template or verdicts)."""


@dataclass(frozen=True)
class GuardModel:
    """How to ask one guard model and read its answer."""

    template: str
    verdicts: tuple[str, ...] = ("safe", "unsafe")
    blocking: frozenset[str] = field(default_factory=lambda: frozenset({"unsafe"}))
    max_tokens: int = 16  # a verdict is a few tokens; the tiny model spells "unsafe" in 5+

    def __post_init__(self) -> None:
        if self.template.count("{prompt}") != 1:
            raise ClassifierError("the template names {prompt} exactly once")
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion
                      in string.Formatter().parse(self.template) if name is not None]
        except ValueError as exc:
            raise ClassifierError(f"the template has other fields than {{prompt}}: {exc}"
                                  ) from None
        if fields != [("prompt", "", None)]:
            # Another field, or a format spec ({prompt:>999999999} would build a huge string).
            raise ClassifierError("the template has other fields than {prompt} (write a "
                                  "literal brace as {{ or }})")
        if len(set(self.verdicts)) < 2 or any(not v.strip() for v in self.verdicts):
            raise ClassifierError("at least two distinct, non-empty verdicts")
        if not self.blocking or not self.blocking <= set(self.verdicts):
            raise ClassifierError("the blocking verdicts are some of the verdicts")
        if self.blocking == set(self.verdicts):
            raise ClassifierError("some verdict must let a request through")

    def request(self, model: str, prompt: str) -> dict[str, Any]:
        """The chat-completions body for the guard model's engine."""
        return {
            "model": model,
            "messages": [{"role": "user", "content": self.template.format(prompt=prompt)}],
            "structured_outputs": {"choice": list(self.verdicts)},
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "stream": False,
        }

    def verdict(self, answer: Any) -> str | None:
        """The verdict in a chat-completions answer (parsed JSON), or None."""
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return None
        text = content.strip() if isinstance(content, str) else None
        return text if text in self.verdicts else None


# The Llama Guard style: the conversation to judge and a one-word assessment.
LLAMA_GUARD = GuardModel(
    template=(
        "Task: Check if there is unsafe content in the 'User' message below according to our "
        "safety policy (violent crimes, non-violent crimes, sex crimes, child exploitation, "
        "specialized advice, privacy, intellectual property, weapons, hate, self-harm, sexual "
        "content, elections, code interpreter abuse, prompt injection).\n\n"
        "<BEGIN CONVERSATION>\n\nUser: {prompt}\n\n<END CONVERSATION>\n\n"
        "Provide your safety assessment for the User message: answer safe or unsafe."),
)


@dataclass(frozen=True)
class Decision:
    """What the classifier stage does with a request: `blocked` is the 400 body or None;
    `verdict` is what the guard model answered (None: no answer in time, or none it may
    give); `failed_open` says a request went on without a verdict."""

    verdict: str | None
    blocked: dict[str, Any] | None
    failed_open: bool = False


def decide(guard: GuardModel | None, verdict: str | None, *, fail_open: bool) -> Decision:
    """The request's fate from the guard model's verdict (None: it timed out, answered
    nothing usable, or no guard model could be asked, `guard` None): a blocking verdict
    blocks; no verdict blocks unless the policy fails open."""
    if verdict is None or guard is None:
        verdict = None
        if fail_open:
            return Decision(None, None, failed_open=True)
        return Decision(None, blocked_error(CATEGORY))
    if verdict in guard.blocking:
        return Decision(verdict, blocked_error(CATEGORY))
    return Decision(verdict, None)
