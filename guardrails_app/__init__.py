"""Guardrails: per-tenant request filtering and PII redaction, streaming-aware (docs/guardrails.md).

The core is Django-free (an import contract keeps it so) and works on plain text, so the
gateway and the policy test bench call the same functions:

- `detectors`: the detectors (validated PII recognizers, secrets, tenants' patterns and
  deny-lists compiled with RE2), their prefilter, and a Presidio analyzer over them;
- `policy`: policies (platform floor, tenant, key; stricter only), `Guard.apply()`, the
  request's `Vault` of reversible placeholders, findings and events without the matched text;
- `streaming`: output redaction of a stream with a bounded hold-back window, and restoring
  input placeholders in streamed answers.
"""
