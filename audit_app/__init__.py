"""The audit log, at the bottom of the apps: who changed what, when and from where.

Changes are recorded where they happen (model signals, `audit_app.registry`), with the actor and
the source taken from the request, task or shell session that made them (`audit_app.context`).
Every model of every installed app is either audited or excluded with its reason, and a system
check (`audit_app.checks`) refuses a model that is neither.
"""
