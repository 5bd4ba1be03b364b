"""Settings for the vLLM Control Panel: every value comes from the environment.

Defaults run everything embedded (SQLite, an in-memory channel layer, a filesystem Celery
broker); `DATABASE_URL` and `REDIS_URL` switch a deployment to PostgreSQL and Redis.
"""

from __future__ import annotations

import secrets
from importlib.util import find_spec
from pathlib import Path

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from controlpanel.envconf import (
    env_bool,
    env_float,
    env_int,
    env_session_sources,
    env_str,
    env_token,
    env_url,
    periodic_schedule,
)

# Lets admin classes be written ModelAdmin[Worker] at run time, as the type checker wants.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("CONTROLPANEL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    """An explicit key wins; otherwise one is made once and kept under var/ so logins survive
    restarts without anyone having to invent a key for a first run."""
    explicit = env_str("DJANGO_SECRET_KEY")
    if explicit:
        return explicit
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
# Earlier secrets, comma-separated, while a rotation settles: old sessions and sealed worker
# keys (controlpanel.registry.sealed) still open under them.
SECRET_KEY_FALLBACKS = [k for k in env_str("DJANGO_SECRET_KEY_FALLBACKS").split(",") if k]
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h.strip() for h in env_str("CONTROLPANEL_ALLOWED_HOSTS", "*").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env_str("CONTROLPANEL_CSRF_ORIGINS").split(",") if o]
# Cookies: never readable by page scripts (the session) and never sent by other sites'
# forms; over HTTPS only when the dashboard is served over HTTPS (CONTROLPANEL_HTTPS=1,
# also when TLS ends at a proxy in front). The CSRF cookie stays readable: live.js puts
# it into forms that were rendered before a login rotated it.
CONTROLPANEL_HTTPS = env_bool("CONTROLPANEL_HTTPS", False)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_SECURE = CONTROLPANEL_HTTPS
CSRF_COOKIE_SECURE = CONTROLPANEL_HTTPS
SESSION_COOKIE_AGE = env_int("CONTROLPANEL_SESSION_HOURS", 12, minimum=1) * 3600

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    # Not "ninja": as an app Django would import it at setup, and with it pydantic and
    # django.test (~8 MiB in every process, the router's too). Its Swagger UI assets and
    # templates are found through NINJA_DIR below instead, so /api/docs still works offline.
    # Bottom to top: each app imports only those above it in this list (import-linter).
    "controlpanel.registry",
    "controlpanel.fleet",
    "controlpanel.keys",
    "controlpanel.rollouts",
    "controlpanel.routers",
    "controlpanel.console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# django-ninja's folder, found without importing it (find_spec does not run a package).
_ninja_spec = find_spec("ninja")
if _ninja_spec is None or not _ninja_spec.submodule_search_locations:
    raise ImproperlyConfigured("django-ninja is not installed")
NINJA_DIR = Path(next(iter(_ninja_spec.submodule_search_locations)))

ROOT_URLCONF = "controlpanel.urls"
ASGI_APPLICATION = "controlpanel.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates", NINJA_DIR / "templates"],
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

DATABASE_URL = env_url(
    "DATABASE_URL",
    f"sqlite:///{VAR_DIR / 'controlpanel.sqlite3'}",
    schemes=("sqlite", "postgres", "postgresql", "pgsql"),
)
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The router, the API and Celery write from several processes; WAL and a busy timeout
    # keep SQLite from answering "database is locked" under that mix.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
else:
    # Under ASGI every request's sync code may run on a thread of its own, and a persistent
    # connection per thread outlives the thread: a busy router process ran PostgreSQL out of
    # connections ("too many clients"). Django's pool (psycopg_pool) hands one back at the
    # end of each request instead; Django requires CONN_MAX_AGE 0 with it.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # The pool checks a connection before handing it out: after PostgreSQL restarts, each
    # connection it held would otherwise fail one request (a 503) before being replaced.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env_int("CONTROLPANEL_DB_POOL_SIZE", 10, minimum=2),
        # How long a request waits for a connection: with PostgreSQL down, every admin call
        # and page answers 503 within about this, rather than hang.
        "timeout": env_float("CONTROLPANEL_DB_POOL_TIMEOUT", 1.0, minimum=0.1),
    }
    # An unreachable host (no refusal, just silence) must not hold the pool's reconnects.
    DATABASES["default"]["OPTIONS"]["connect_timeout"] = 2
DATABASES["default"]["TEST"] = {"NAME": env_str("CONTROLPANEL_TEST_DB_NAME") or None}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_url("REDIS_URL", "", schemes=("redis", "rediss", "unix"))

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
    }
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    # kombu's filesystem transport needs no server: the embedded default for a first run.
    _broker_dir = VAR_DIR / "celery-broker"
    for _sub in ("queue", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    # controlpanel.broker's transport; controlpanel.celery registers it (with kombu, which
    # only a process that uses Celery should load).
    CELERY_BROKER_URL = "cpfs://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        # Exchange state; without it kombu writes a `control/` folder wherever it runs.
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/admin/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static", NINJA_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)
# Serve straight from the app and project folders, so a first run needs no collectstatic.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# Long prompts and images are legitimate API payloads; Django's 2.5 MB default is not.
MAX_BODY_BYTES = env_int("CONTROLPANEL_MAX_BODY_BYTES", 32 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_BODY_BYTES

# --- The control plane ---------------------------------------------------------------
CONTROLPANEL_ADMIN_TOKEN = env_token("CONTROLPANEL_ADMIN_TOKEN")
CONTROLPANEL_WORKER_TOKEN = env_token("CONTROLPANEL_WORKER_TOKEN")
CONTROLPANEL_HEARTBEAT_EXPIRY = env_int("CONTROLPANEL_HEARTBEAT_EXPIRY", 90, minimum=1)
# Agents beat three times per expiry window, so one lost beat never expires a worker.
CONTROLPANEL_HEARTBEAT_INTERVAL = max(1, CONTROLPANEL_HEARTBEAT_EXPIRY // 3)
CONTROLPANEL_DISCOVERY_TIMEOUT = env_float("CONTROLPANEL_DISCOVERY_TIMEOUT", 5.0, minimum=0.1)
# Client API keys on the router (routing.admission.auth): off by default, so a first run just works.
CONTROLPANEL_REQUIRE_API_KEY = env_bool("CONTROLPANEL_REQUIRE_API_KEY", False)
# One JSON line per router request on the `routing.access` logger (routing.telemetry.access_log): on
# stderr, or appended to ACCESS_LOG_FILE (reopened when logrotate moves it); SAMPLE keeps
# that share of the successful requests' lines (every failure's line is kept).
# `serve --demo` writes it to var/access.log, so the console shows what happens.
CONTROLPANEL_ACCESS_LOG = env_bool("CONTROLPANEL_ACCESS_LOG", True)
CONTROLPANEL_ACCESS_LOG_FILE = env_str("CONTROLPANEL_ACCESS_LOG_FILE", "")
CONTROLPANEL_ACCESS_LOG_SAMPLE = env_float("CONTROLPANEL_ACCESS_LOG_SAMPLE", 1.0, minimum=0.0)
if CONTROLPANEL_ACCESS_LOG_SAMPLE > 1:
    raise ImproperlyConfigured("CONTROLPANEL_ACCESS_LOG_SAMPLE is a share, from 0 to 1")

# --- The router (data plane) ---------------------------------------------------------
ROUTER_CONNECT_TIMEOUT = env_float("CONTROLPANEL_UPSTREAM_CONNECT_TIMEOUT", 5.0, minimum=0.1)
# Waiting for a free pooled connection to a worker (all ..._PER_WORKER in use) + connecting.
ROUTER_POOL_TIMEOUT = env_float("CONTROLPANEL_UPSTREAM_POOL_TIMEOUT", 30.0, minimum=0.1)
# vLLM sends no byte of a non-streamed answer until it is complete, so the first-byte (and
# between-chunks) limit must cover a whole long generation; there is no overall limit.
ROUTER_READ_TIMEOUT = env_float("CONTROLPANEL_UPSTREAM_READ_TIMEOUT", 600.0, minimum=0.1)
ROUTER_MAX_CONNECTIONS = env_int("CONTROLPANEL_UPSTREAM_MAX_CONNECTIONS", 2048, minimum=1)
ROUTER_MAX_CONNECTIONS_PER_WORKER = env_int(
    "CONTROLPANEL_UPSTREAM_MAX_CONNECTIONS_PER_WORKER", 512, minimum=1
)
# Failures before the first byte (refused, reset, connect timeout, 429/502/503) are tried
# on another worker this many times, with a jittered backoff from this many seconds.
ROUTER_RETRIES = env_int("CONTROLPANEL_RETRIES", 2, minimum=0)
ROUTER_RETRY_BACKOFF = env_float("CONTROLPANEL_RETRY_BACKOFF", 0.025, minimum=0.0)
# Outlier ejection (routing.clients.ejection): consecutive failures on real traffic that take a
# worker out of a router's rotation (0: off), and the first cool-down, doubled on repeats.
ROUTER_EJECT_AFTER = env_int("CONTROLPANEL_EJECT_AFTER", 5, minimum=0)
ROUTER_EJECT_COOLDOWN = env_float("CONTROLPANEL_EJECT_COOLDOWN", 5.0, minimum=0.1)
# Admission control (routing.admission.admission), per router process: requests in flight per worker
# (0: no limit; per model: PATCH /api/models/{name} max_inflight), then a bounded FIFO wait.
ROUTER_MAX_INFLIGHT_PER_WORKER = env_int("CONTROLPANEL_MAX_INFLIGHT_PER_WORKER", 0, minimum=0)
ROUTER_QUEUE_TIMEOUT = env_float("CONTROLPANEL_QUEUE_TIMEOUT", 10.0, minimum=0.0)
ROUTER_QUEUE_MAX = env_int("CONTROLPANEL_QUEUE_MAX", 1000, minimum=0)
# Blocks of one worker's KV cache a router indexes from its events (routing.kv.kv_index); past
# it the oldest are dropped. vLLM holds tens of thousands per GPU.
ROUTER_KV_INDEX_MAX_BLOCKS = env_int("CONTROLPANEL_KV_INDEX_MAX_BLOCKS", 500_000, minimum=16)
# On SIGTERM the router stops accepting and gives open requests (streams) this long.
ROUTER_SHUTDOWN_GRACE = env_int("CONTROLPANEL_SHUTDOWN_GRACE", 30, minimum=0)
ROUTER_BODY_TIMEOUT = env_float("CONTROLPANEL_BODY_TIMEOUT", 30.0, minimum=0.1)
ROUTER_SNAPSHOT_POLL_SECONDS = env_float("CONTROLPANEL_SNAPSHOT_POLL", 0.25, minimum=0.01)
# While no request comes, a router polls this often instead (its first request wakes it).
ROUTER_SNAPSHOT_IDLE_POLL_SECONDS = env_float("CONTROLPANEL_SNAPSHOT_IDLE_POLL", 1.0, minimum=0.01)
# Where a request's session key is read, first found wins (routing.sessions): it keeps a
# session on its worker and alias target, and shares a key's fair-queue turns between its
# sessions. Default: X-Session-ID, x-claude-code-session-id (Claude Code),
# x-session-affinity (OpenCode), session-id and session_id (Codex), then body:user.
ROUTER_SESSION_SOURCES = env_session_sources("CONTROLPANEL_SESSION_HEADERS")

# One line format for every process `serve` runs (launcher.router gives uvicorn the same).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S %Z"
# Written in batches by a thread of their own, off the request path
# (routing.telemetry.access_writer).
_ACCESS_LOG_TO: dict[str, object] = (
    {
        "class": "routing.telemetry.access_writer.BatchedFileHandler",
        "filename": CONTROLPANEL_ACCESS_LOG_FILE,
    }
    if CONTROLPANEL_ACCESS_LOG_FILE
    else {"class": "routing.telemetry.access_writer.BatchedStreamHandler"}
)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": LOG_FORMAT, "datefmt": LOG_DATE_FORMAT},
        "message": {"format": "%(message)s"},  # the access log's lines are JSON already
    },
    "filters": {
        "access_sample": {
            "()": "routing.telemetry.access_log.SampleFilter",
            "share": CONTROLPANEL_ACCESS_LOG_SAMPLE,
        },
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
        "access": {**_ACCESS_LOG_TO, "formatter": "message", "filters": ["access_sample"]},
    },
    "root": {"handlers": ["console"], "level": env_str("CONTROLPANEL_LOG_LEVEL", "INFO")},
    "loggers": {
        "httpx": {"level": "WARNING"},
        "django.db.backends": {"level": "WARNING"},
        # Celery's own chatter (tasks received and done, beat's schedule) stays off the
        # console; `celery worker --loglevel` sets it (controlpanel.celery).
        "celery": {"level": "WARNING"},
        # The filesystem broker has no host, which kombu warns about on every start; its
        # other INFO lines (messages restored on a stop) are Celery's business too.
        "kombu": {"level": "WARNING"},
        "kombu.connection": {"level": "ERROR"},
        # One human line per operational event (registry.events), whatever the level.
        "controlpanel.events": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "routing.access": {
            "handlers": ["access"],
            "level": "INFO" if CONTROLPANEL_ACCESS_LOG else "WARNING",
            "propagate": False,
        },
    },
}

CONTROLPANEL_HOUSEKEEPING_SECONDS = env_float("CONTROLPANEL_HOUSEKEEPING_SECONDS", 5.0, minimum=0.5)

# --- Health probes (Celery) ----------------------------------------------------------------
CONTROLPANEL_PROBE_INTERVAL = env_float("CONTROLPANEL_PROBE_INTERVAL", 5.0, minimum=0.2)
# How long a worker's reported queue corrects the routers' load (routing.policies.load): two
# probe intervals and a second, so one late probe does not drop it.
ROUTER_LOAD_REPORT_MAX_AGE = env_float(
    "CONTROLPANEL_LOAD_REPORT_MAX_AGE", 2 * CONTROLPANEL_PROBE_INTERVAL + 1, minimum=0.0
)
# With REDIS_URL, push each router's in-flight changes to the others at once
# (routing.peers.load_push)
# rather than only every 50 ms: what keeps several routers from queueing at a full worker.
ROUTER_LOAD_PUSH = env_bool("CONTROLPANEL_LOAD_PUSH", True)
CONTROLPANEL_PROBE_TIMEOUT = env_float("CONTROLPANEL_PROBE_TIMEOUT", 3.0, minimum=0.1)
CONTROLPANEL_UNHEALTHY_AFTER = env_int("CONTROLPANEL_UNHEALTHY_AFTER", 3, minimum=1)
CONTROLPANEL_HEALTHY_AFTER = env_int("CONTROLPANEL_HEALTHY_AFTER", 2, minimum=1)
# Health from real traffic (controlpanel.fleet.traffic_health): a worker whose routers saw
# at least DEGRADED_ERROR_RATE of at least DEGRADED_MIN_REQUESTS requests fail (5xx, refused,
# reset) over the last DEGRADED_WINDOW seconds becomes `degraded`. DEGRADED_WEIGHT 0: it
# leaves the rotation; > 0: it stays with its weight times this (weighted policies).
CONTROLPANEL_DEGRADED_ERROR_RATE = env_float("CONTROLPANEL_DEGRADED_ERROR_RATE", 0.5, minimum=0.0)
CONTROLPANEL_DEGRADED_MIN_REQUESTS = env_int("CONTROLPANEL_DEGRADED_MIN_REQUESTS", 20, minimum=1)
CONTROLPANEL_DEGRADED_WINDOW = env_float("CONTROLPANEL_DEGRADED_WINDOW", 30.0, minimum=1.0)
CONTROLPANEL_DEGRADED_WEIGHT = env_float("CONTROLPANEL_DEGRADED_WEIGHT", 0.0, minimum=0.0)
# The dashboard's warnings (cells in colour, the problems banner): a worker's error rate over
# the degraded window, and its waiting requests (vLLM's queue), from these on.
CONTROLPANEL_WARN_ERROR_RATE = env_float("CONTROLPANEL_WARN_ERROR_RATE", 0.05, minimum=0.0)
CONTROLPANEL_WARN_WAITING = env_int("CONTROLPANEL_WARN_WAITING", 8, minimum=1)
CONTROLPANEL_MODELS_EVERY = env_int("CONTROLPANEL_MODELS_EVERY", 6, minimum=1)
CONTROLPANEL_HISTORY_MINUTES = env_int("CONTROLPANEL_HISTORY_MINUTES", 360, minimum=15)
# GPU warnings (controlpanel.fleet.gpu_health). vLLM reserves about 90% of GPU memory up front
# (--gpu-memory-utilization), so only a GPU that is nearly full is worth a warning.
CONTROLPANEL_GPU_TEMP_WARN_C = env_float("CONTROLPANEL_GPU_TEMP_WARN_C", 85.0, minimum=0)
CONTROLPANEL_GPU_MEMORY_WARN_PERCENT = env_float(
    "CONTROLPANEL_GPU_MEMORY_WARN_PERCENT", 98.0, minimum=0
)
# Rollout plans: how often gates are checked and steps moved; a failing gate rolls back
# within one such interval.
CONTROLPANEL_ROLLOUT_TICK_SECONDS = env_float("CONTROLPANEL_ROLLOUT_TICK_SECONDS", 5.0, minimum=0.2)
# Celery beat's work: task -> seconds. Tasks of one interval go out as one message and run
# in this order (controlpanel.celery.periodic), so an idle Celery wakes and dispatches once
# per interval rather than once per task. Rounds queued while no worker ran expire unrun.
CONTROLPANEL_PERIODIC_TASKS = {
    "controlpanel.expire_heartbeats": CONTROLPANEL_HOUSEKEEPING_SECONDS,
    "controlpanel.finish_drains": CONTROLPANEL_HOUSEKEEPING_SECONDS,
    "controlpanel.rollouts_tick": CONTROLPANEL_ROLLOUT_TICK_SECONDS,
    "controlpanel.probe_workers": CONTROLPANEL_PROBE_INTERVAL,
}
CELERY_BEAT_SCHEDULE = periodic_schedule(CONTROLPANEL_PERIODIC_TASKS)
