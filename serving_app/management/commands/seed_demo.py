"""Seed the demo: a platform admin, the three seed-scenario tenants with members, limits and keys,
the generated tiny model with each tenant's adapter, one shared deployment, and the
three-department fleet (4 x A100-80GB, two of them split into MIG devices) as a what-if plan, so
that the GPU allocation page shows an allocation on a host without GPUs.

Idempotent: running it again updates what exists and prints fresh key secrets only for keys it
creates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from serving_app.models import BaseModel, Deployment, FleetPlan, LoraAdapter
from serving_app.models.autoscalers import Autoscaler, Metric
from tenants_app.models import ApiKey, Membership, PriorityTier, Role, Tenant

TENANTS = [
    {
        "slug": "customer-service",
        "name": "Customer service",
        "adapter": "tiny-llama-lora-a",
        "priority_tier": PriorityTier.HIGH,
        "requests_per_minute": 600,
        "tokens_per_minute": 60_000,
        "max_concurrent_requests": 8,  # its max_num_seqs on the shared engine
        "monthly_token_budget": 50_000_000,
        "max_tokens_per_request": 256,
        "max_prompt_tokens": 1024,
        "latency_objective_ms": 500,
        "fair_share_weight": 2,
        "gpu_memory_quota_gib": 80,
    },
    {
        "slug": "code-assistant",
        "name": "Code assistant",
        "adapter": "tiny-llama-lora-b",
        "priority_tier": PriorityTier.NORMAL,
        "requests_per_minute": 300,
        "tokens_per_minute": 120_000,
        "max_concurrent_requests": 8,
        "monthly_token_budget": 100_000_000,
        "max_tokens_per_request": 1024,
        "max_prompt_tokens": 1536,
        "latency_objective_ms": 2000,
        "fair_share_weight": 1,
        "gpu_memory_quota_gib": 80,
    },
    {
        "slug": "content-gen",
        "name": "Content generation",
        "adapter": "tiny-llama-lora-c",
        "priority_tier": PriorityTier.LOW,
        "requests_per_minute": 1200,
        "tokens_per_minute": 300_000,
        "max_concurrent_requests": 64,
        "monthly_token_budget": 500_000_000,
        "max_tokens_per_request": 1024,
        "max_prompt_tokens": 1024,
        "latency_objective_ms": 5000,
        "fair_share_weight": 1,
        "gpu_memory_quota_gib": 160,
    },
]

# The three-department case on the hardware it was measured on: one host with 4 x A100-80GB,
# GPUs 2 and 3 split into MIG devices (3g.40gb twice; 4g.40gb + 2g.20gb + 1g.10gb).
THREE_DEPARTMENT_FLEET = """\
# 4 x A100-80GB on one host; GPUs 2 and 3 are split into MIG devices.
a100-host: 2xNVIDIA A100-SXM4-80GB:80GiB, 2:NVIDIA A100-SXM4-80GB:80GiB[2x3g.40gb], \
3:NVIDIA A100-SXM4-80GB:80GiB[4g.40gb,2g.20gb,1g.10gb]
"""

# Architectures from the models' config.json and safetensors sizes (bf16 checkpoints).
LLAMA_3_1_8B = {
    "name": "Llama-3.1-8B-Instruct", "num_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 131072, "weight_bytes": 16_060_522_496,
}
QWEN2_7B = {
    "name": "Qwen2-7B-Instruct", "num_layers": 28, "hidden_size": 3584,
    "num_attention_heads": 28, "num_kv_heads": 4, "head_dim": 128, "intermediate_size": 18944,
    "vocab_size": 152064, "max_position_embeddings": 32768, "weight_bytes": 15_231_233_024,
}
LLAMA_3_2_1B = {
    "name": "Llama-3.2-1B-Instruct", "num_layers": 16, "hidden_size": 2048,
    "num_attention_heads": 32, "num_kv_heads": 8, "head_dim": 64, "intermediate_size": 8192,
    "vocab_size": 128256, "max_position_embeddings": 131072, "weight_bytes": 2_471_628_800,
    "tie_word_embeddings": True,
}
DEPARTMENTS = ["customer-service", "code-assistant", "content-gen"]

# The optimised layout: all three departments on one shared multi-LoRA Llama-3.1-8B instance
# per whole GPU (customer service at most 8 sequences and 256 tokens, content generation 64,
# through their tenant limits), and the MIG devices for what is better kept apart: code
# completion with a long, cached context, content generation's offline batch, and customer
# service's small guard model.
THREE_DEPARTMENT_DEPLOYMENTS = [
    {"name": "shared-llama", "model": LLAMA_3_1_8B, "tenants": DEPARTMENTS, "replicas": 2,
     "isolation": "shared", "max_num_seqs": 96, "max_model_len": 4096,
     "max_num_batched_tokens": 8192, "max_loras": 4, "max_lora_rank": 16},
    {"name": "code-completion", "model": QWEN2_7B, "tenants": ["code-assistant"],
     "isolation": "mig", "max_num_seqs": 16, "max_model_len": 8192,
     "target_kv_tokens": 2 * 16 * 8192, "max_loras": 1},
    {"name": "content-batch", "model": LLAMA_3_1_8B, "tenants": ["content-gen"],
     "isolation": "mig", "max_num_seqs": 32, "max_model_len": 2048, "max_loras": 1},
    {"name": "support-guard", "model": LLAMA_3_2_1B, "tenants": ["customer-service"],
     "isolation": "mig", "max_num_seqs": 16, "max_model_len": 2048, "max_loras": 1},
]


class Command(BaseCommand):
    help = "Create the demo admin, tenants, keys, the tiny model, adapters and a deployment."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--models-dir", default=str(settings.BASE_DIR / "var" / "models"))
        parser.add_argument("--admin-password", default="admin-demo-password")
        parser.add_argument("--start", action="store_true", help="Set the deployment running.")

    @transaction.atomic
    def handle(self, *args, models_dir: str, admin_password: str, start: bool, **options) -> None:
        models = _models_under_a_root(models_dir)
        admin = seed_admin(admin_password)
        self.stdout.write(f"platform admin: admin / {admin_password}")
        base = BaseModel.objects.filter(name="tiny-llama").first() or BaseModel(name="tiny-llama")
        base.path = str(models / "tiny-llama")
        base.test_model = True  # random weights: the demo's answers are noise by design
        base.dtype = "float32"
        base.full_clean()
        base.save()
        tenants, adapters = [], []
        for spec in TENANTS:
            tenant, adapter, secret = seed_tenant(dict(spec), base, models, admin)
            tenants.append(tenant)
            adapters.append(adapter)
            if secret is not None:
                self.stdout.write(f"{tenant.slug}: user {tenant.slug}-owner / "
                                  f"{tenant.slug}-owner-password, API key {secret}")
        deployment = seed_deployment(base, tenants, adapters, admin)
        if start:
            deployment.start()
        plan = seed_plan(admin)
        self.stdout.write(
            self.style.SUCCESS(
                f"seeded {len(tenants)} tenants, model {base.name}, deployment {deployment.name} "
                f"({deployment.desired_state}), what-if plan {plan.name} (GPU allocation page)"
            )
        )


def _models_under_a_root(models_dir: str) -> Path:
    """The models folder, which must hold the tiny model and be under a model root: the
    platform registers the demo's model and its tenants' adapters from there (tenants
    themselves only ever upload theirs)."""
    models = Path(models_dir).resolve()
    if not (models / "tiny-llama" / "config.json").is_file():
        raise CommandError(f"No tiny model under {models}; run scripts/setup_engine.sh first.")
    roots = [Path(root).resolve() for root in settings.MODEL_ROOTS]
    if not any(root == models or root in models.parents for root in roots):
        raise CommandError(
            f"{models} is not under MODEL_ROOTS ({', '.join(map(str, roots))}): set "
            "MODEL_ROOTS to include it."
        )
    return models


def seed_admin(password: str) -> User:
    """The platform admin `admin`, with `password`."""
    admin, _ = User.objects.get_or_create(
        username="admin", defaults={"is_staff": True, "is_superuser": True}
    )
    admin.is_staff = admin.is_superuser = True
    admin.set_password(password)
    admin.save()
    return admin


def seed_tenant(spec: dict[str, Any], base: BaseModel, models: Path,
                admin: User) -> tuple[Tenant, LoraAdapter, str | None]:
    """A tenant of `TENANTS` with its owner and member, its adapter of `base` and its key `demo`
    (the key's secret when it is created now, else None)."""
    adapter_dir = spec.pop("adapter")
    tenant, _ = Tenant.objects.update_or_create(slug=spec.pop("slug"), defaults=spec)
    tenant.full_clean()
    for role in (Role.OWNER, Role.MEMBER):
        username = f"{tenant.slug}-{role}"
        user, created = User.objects.get_or_create(username=username)
        if created:
            user.set_password(f"{username}-password")
            user.save()
        Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": role})
    adapter = LoraAdapter.objects.filter(tenant=tenant, name="house-style").first()
    adapter = adapter or LoraAdapter(tenant=tenant, base_model=base, name="house-style")
    adapter.path = str(models / adapter_dir)
    adapter.full_clean()
    adapter.save()
    secret = None
    if not ApiKey.objects.filter(tenant=tenant, name="demo").exists():
        _, secret = ApiKey.objects.create_key(tenant=tenant, name="demo", created_by=admin)
    return tenant, adapter, secret


def seed_deployment(base: BaseModel, tenants: list[Tenant], adapters: list[LoraAdapter],
                    admin: User) -> Deployment:
    """The shared deployment `tiny-chat` of `base` for every tenant and adapter, with an
    autoscaling policy to look at and turn on (off: the benchmarks drive this engine hard)."""
    deployment = Deployment.objects.filter(name="tiny-chat").first() or Deployment(
        name="tiny-chat", base_model=base, created_by=admin
    )
    deployment.max_model_len = 1024
    deployment.max_num_seqs = 32
    deployment.dtype = "float32"
    deployment.max_loras = 4
    deployment.max_lora_rank = 16
    deployment.scheduling_policy = Deployment.SchedulingPolicy.PRIORITY
    deployment.full_clean()
    deployment.save()
    deployment.tenants.set(tenants)
    deployment.check_relations(tenants, adapters)
    deployment.adapters.set(adapters)
    Autoscaler.objects.get_or_create(deployment=deployment, defaults={
        "enabled": False, "min_replicas": 1, "max_replicas": 2, "metric": Metric.WAITING,
        "target": 8})
    return deployment


def seed_plan(admin=None) -> FleetPlan:
    """The three-department fleet and its optimised layout as a what-if plan (its tenants must
    exist); idempotent."""
    plan = FleetPlan.objects.filter(name="three-departments").first() or FleetPlan(
        name="three-departments", created_by=admin
    )
    plan.description = (
        "Customer service, code assistant and content generation on 4 x A100-80GB: one shared "
        "multi-LoRA Llama-3.1-8B instance per whole GPU, MIG devices for code completion, "
        "content generation's batch work and customer service's guard model."
    )
    plan.fleet = THREE_DEPARTMENT_FLEET
    plan.deployments = THREE_DEPARTMENT_DEPLOYMENTS
    plan.full_clean()
    plan.save()
    return plan
