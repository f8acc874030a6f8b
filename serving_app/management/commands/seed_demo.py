"""Seed the demo: a platform admin, the three seed-scenario tenants with members, limits and keys,
the generated tiny model with each tenant's adapter, and one shared deployment.

Idempotent: running it again updates what exists and prints fresh key secrets only for keys it
creates.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from serving_app.models import BaseModel, Deployment, LoraAdapter
from tenants_app.models import ApiKey, Membership, PriorityTier, Role, Tenant

TENANTS = [
    {
        "slug": "customer-service",
        "name": "Customer service",
        "adapter": "tiny-llama-lora-a",
        "priority_tier": PriorityTier.HIGH,
        "requests_per_minute": 600,
        "tokens_per_minute": 60_000,
        "max_concurrent_requests": 16,
        "monthly_token_budget": 50_000_000,
        "max_tokens_per_request": 256,
        "max_prompt_tokens": 1024,
        "latency_objective_ms": 500,
        "gpu_memory_quota_gib": 40,
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
        "gpu_memory_quota_gib": 80,
    },
    {
        "slug": "content-gen",
        "name": "Content generation",
        "adapter": "tiny-llama-lora-c",
        "priority_tier": PriorityTier.LOW,
        "requests_per_minute": 1200,
        "tokens_per_minute": 300_000,
        "max_concurrent_requests": 32,
        "monthly_token_budget": 500_000_000,
        "max_tokens_per_request": 1024,
        "max_prompt_tokens": 1024,
        "latency_objective_ms": 5000,
        "gpu_memory_quota_gib": 160,
    },
]


class Command(BaseCommand):
    help = "Create the demo admin, tenants, keys, the tiny model, adapters and a deployment."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--models-dir", default=str(settings.BASE_DIR / "var" / "models"))
        parser.add_argument("--admin-password", default="admin-demo-password")
        parser.add_argument("--start", action="store_true", help="Set the deployment running.")

    @transaction.atomic
    def handle(self, *args, models_dir: str, admin_password: str, start: bool, **options) -> None:
        models = Path(models_dir).resolve()
        if not (models / "tiny-llama" / "config.json").is_file():
            raise CommandError(f"No tiny model under {models}; run scripts/setup_engine.sh first.")
        # The platform registers the demo's model and its tenants' adapters from a model root
        # (tenants themselves only ever upload theirs).
        roots = [Path(root).resolve() for root in settings.MODEL_ROOTS]
        if not any(root == models or root in models.parents for root in roots):
            raise CommandError(
                f"{models} is not under MODEL_ROOTS ({', '.join(map(str, roots))}): set "
                "MODEL_ROOTS to include it."
            )
        User = get_user_model()
        admin, _ = User.objects.get_or_create(
            username="admin", defaults={"is_staff": True, "is_superuser": True}
        )
        admin.is_staff = admin.is_superuser = True
        admin.set_password(admin_password)
        admin.save()
        self.stdout.write(f"platform admin: admin / {admin_password}")

        base = BaseModel.objects.filter(name="tiny-llama").first() or BaseModel(name="tiny-llama")
        base.path = str(models / "tiny-llama")
        base.dtype = "float32"
        base.full_clean()
        base.save()

        tenants, adapters = [], []
        for spec in TENANTS:
            spec = dict(spec)
            adapter_dir = spec.pop("adapter")
            tenant, _ = Tenant.objects.update_or_create(slug=spec.pop("slug"), defaults=spec)
            tenant.full_clean()
            tenants.append(tenant)
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
            adapters.append(adapter)
            if not ApiKey.objects.filter(tenant=tenant, name="demo").exists():
                _, secret = ApiKey.objects.create_key(tenant=tenant, name="demo", created_by=admin)
                self.stdout.write(
                    f"{tenant.slug}: user {tenant.slug}-owner / "
                    f"{tenant.slug}-owner-password, API key {secret}"
                )

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
        if start:
            deployment.set_desired_state(Deployment.DesiredState.RUNNING)
            from serving_app.lifecycle import deployment_changed

            deployment_changed(deployment.pk)
        self.stdout.write(
            self.style.SUCCESS(
                f"seeded {len(tenants)} tenants, model {base.name}, deployment {deployment.name} "
                f"({deployment.desired_state})"
            )
        )
