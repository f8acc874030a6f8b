"""Base models, adapters, nodes and GPUs, deployments and instances."""
