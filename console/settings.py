"""Settings for the console, read from the environment (see `console.env`).

With no variables set this is the embedded default: a SQLite file under `var/`, Redis on
localhost, DEBUG on. Production sets DATABASE_URL (PostgreSQL), SECRET_KEY, DEBUG=false and
ALLOWED_HOSTS.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from console.env import env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("CONSOLE_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DEBUG", True)
SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is false")
    SECRET_KEY = "insecure-development-key-do-not-use-in-production"
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
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular_sidecar",
    "drf_spectacular",
    "tenants_app",
    "serving_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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


def _database() -> dict:
    url = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'console.sqlite3'}")
    try:
        config = dj_database_url.parse(url, conn_max_age=env_int("DB_CONN_MAX_AGE", 0, minimum=0))
    except Exception as exc:  # dj_database_url raises several types for a malformed URL
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
    # Every API request is one transaction: a failed write leaves nothing half-written.
    config["ATOMIC_REQUESTS"] = True
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"

LOGIN_URL = "/admin/login/"

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.TokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "console.api.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "LLM Console management API",
    "DESCRIPTION": "Tenants, models, adapters, nodes and deployments of a vLLM console.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Served from our own static files: the console must work on an air-gapped host.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
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
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
RECONCILE_INTERVAL_SECONDS = env_float("RECONCILE_INTERVAL_SECONDS", 5.0, minimum=0.5)

# Engines and nodes.
ENGINE_VENV = env_str("ENGINE_VENV", str(BASE_DIR / "var" / "engine-venv"))
ENGINE_PORT_RANGE = (
    env_int("ENGINE_PORT_MIN", 18200, minimum=1024),
    env_int("ENGINE_PORT_MAX", 18999, minimum=1024),
)
ENGINE_LOG_DIR = Path(env_str("ENGINE_LOG_DIR", str(VAR_DIR / "engine-logs")))
ENGINE_START_TIMEOUT_SECONDS = env_float("ENGINE_START_TIMEOUT_SECONDS", 180.0, minimum=1.0)
ENGINE_STOP_GRACE_SECONDS = env_float("ENGINE_STOP_GRACE_SECONDS", 10.0, minimum=0.0)
ENGINE_CPU_KVCACHE_GIB = env_float("ENGINE_CPU_KVCACHE_GIB", 0.25, minimum=0.01)
NODE_HEARTBEAT_SECONDS = env_float("NODE_HEARTBEAT_SECONDS", 5.0, minimum=0.5)
NODE_LOST_AFTER_SECONDS = env_float("NODE_LOST_AFTER_SECONDS", 30.0, minimum=1.0)
PLACEMENT_HEADROOM = env_float("PLACEMENT_HEADROOM", 0.10, minimum=0.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
