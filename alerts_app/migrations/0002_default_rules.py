"""The rules the console ships with, as platform rules platform admins may change or disable:
the operator's usual three (GPU utilisation above 90% for 5 minutes, latency above 500 ms,
failures above 5% a minute per deployment), each tenant's own latency objective, and each
tenant's monthly budget at 80% and 100%."""

from django.db import migrations

DEFAULTS = [
    {"key": "gpu-utilization", "name": "GPU utilisation above 90%", "metric": "gpu_utilization",
     "scope": "node", "comparison": ">", "threshold": 90.0, "window_seconds": 60,
     "for_seconds": 300, "severity": "warning", "min_requests": 1},
    {"key": "latency", "name": "p95 latency above 500 ms", "metric": "latency",
     "scope": "deployment", "comparison": ">", "threshold": 500.0, "percentile": 95,
     "window_seconds": 60, "for_seconds": 60, "severity": "warning", "min_requests": 10},
    {"key": "failure-rate", "name": "Failure rate above 5%", "metric": "error_rate",
     "scope": "deployment", "comparison": ">", "threshold": 5.0, "window_seconds": 60,
     "for_seconds": 60, "severity": "critical", "min_requests": 20},
    {"key": "latency-objective", "name": "Tenant's latency objective missed",
     "metric": "latency", "scope": "tenant", "comparison": ">", "threshold": None,
     "use_tenant_objective": True, "percentile": 95, "window_seconds": 300,
     "for_seconds": 300, "severity": "warning", "min_requests": 20},
    {"key": "budget-80", "name": "Monthly token budget 80% used", "metric": "budget_used",
     "scope": "tenant", "comparison": ">=", "threshold": 80.0, "recovery_threshold": 79.0,
     "window_seconds": 60, "for_seconds": 0, "severity": "warning", "min_requests": 1},
    {"key": "budget-100", "name": "Monthly token budget used up", "metric": "budget_used",
     "scope": "tenant", "comparison": ">=", "threshold": 100.0, "recovery_threshold": 99.0,
     "window_seconds": 60, "for_seconds": 0, "severity": "critical", "min_requests": 1},
]


def create_defaults(apps, schema_editor):
    rule = apps.get_model("alerts_app", "AlertRule")
    for fields in DEFAULTS:
        rule.objects.get_or_create(key=fields["key"], defaults=fields)


def remove_defaults(apps, schema_editor):
    apps.get_model("alerts_app", "AlertRule").objects.filter(
        key__in=[d["key"] for d in DEFAULTS]).delete()


class Migration(migrations.Migration):
    dependencies = [("alerts_app", "0001_alerts")]

    operations = [migrations.RunPython(create_defaults, remove_defaults)]
