"""Prefix-cache isolation: a secret per tenant (each existing tenant gets its own; AddField's
callable default is evaluated once for all existing rows) and admin-managed sharing groups."""

import secrets

import django.db.models.deletion
from django.db import migrations, models

import tenants_app.models


def give_each_tenant_its_own_secret(apps, schema_editor):
    Tenant = apps.get_model("tenants_app", "Tenant")
    for tenant in Tenant.objects.only("pk").iterator():
        Tenant.objects.filter(pk=tenant.pk).update(cache_secret=secrets.token_hex(32))


class Migration(migrations.Migration):

    dependencies = [
        ('tenants_app', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='PrefixCacheGroup',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.SlugField(unique=True)),
                ('description', models.CharField(blank=True, max_length=200)),
                ('cache_secret', models.CharField(default=tenants_app.models.new_cache_secret, editable=False, help_text="Secret the group's members derive their prefix-cache salt from.", max_length=64)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'verbose_name': 'prefix-cache sharing group',
                'ordering': ['name'],
            },
        ),
        migrations.AddField(
            model_name='tenant',
            name='cache_secret',
            field=models.CharField(default=tenants_app.models.new_cache_secret, editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name='tenant',
            name='prefix_cache_group',
            field=models.ForeignKey(blank=True, help_text="Share engines' prefix cache with this group's tenants. Empty: with nobody.", null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='tenants', to='tenants_app.prefixcachegroup'),
        ),
        migrations.RunPython(give_each_tenant_its_own_secret, migrations.RunPython.noop),
    ]
