"""Settings for the console, read from the environment (see `console.env`).

With no variables set this is the embedded default: a SQLite file under `var/`, Redis on
localhost, DEBUG off (so SECRET_KEY is required; the demo and the tests set DEBUG=true).
Production sets DATABASE_URL (PostgreSQL), SECRET_KEY and ALLOWED_HOSTS, and the TLS settings of
the security block below (the README's "Running in production" lists them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from console.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_str,
    field_encryption_keys,
)

# The pages name their model and form in type arguments (`ListView[Tenant]`), which django-stubs
# reads; this lets Python accept them on Django's generic views and forms (it adds only
# `__class_getitem__`).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("CONSOLE_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

# Off unless asked for: a production install that forgets it must not show Django's debug page
# (tracebacks, settings, URLs with their passwords) to every tenant user.
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY must be set when DEBUG is false (set SECRET_KEY or SECRET_KEY_FILE)"
        )
    SECRET_KEY = "insecure-development-key-do-not-use-in-production"
# Secrets stored encrypted (audit_app.encryption): Fernet keys, comma-separated; the first
# encrypts, all decrypt (rotation: docs/security.md). Never given to a node (its process reads
# ciphertext only, NODE_NAME set); DEBUG derives one from SECRET_KEY, with a warning.
FIELD_ENCRYPTION_KEYS = [] if env_str("NODE_NAME", "") else field_encryption_keys(
    env_list("FIELD_ENCRYPTION_KEYS", []), debug=DEBUG, secret_key=SECRET_KEY)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "django_filters",
    "drf_spectacular_sidecar",
    "drf_spectacular",
    "audit_app",
    "tenants_app",
    "serving_app",
    "gateway_app",
    "guardrails_app",
    "alerts_app",
    "backups_app",
    "billing_app",
    "ui_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves static/ under uvicorn too (no separate web server needed for a one-host console).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Who changes what, and from where, for the audit log (audit_app.context).
    "audit_app.middleware.AuditContextMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # With DEBUG on, Django's debug pages for platform admins only (ui_app/middleware.py).
    "ui_app.middleware.DebugPagesForStaffOnlyMiddleware",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"
ASGI_APPLICATION = "console.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


# A node whose agent has not sent a heartbeat for this long is declared lost by the reconciler:
# its instances are replaced on other nodes (several heartbeats: one late beat is not a loss).
NODE_LOST_SECONDS = env_float("NODE_LOST_SECONDS", 30.0, minimum=1.0)


def _database() -> dj_database_url.DBConfig:
    url = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'console.sqlite3'}")
    try:
        config = dj_database_url.parse(url, conn_max_age=env_int("DB_CONN_MAX_AGE", 0, minimum=0))
    except Exception as exc:  # dj_database_url raises several types for a malformed URL
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
    # Every API request is one transaction: a failed write leaves nothing half-written.
    config["ATOMIC_REQUESTS"] = True
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # The embedded default is shared by the console, workers and the usage writer: WAL lets
        # readers run beside a writer, IMMEDIATE transactions queue writers instead of failing.
        config["OPTIONS"] = {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    elif env_str("NODE_NAME", ""):
        # A node agent frozen or cut off inside one of its transactions would hold its rows
        # (its node's among them) until its connection dies, which TCP may take hours to see:
        # PostgreSQL ends such a session after half the time that declares the node lost, so
        # the reconciler can declare it lost and replace its instances (no agent transaction
        # waits on anything but the database).
        idle_ms = max(1000, round(NODE_LOST_SECONDS * 500))
        options = config.setdefault("OPTIONS", {})  # the URL's own (sslmode...) kept
        options["options"] = " ".join(filter(None, [
            options.get("options", ""), f"-c idle_in_transaction_session_timeout={idle_ms}"]))
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Images collect the static files at build time outside VAR_DIR (a volume at run time).
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "staticfiles")))
# `collectstatic` (scripts/demo.sh; docs/operations.md for production) writes every file under a
# content-hashed name with gzip and brotli copies beside it; whitenoise serves those with a
# year's immutable caching, so a browser fetches plotly.js once, compressed. STATIC_HASHED (on
# unless DEBUG is; scripts/demo.sh turns it on with DEBUG) serves those copies; off, the plain
# names are served from static/ as they change (development).
STATIC_HASHED = env_bool("STATIC_HASHED", not DEBUG)
WHITENOISE_USE_FINDERS = not STATIC_HASHED
WHITENOISE_AUTOREFRESH = not STATIC_HASHED
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "console.staticfiles.ConsoleStaticFilesStorage"},
}

LOGIN_URL = "/login/"

# The source an audit entry names for a change a request made, by the longest matching path
# prefix (any other path is the console's pages).
AUDIT_REQUEST_SOURCES = {"/admin/": "admin", "/api/": "api", "/api-auth/": "api",
                         "/portal/": "portal"}

# How long an invitation to join a tenant stays open (days).
INVITATION_EXPIRY_DAYS = env_int("INVITATION_EXPIRY_DAYS", 7, minimum=1)
# Previous SECRET_KEYs, comma-separated, still accepted for signatures while a new one rolls out
# (docs/security.md, "Rotating keys and secrets").
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [])

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "knox.auth.TokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "console.api.CappedLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "console.api_schema.ConsoleSchema",
    "EXCEPTION_HANDLER": "console.api.exception_handler",
}

# The largest page a list endpoint answers (`?limit=` above it gets this many).
API_MAX_PAGE_SIZE = env_int("API_MAX_PAGE_SIZE", 500, minimum=1)

SPECTACULAR_SETTINGS = {
    "TITLE": "LLM Console management API",
    "DESCRIPTION": "Tenants, models, adapters, nodes and deployments of a vLLM console.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Served from our own static files: the console must work on an air-gapped host.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Operations grouped by resource (the path's first part after /api/v1/), not in one "api"
    # group.
    "SCHEMA_PATH_PREFIX": r"/api/v[0-9]+",
    # Each group's description, for the people who call the API.
    "TAGS": [
        {"name": "tenants",
         "description": (
             "Tenants: limits, budgets, fair-share weight, storage quota. Platform admins manage "
             "them; members read their own."
         )},
        {"name": "memberships",
         "description": (
             "Who belongs to a tenant, with which role (owner, admin, member, viewer)."
         )},
        {"name": "invitations",
         "description": (
             "Invitations to join a tenant, sent by its owners and admins."
         )},
        {"name": "my-invitations",
         "description": (
             "The invitations addressed to you: accept or decline."
         )},
        {"name": "users", "description": "User accounts (platform admins)."},
        {"name": "api-keys",
         "description": (
             "API keys for the OpenAI-compatible endpoint under /v1/: create (the secret is shown "
             "once), list, revoke."
         )},
        {"name": "auth",
         "description": (
             "Tokens for this management API: sign in for one, revoke it or all of yours."
         )},
        {"name": "prefix-cache-groups",
         "description": (
             "Groups of tenants that may share the engines' prefix cache."
         )},
        {"name": "base-models",
         "description": (
             "Base models the engines serve (a folder on the nodes, its architecture read from "
             "config.json)."
         )},
        {"name": "adapters",
         "description": (
             "Tenants' LoRA adapters: register from a folder or upload a zipped one."
         )},
        {"name": "deployments",
         "description": (
             "Deployments: what should run (model, adapters, engine settings, replicas, isolation)"
             " and the actions on them: start, stop, restart, scale, apply a revision, roll back."
         )},
        {"name": "capacity-tests", "description": (
            "Capacity tests: a deployment's engine measured with vLLM's own benchmark client at "
            "rising concurrency by its node's agent (latency p95s against tokens/s).")},
        {"name": "instances",
         "description": (
             "Instances: the engine processes that run a deployment, with their state, node, GPUs "
             "and logs."
         )},
        {"name": "artifacts",
         "description": (
             "Content-addressed model and adapter files: immutable versions (a manifest of "
             "files with sizes and SHA-256 digests), which nodes hold them, and how a version "
             "comes in: an upload in chunks, a node's folder, an S3 bucket, a Hugging Face "
             "repository."
         )},
        {"name": "artifact-imports",
         "description": (
             "Uploads and imports of artifact versions: state, progress and error; an upload "
             "takes its files' bytes here in resumable chunks."
         )},
        {"name": "nodes",
         "description": (
             "GPU hosts running a node agent: cordon, uncordon, drain."
         )},
        {"name": "node-join-tokens",
         "description": (
             "Joining a host: one-time, expiring join tokens made for a node name (shown once, "
             "stored hashed), and the exchange a joining host makes with one for its node's "
             "settings (`POST /api/v1/node-join/`)."
         )},
        {"name": "gpus",
         "description": (
             "GPUs as the node agents read them through NVML, with their recent samples."
         )},
        {"name": "plan", "description": "Dry-run placement: would a deployment fit, and where."},
        {"name": "gpu-allocation",
         "description": (
             "What each GPU holds, per deployment and per tenant."
         )},
        {"name": "gpu-accounting",
         "description": (
             "GPU memory and time charged to each tenant over a period."
         )},
        {"name": "fleet-plans",
         "description": (
             "What-if plans: a declared fleet and deployments placed on it without starting "
             "anything."
         )},
        {"name": "autoscalers",
         "description": (
             "Autoscaling policies: a deployment's replica range, metric and target."
         )},
        {"name": "events",
         "description": (
             "What the control plane did and why, per deployment and for the cluster."
         )},
        {"name": "audit-log", "description": "Who changed what, when, and from where."},
        {"name": "health",
         "description": (
             "PostgreSQL, Redis and the usage writer, as the console sees them."
         )},
        {"name": "guardrail-floor",
         "description": (
             "The platform's guardrail floor: the detectors every tenant gets (platform admins)."
         )},
        {"name": "tenant-guardrails",
         "description": (
             "A tenant's guardrail policy (stricter than the floor only) and its test bench."
         )},
        {"name": "key-guardrails",
         "description": (
             "An API key's narrowing of its tenant's guardrail policy (stricter only)."
         )},
        {"name": "guard-models",
         "description": (
             "Deployments marked as guard models: the prompt template, the verdicts and which of "
             "them block (platform admins change them; everyone signed in lists them)."
         )},
        {"name": "guardrail-patterns",
         "description": (
             "A tenant's own patterns and deny-lists for its guardrail policy."
         )},
        {"name": "alert-rules",
         "description": (
             "Alert rules: a metric, a scope, a threshold and a window."
         )},
        {"name": "alerts",
         "description": (
             "Alerts: each rule's condition per scope, firing, pending, ok or without data; "
             "acknowledge."
         )},
        {"name": "alert-channels",
         "description": (
             "Where notifications go: e-mail or signed webhooks."
         )},
        {"name": "alert-silences",
         "description": (
             "Silences: no notifications for matching alerts for a while."
         )},
        {"name": "alert-deliveries", "description": "Every notification sent, with its outcome."},
        {"name": "backups",
         "description": (
             "Dumps of the console's database (platform admins): state, file, size, SHA-256 "
             "and error; back up now."
         )},
        {"name": "price-cards",
         "description": (
             "Token prices per base model or adapter (input, cached input, output per million "
             "tokens), effective-dated and versioned; the card in force at a moment."
         )},
        {"name": "gpu-price-cards",
         "description": (
             "Prices per GPU-second by GPU model or MIG profile, effective-dated and versioned."
         )},
        {"name": "money-budgets",
         "description": (
             "Budgets in money per tenant or API key and period, with a soft threshold that "
             "alerts and a hard limit the gateway enforces (insufficient_quota)."
         )},
        {"name": "statements",
         "description": (
             "Statements per tenant and month: token and GPU capacity costs side by side, the "
             "billed one by the tenant's basis, the fleet's idle capacity (platform admins) and "
             "the FOCUS 1.0 export, paged."
         )},
        {"name": "requests",
         "description": (
             "The request log: each request's route, stages, tokens, guardrail findings and "
             "error, filterable (a tenant's users see their own)."
         )},
    ],
    # One name per choice set where several models' fields share a name ("state", "kind").
    "ENUM_NAME_OVERRIDES": {
        "InstanceStateEnum": "serving_app.models.instances.Instance.State",
        "ArtifactSourceEnum": "serving_app.models.artifacts.ArtifactVersion.Source",
        "ImportStateEnum": "serving_app.models.artifacts.ArtifactImport.State",
        "CacheEntryStateEnum": "serving_app.models.artifacts.NodeCacheEntry.State",
        "ImportRequestSourceEnum": [("s3", "S3 bucket"), ("huggingface", "Hugging Face "
                                    "repository"), ("node_folder", "Folder on a node")],
        "AlertStateEnum": "alerts_app.models.Alert.State",
        "NotificationStateEnum": "alerts_app.models.Notification.State",
        "ChannelKindEnum": "alerts_app.models.Channel.Kind",
        "NotificationKindEnum": "alerts_app.models.Notification.Kind",
        "TransitionKindEnum": "alerts_app.models.AlertTransition.Kind",
        "SeverityEnum": "alerts_app.models.Severity",
        "RolloutStateEnum": "serving_app.models.revisions.Rollout.State",
        "BackupStateEnum": "backups_app.models.Backup.State",
    },
}

# Celery: JSON only, explicit queues, bounded tasks (cookiecutter-django style).
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", REDIS_URL)
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 600, minimum=1)
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 540, minimum=1)
# Acknowledged when a worker starts the task, not when it ends: a worker whose broker connection
# drops while it holds an unacknowledged message dies (kombu restores the message on a connection
# already torn down: "Unrecoverable error: AttributeError ... 'hostname'"), and a dead node agent
# supervises nothing. Nothing needs the late ack: every task's work is derived again from the
# database (the reconciler re-sends a start of an instance still pending, a restarted agent adopts
# or stops what it finds, reconciles and adapter syncs run every round).
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
RECONCILE_INTERVAL_SECONDS = env_float("RECONCILE_INTERVAL_SECONDS", 5.0, minimum=0.5)

# Engines and nodes.
ENGINE_VENV = env_str("ENGINE_VENV", str(BASE_DIR / "var" / "engine-venv"))
# The default range is also what deploy/'s network policies open to the gateway and agents.
ENGINE_PORT_DEFAULT_RANGE = (18200, 18999)
ENGINE_PORT_RANGE = (
    env_int("ENGINE_PORT_MIN", ENGINE_PORT_DEFAULT_RANGE[0], minimum=1024),
    env_int("ENGINE_PORT_MAX", ENGINE_PORT_DEFAULT_RANGE[1], minimum=1024),
)
# The rendezvous ports the console gives multi-node instances (vLLM's --master-port on the
# leader's node, where the headless workers of other nodes connect).
ENGINE_RENDEZVOUS_PORT_RANGE = (
    env_int("ENGINE_RENDEZVOUS_PORT_MIN", 29500, minimum=1024),
    env_int("ENGINE_RENDEZVOUS_PORT_MAX", 29999, minimum=1024),
)
# Engines answer only callers with a certificate of the console's CA (serving_app/pki.py,
# docs/security.md): off only for a plain-HTTP development setup.
ENGINE_TLS = env_bool("ENGINE_TLS", True)
# The CA's certificate, this host's engine certificate and key, and on the console's hosts the
# CA's key and the console's client certificate (made on first use; keys 0600).
ENGINE_TLS_DIR = Path(env_str("ENGINE_TLS_DIR", str(VAR_DIR / "engine-tls")))
# Where the CA's certificate and key are, if not there: a folder every console process mounts
# (Kubernetes: the Secret that `manage.py engine_ca` fills). Empty: ENGINE_TLS_DIR.
ENGINE_CA_DIR = env_str("ENGINE_CA_DIR", "")
ENGINE_LOG_DIR = Path(env_str("ENGINE_LOG_DIR", str(VAR_DIR / "engine-logs")))
# A start fails when its log has been silent this long (a CUDA engine logs its compile, CUDA
# graph and KV cache steps as it goes; kernel JIT was seen silent for about 70 s on an H200)...
ENGINE_START_TIMEOUT_SECONDS = env_float("ENGINE_START_TIMEOUT_SECONDS", 180.0, minimum=1.0)
# ...or when it has lasted this long in all, progress or not.
ENGINE_START_MAX_SECONDS = env_float("ENGINE_START_MAX_SECONDS", 1800.0, minimum=1.0)
MPS_PIPE_DIRECTORY = Path(env_str("MPS_PIPE_DIRECTORY", str(VAR_DIR / "mps" / "pipe")))
MPS_LOG_DIRECTORY = Path(env_str("MPS_LOG_DIRECTORY", str(VAR_DIR / "mps" / "log")))  # mps.py
ENGINE_STOP_GRACE_SECONDS = env_float("ENGINE_STOP_GRACE_SECONDS", 15.0, minimum=0.0)
ENGINE_CPU_KVCACHE_GIB = env_int("ENGINE_CPU_KVCACHE_GIB", 1, minimum=1)
# More variables an engine inherits from its agent (names, "X*" prefixes; engine/supervisor.py).
ENGINE_ENV_ALLOW = env_list("ENGINE_ENV_ALLOW", [])
# CPU engines run under SCHED_IDLE by default (see serving_app/engine/launch.py for why).
ENGINE_CPU_SCHEDULING = env_choice("ENGINE_CPU_SCHEDULING", "idle", ("idle", "normal"))
# A one-rank CPU engine's worker: "process" (vLLM's) or "engine-core" (launch.cpu_environment).
ENGINE_CPU_WORKER = env_choice("ENGINE_CPU_WORKER", "process", ("process", "engine-core"))
ENGINE_SUPERVISE_SECONDS = env_float("ENGINE_SUPERVISE_SECONDS", 2.0, minimum=0.1)
ENGINE_HEALTH_FAILURES = env_int("ENGINE_HEALTH_FAILURES", 3, minimum=1)
# Canary generations (serving_app/engine/canary.py): how long one may take, and the backoff of
# a failed one's retries (doubling from the first to the most).
ENGINE_CANARY_TIMEOUT_SECONDS = env_float("ENGINE_CANARY_TIMEOUT_SECONDS", 30.0, minimum=1.0)
ENGINE_CANARY_RETRY_SECONDS = env_float("ENGINE_CANARY_RETRY_SECONDS", 2.0, minimum=0.1)
ENGINE_CANARY_RETRY_MAX_SECONDS = env_float("ENGINE_CANARY_RETRY_MAX_SECONDS", 120.0,
                                            minimum=0.1)
# One concurrency level of a capacity test (serving_app/engine/capacity.py): past this its load
# is stopped and the test fails, so that a stuck engine never holds a node agent's thread.
CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS = env_float("CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS", 900.0,
                                                minimum=1.0)
RESTART_BACKOFF_SECONDS = env_float("RESTART_BACKOFF_SECONDS", 2.0, minimum=0.0)
RESTART_BACKOFF_MAX_SECONDS = env_float("RESTART_BACKOFF_MAX_SECONDS", 300.0, minimum=0.0)
CRASH_LOOP_RESTARTS = env_int("CRASH_LOOP_RESTARTS", 5, minimum=1)
CRASH_LOOP_WINDOW_SECONDS = env_float("CRASH_LOOP_WINDOW_SECONDS", 600.0, minimum=1.0)
NODE_HEARTBEAT_SECONDS = env_float("NODE_HEARTBEAT_SECONDS", 5.0, minimum=0.1)
# Engine metrics: node agents scrape each ready engine's /metrics at this pace, and read their
# GPUs through NVML at the same pace unless NODE_INVENTORY_SECONDS says otherwise
# (serving_app/engine/scrape.py; samples are kept, then rolled up per hour:
# serving_app/models/engine_metrics.py).
ENGINE_METRICS_INTERVAL_SECONDS = env_float("ENGINE_METRICS_INTERVAL_SECONDS", 10.0, minimum=1.0)
ENGINE_SAMPLE_RETENTION_HOURS = env_float("ENGINE_SAMPLE_RETENTION_HOURS", 24.0, minimum=0.1)
ENGINE_ROLLUP_RETENTION_DAYS = env_float("ENGINE_ROLLUP_RETENTION_DAYS", 31.0, minimum=1.0)
NODE_INVENTORY_SECONDS = env_float(
    "NODE_INVENTORY_SECONDS", ENGINE_METRICS_INTERVAL_SECONDS, minimum=1.0
)
# Joining a host from the Nodes page (docs/install.md, "Joining a GPU host"): how long a join
# token is open, and the database and Redis URLs handed to a joining node (default: the
# console's own DATABASE_URL and REDIS_URL, which must then be reachable from the node).
NODE_JOIN_TOKEN_TTL_MINUTES = env_int("NODE_JOIN_TOKEN_TTL_MINUTES", 60, minimum=1)
NODE_JOIN_DATABASE_URL = env_str("NODE_JOIN_DATABASE_URL", env_str("DATABASE_URL", ""))
NODE_JOIN_REDIS_URL = env_str("NODE_JOIN_REDIS_URL", REDIS_URL)
# What a joining node's URLs carry: a database role, a Redis user and a token of its own, made
# by the exchange and dropped with the node ("per-node"; the console's database user needs
# CREATEROLE and its Redis user the ACL command), or the URLs above as they are ("shared").
NODE_CREDENTIALS = env_choice("NODE_CREDENTIALS", "per-node", ("per-node", "shared"))
# Node agents with remote control off accept no broadcast from the broker (a node's Redis user
# may not use the broadcast channel); the join hands nodes "false".
CELERY_WORKER_ENABLE_REMOTE_CONTROL = env_bool("CELERY_WORKER_ENABLE_REMOTE_CONTROL", True)
# How long an instance being stopped keeps running for the requests in flight on it, after it
# left routing (serving_app/deployments/draining.py); then it is stopped whatever still runs.
DRAIN_TIMEOUT_SECONDS = env_float("DRAIN_TIMEOUT_SECONDS", 120.0, minimum=0.0)
PLACEMENT_HEADROOM = env_float("PLACEMENT_HEADROOM", 0.10, minimum=0.0)
PLACEMENT_POLICY = env_choice("PLACEMENT_POLICY", "binpack", ("binpack", "spread"))
GPU_SAMPLE_RETENTION_HOURS = env_float("GPU_SAMPLE_RETENTION_HOURS", 24.0, minimum=0.1)
# How long the ten-second usage rollups are kept (alert windows read them; charts do not).
USAGE_TEN_SECOND_RETENTION_HOURS = env_float(
    "USAGE_TEN_SECOND_RETENTION_HOURS", 24.0, minimum=0.1
)
# A latency row whose share of failed requests is above this is never "met", however fast its
# successes were (the latency dashboard's objective column).
OBJECTIVE_MAX_ERROR_RATE = env_float("OBJECTIVE_MAX_ERROR_RATE", 0.05, minimum=0.0)

# Where model and adapter files may live (serving_app/storage.py). Tenants never name a host
# path: their uploads go to their own area under TENANT_STORAGE_ROOT (`tenant-<id>/`); platform
# admins register base models and adapters from folders under MODEL_ROOTS. Models and adapters
# registered from these folders (legacy) need the same paths on every node host; those from
# artifact versions (below) reach every node through its own cache.
TENANT_STORAGE_ROOT = Path(env_str("TENANT_STORAGE_ROOT", str(VAR_DIR / "tenant-storage")))
MODEL_ROOTS = [Path(p) for p in env_list("MODEL_ROOTS", [str(BASE_DIR / "var" / "models")])]
# What each tenant's adapters may take on disk, in MiB (a tenant's own setting overrides it).
TENANT_STORAGE_QUOTA_MB = env_int("TENANT_STORAGE_QUOTA_MB", 1024, minimum=0)
# The largest adapter archive accepted, and the most its files may unpack to, in MiB. A LoRA
# adapter of a 7-8B model at rank 64 is about 160 MiB; a zip that unpacks to more than this is
# refused before anything is written.
ADAPTER_UPLOAD_MAX_BYTES = env_int("ADAPTER_UPLOAD_MAX_MB", 256, minimum=1) * 1024 * 1024
ADAPTER_UPLOAD_MAX_UNPACKED_BYTES = (
    env_int("ADAPTER_UPLOAD_MAX_UNPACKED_MB", 512, minimum=1) * 1024 * 1024
)

# Content-addressed artifacts (docs/artifacts.md): the console keeps every model and adapter file
# once by its SHA-256 under ARTIFACT_STORE_ROOT; each node agent fetches what its instances need
# from the console (NODE_CONSOLE_URL) into its own cache (NODE_CACHE_DIR, at most
# NODE_CACHE_QUOTA_MB), no shared filesystem needed. A chunk of an upload is at most
# ARTIFACT_UPLOAD_CHUNK_MB; a file of it at most ARTIFACT_UPLOAD_MAX_FILE_MB.
ARTIFACT_STORE_ROOT = Path(env_str("ARTIFACT_STORE_ROOT", str(VAR_DIR / "artifacts")))
ARTIFACT_UPLOAD_CHUNK_BYTES = env_int("ARTIFACT_UPLOAD_CHUNK_MB", 64, minimum=1) * 1024 * 1024
ARTIFACT_UPLOAD_MAX_FILE_BYTES = (
    env_int("ARTIFACT_UPLOAD_MAX_FILE_MB", 200 * 1024, minimum=1) * 1024 * 1024
)
NODE_CONSOLE_URL = env_str("NODE_CONSOLE_URL", "http://127.0.0.1:8000")
# The console's address as other hosts reach it (e.g. https://console.example.com): what the
# "Add a node" page and the join-token API put in the join command. Unset: the address the
# admin's request came to (or NODE_CONSOLE_URL when that is a loopback one and this is not).
CONSOLE_EXTERNAL_URL = env_str("CONSOLE_EXTERNAL_URL", "")
NODE_CACHE_DIR = Path(env_str("NODE_CACHE_DIR", str(VAR_DIR / "node-cache")))
NODE_CACHE_QUOTA_BYTES = env_int("NODE_CACHE_QUOTA_MB", 100 * 1024, minimum=1) * 1024 * 1024

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # Health checks poll engines several times a second: one INFO line each is noise.
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"},
                # Presidio logs each recognizer it loads, in every process that imports it.
                "presidio-analyzer": {"level": "WARNING"}},
}

# --- Security ---
# Production hardening, each from the environment (the README's "Running in production" lists the
# values `manage.py check --deploy` is clean with). Kept in one block: cookies and TLS, the content
# security policy, login throttling, password rules and the API's tokens.
from datetime import timedelta  # noqa: E402

from csp.constants import NONE, SELF, UNSAFE_INLINE  # noqa: E402

# Cookies only over HTTPS unless debugging (a development server on http:// could not sign in).
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
# Messages go in the session, never in a cookie of their own (signed is not encrypted).
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"
# HSTS is sticky in browsers for its whole duration, so it is off until asked for.
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# Behind a TLS-terminating proxy: the header (as in request.META, e.g. HTTP_X_FORWARDED_PROTO)
# that the proxy sets to "https". Only set it when the proxy overwrites that header: a client
# could otherwise claim HTTPS.
_proxy_ssl_header = env_str("SECURE_PROXY_SSL_HEADER", "")
SECURE_PROXY_SSL_HEADER = (_proxy_ssl_header, "https") if _proxy_ssl_header else None
USE_X_FORWARDED_HOST = env_bool("USE_X_FORWARDED_HOST", False)

# Content security policy (django-csp): scripts only from our own static files, no inline
# scripts or event handlers. Inline styles stay allowed: plotly.js, htmx and Swagger UI set style
# attributes at run time. CSP_REPORT_URI receives violation reports; CSP_REPORT_ONLY=true sends
# the policy as Content-Security-Policy-Report-Only (to try a change without breaking pages).
_csp_directives: dict = {
    "default-src": [SELF],
    "script-src": [SELF],
    "style-src": [SELF, UNSAFE_INLINE],
    "img-src": [SELF, "data:"],
    "font-src": [SELF, "data:"],
    "connect-src": [SELF],
    "object-src": [NONE],
    "base-uri": [SELF],
    "form-action": [SELF],
    "frame-ancestors": [NONE],
}
_csp_report_uri = env_str("CSP_REPORT_URI", "")
if _csp_report_uri:
    _csp_directives["report-uri"] = _csp_report_uri
if env_bool("CSP_REPORT_ONLY", False):
    CONTENT_SECURITY_POLICY_REPORT_ONLY = {"DIRECTIVES": _csp_directives}
else:
    CONTENT_SECURITY_POLICY = {"DIRECTIVES": _csp_directives}
INSTALLED_APPS += ["csp", "axes"]
MIDDLEWARE += [
    "csp.middleware.CSPMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into its lockout response.
    "axes.middleware.AxesMiddleware",
]

# Login throttling (django-axes) for /login/, /admin/login/ and the API token endpoint: after
# LOGIN_FAILURE_LIMIT failed attempts for one username from one IP address, that pair is refused
# (429) for LOGIN_COOLOFF_MINUTES, whatever the password. A successful login resets the count.
# The address is REMOTE_ADDR: behind a proxy, uvicorn's --proxy-headers with the proxy in
# --forwarded-allow-ips makes it the client's (from X-Forwarded-For); otherwise it is the proxy's
# and the lockout holds per username.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("LOGIN_COOLOFF_MINUTES", 15.0, minimum=0.1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "console.lockout.lockout_response"  # 429 + Retry-After; JSON for the API
AXES_VERBOSE = False  # no banner on every manage.py command

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# JSON only: DRF's browsable API pages run an inline event handler that the policy above
# blocks. Swagger UI at /api/docs/ is the API's page for a browser.
REST_FRAMEWORK["DEFAULT_RENDERER_CLASSES"] = ["rest_framework.renderers.JSONRenderer"]

# API tokens (django-rest-knox): stored as a hash, sent once, expiring after API_TOKEN_TTL_HOURS.
REST_KNOX = {
    "TOKEN_TTL": timedelta(hours=env_float("API_TOKEN_TTL_HOURS", 10.0, minimum=0.01)),
    "AUTH_HEADER_PREFIX": "Token",
    "USER_SERIALIZER": None,
    "AUTO_REFRESH": False,
}

# --- Gateway ---
# The OpenAI-compatible endpoint under /v1/ (gateway_app), its settings in one dict; each is read
# from the environment variable named GATEWAY_<key>. docs/gateway.md explains each.

GATEWAY: dict[str, Any] = {
    # Redis holding the gateway's limits, leases, usage stream and cache invalidation channel.
    "REDIS_URL": env_str("GATEWAY_REDIS_URL", REDIS_URL),
    # When Redis cannot be reached: "closed" answers 503 (limits and budgets cannot be enforced);
    # "open" serves requests without limits and keeps their usage events in memory until it
    # returns.
    "REDIS_FAILURE_POLICY": env_choice(
        "GATEWAY_REDIS_FAILURE_POLICY", "closed", ("closed", "open")
    ),
    # How long a request-path Redis call may take before Redis counts as unreachable.
    "REDIS_TIMEOUT_SECONDS": env_float("GATEWAY_REDIS_TIMEOUT_SECONDS", 1.0, minimum=0.01),
    # Largest request body accepted (bytes); larger ones get 413 without reaching an engine.
    "MAX_BODY_BYTES": env_int("GATEWAY_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1024),
    # Guardrail detection on a large request runs in this many threads per worker (off the event
    # loop), and fails the request (or lets it through unchecked under a policy whose classifier
    # fails open) when it takes longer than the timeout.
    "GUARD_PROCESSES": env_int("GATEWAY_GUARD_PROCESSES", 2, minimum=1),
    "GUARD_TIMEOUT_SECONDS": env_float("GATEWAY_GUARD_TIMEOUT_SECONDS", 2.0, minimum=0.01),
    # How long a worker trusts a cached key before re-reading it in the background. Revocations
    # and tenant changes arrive sooner, through Redis pub/sub; this bounds a missed message.
    "KEY_CACHE_SECONDS": env_float("GATEWAY_KEY_CACHE_SECONDS", 60.0, minimum=0.0),
    # How long an unknown or unusable key is remembered (spares the database from bad-key floods).
    "NEGATIVE_KEY_CACHE_SECONDS": env_float(
        "GATEWAY_NEGATIVE_KEY_CACHE_SECONDS", 5.0, minimum=0.0
    ),
    # How often each worker re-reads tenants, deployments, adapters and ready instances.
    "CATALOG_REFRESH_SECONDS": env_float("GATEWAY_CATALOG_REFRESH_SECONDS", 2.0, minimum=0.1),
    # Upstream (engine) timeouts: connecting, and the whole request including a stream.
    "UPSTREAM_CONNECT_TIMEOUT_SECONDS": env_float(
        "GATEWAY_UPSTREAM_CONNECT_TIMEOUT_SECONDS", 5.0, minimum=0.1
    ),
    "UPSTREAM_TIMEOUT_SECONDS": env_float(
        "GATEWAY_UPSTREAM_TIMEOUT_SECONDS", 600.0, minimum=1.0
    ),
    # Other instances tried after a connection failure or a 503 before the first byte.
    "UPSTREAM_RETRIES": env_int("GATEWAY_UPSTREAM_RETRIES", 2, minimum=0),
    # Usage events: the Redis stream, its consumer group, and the writer's batch size.
    "USAGE_STREAM": env_str("GATEWAY_USAGE_STREAM", "gw:usage"),
    "USAGE_GROUP": env_str("GATEWAY_USAGE_GROUP", "usage-writer"),
    "USAGE_BATCH_SIZE": env_int("GATEWAY_USAGE_BATCH_SIZE", 500, minimum=1),
    # Events a worker keeps in memory while Redis is unreachable (the oldest are dropped beyond
    # it).
    "EVENT_BUFFER_MAX": env_int("GATEWAY_EVENT_BUFFER_MAX", 100_000, minimum=100),
    # Flow control (docs/gateway.md, "Flow control"): each instance is sent at most its dispatch
    # budget of requests at a time (a deployment's `dispatch_budget`, else its max_num_seqs plus
    # this allowance); the rest wait in the gateway, by priority band, then by fair share.
    # Off: first come, first served everywhere (a deployment can also turn it off alone).
    "FLOW_CONTROL": env_bool("GATEWAY_FLOW_CONTROL", True),
    "FLOW_QUEUE_ALLOWANCE": env_int("GATEWAY_FLOW_QUEUE_ALLOWANCE", 2, minimum=0),
    # A request waiting longer than this gets 503 with retry-after.
    "FLOW_QUEUE_TIMEOUT_SECONDS": env_float(
        "GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS", 30.0, minimum=0.1
    ),
    # "weighted": bands share dispatches by FLOW_BAND_WEIGHTS, so a low band still progresses;
    # "strict": a band is served only while no higher band waits.
    "FLOW_BANDS": env_choice("GATEWAY_FLOW_BANDS", "weighted", ("weighted", "strict")),
    # Weights of the bands critical, high, normal, low (the tenants' priority tiers).
    "FLOW_BAND_WEIGHTS": env_list("GATEWAY_FLOW_BAND_WEIGHTS", ["8", "4", "2", "1"]),
    # Slots beyond each instance's dispatch budget that only the critical and high bands may
    # use: a request of an upper band finds a slot at once rather than waiting behind a flood of
    # a lower one (the engine orders it first by its priority). 0: the budget holds for all.
    "FLOW_RESERVED_SLOTS": env_int("GATEWAY_FLOW_RESERVED_SLOTS", 2, minimum=0),
    "FLOW_SETTLED_HOLD_MS": env_int("GATEWAY_FLOW_SETTLED_HOLD_MS", 50, minimum=0),
    # Fair share counts weighted tokens: prompt tokens times the first, completion tokens times
    # the second (a generated token costs the engine more than a prompt token).
    "FLOW_INPUT_TOKEN_WEIGHT": env_float("GATEWAY_FLOW_INPUT_TOKEN_WEIGHT", 1.0, minimum=0.0),
    "FLOW_OUTPUT_TOKEN_WEIGHT": env_float("GATEWAY_FLOW_OUTPUT_TOKEN_WEIGHT", 2.0, minimum=0.0),
    # How long a request for a deployment scaled to zero waits for its first instance to be
    # ready (an engine takes one to two minutes to start here) before a 503 with retry-after.
    "WAKE_TIMEOUT_SECONDS": env_float("GATEWAY_WAKE_TIMEOUT_SECONDS", 180.0, minimum=1.0),
}
try:
    GATEWAY["FLOW_BAND_WEIGHTS"] = [float(w) for w in GATEWAY["FLOW_BAND_WEIGHTS"]]
    if len(GATEWAY["FLOW_BAND_WEIGHTS"]) != 4 or min(GATEWAY["FLOW_BAND_WEIGHTS"]) <= 0:
        raise ValueError
except ValueError:
    raise ImproperlyConfigured(
        "GATEWAY_FLOW_BAND_WEIGHTS must be four positive numbers, e.g. 8,4,2,1"
    ) from None

# --- Alerts and notifications (alerts_app) ---
# How often beat runs an evaluation round on the control worker.
ALERTS_EVALUATION_SECONDS = env_float("ALERTS_EVALUATION_SECONDS", 10.0, minimum=0.5)
# Webhook deliveries: the request's time limit, and the retries of a failed one (exponential
# backoff from the first delay, capped; then the notification is marked failed).
ALERTS_WEBHOOK_TIMEOUT_SECONDS = env_float("ALERTS_WEBHOOK_TIMEOUT_SECONDS", 10.0, minimum=0.1)
ALERTS_MAX_ATTEMPTS = env_int("ALERTS_MAX_ATTEMPTS", 6, minimum=1)
ALERTS_RETRY_BACKOFF_SECONDS = env_float("ALERTS_RETRY_BACKOFF_SECONDS", 5.0, minimum=0.0)
ALERTS_RETRY_BACKOFF_MAX_SECONDS = env_float(
    "ALERTS_RETRY_BACKOFF_MAX_SECONDS", 600.0, minimum=0.0
)
# Email channels go through Django's email backend (SMTP unless EMAIL_BACKEND says otherwise;
# `django.core.mail.backends.filebased.EmailBackend` with EMAIL_FILE_PATH writes files).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "alerts@localhost")
# `/metrics` (Prometheus) answers only requests with `Authorization: Bearer <this>`; empty: the
# endpoint is off (404).
METRICS_SCRAPE_TOKEN = env_str("METRICS_SCRAPE_TOKEN", "")

# --- Backups of the console's database (backups_app; docs/operations.md, "Backups") ---
# Beat runs a dump every this many minutes on the control worker; 0 turns the schedule off
# (`manage.py backup_database` still runs one).
BACKUP_INTERVAL_MINUTES = env_int("BACKUP_INTERVAL_MINUTES", 15, minimum=0)
# How many successful dumps to keep (the newest); older files are deleted after each new one.
# The default keeps a day at the default interval.
BACKUP_RETENTION = env_int("BACKUP_RETENTION", 96, minimum=1)
# Where the dumps go (each `console-<time>.dump` with its `.sha256` beside it). Copy them off
# the host: a dump on the database's own disk does not survive losing that disk.
BACKUP_DIR = Path(env_str("BACKUP_DIR", str(VAR_DIR / "backups")))
# A dump that takes longer than this is stopped and recorded as failed.
BACKUP_TIMEOUT_SECONDS = env_int("BACKUP_TIMEOUT_SECONDS", 480, minimum=1)
if BACKUP_TIMEOUT_SECONDS >= CELERY_TASK_SOFT_TIME_LIMIT:
    raise ImproperlyConfigured(
        f"BACKUP_TIMEOUT_SECONDS ({BACKUP_TIMEOUT_SECONDS}) must be below "
        f"CELERY_TASK_SOFT_TIME_LIMIT ({CELERY_TASK_SOFT_TIME_LIMIT}): the task would be "
        "stopped before the dump's own time limit")

# --- Health (/healthz, /readyz, /api/v1/health/, the console's "degraded" banner) ---
# The usage writer counts as unhealthy once the oldest event not yet stored is older than this.
HEALTH_WRITER_MAX_LAG_SECONDS = env_float("HEALTH_WRITER_MAX_LAG_SECONDS", 60.0, minimum=1.0)
# A health check waits at most this long for PostgreSQL or Redis.
HEALTH_CHECK_TIMEOUT_SECONDS = env_float("HEALTH_CHECK_TIMEOUT_SECONDS", 1.0, minimum=0.05)
