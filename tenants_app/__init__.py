"""Tenants, memberships and roles, API keys, limits and budgets."""
