"""Keeping deployments running as asked: reconciliation, rollouts, draining, autoscaling, and
the reads of the gateway's per-deployment state (flow control, requests in flight, the catalog
of what each tenant may call)."""
