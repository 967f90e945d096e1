"""Longhaul settings. Everything that differs between machines comes from the environment."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from csp import constants as csp
from django.core.exceptions import ImproperlyConfigured

from project import master_keys, pools, retention
from project.client_ip import trusted_networks
from project.env import database_from_url, envbool, envfloat, envint, envlist, envrate, envstr

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(envstr("LONGHAUL_VAR_DIR", str(BASE_DIR / "var")))

# Off unless asked for: a deployment that forgets the variable must not show tracebacks with its settings,
# send cookies without Secure, or serve the debug task kinds. `make run` and the test suite set DEBUG=1.
DEBUG = envbool("DEBUG", False)


def _secret_key() -> str:
    key = envstr("SECRET_KEY")
    if key:
        return key
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set; on a development machine set DEBUG=1 instead, "
                                   "which keeps a generated key in var/")
    # Development: one key generated on first start and kept, so sessions survive restarts.
    path = VAR_DIR / "secret_key"
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
# Content at rest (tasks/crypto.py): the master keys that wrap each tenant's data key, the first current.
LONGHAUL_MASTER_KEYS = master_keys.load(envstr(master_keys.VARIABLE), debug=DEBUG, var_dir=VAR_DIR)
# Off only to measure what encryption costs (bench/throughput.py); what was written sealed stays readable.
LONGHAUL_ENCRYPT_AT_REST = envbool("LONGHAUL_ENCRYPT_AT_REST", True)
# How long a process trusts a data key it unwrapped before reading it again (a destroyed key stops
# decrypting everywhere within this).
LONGHAUL_KEY_CACHE_SECONDS = envfloat("LONGHAUL_KEY_CACHE_SECONDS", 30.0, minimum=0.0)
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "channels",
    "django_q",
    "axes",
    "tasks",
    "chat",
    "webhooks",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # The browser's language (Accept-Language, or the switch's cookie) ...
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # ... unless the signed-in user chose one with the switch: then theirs, in every browser.
    "project.language.UserLanguageMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "tasks.tenancy.TenantMiddleware",
    # Last, as django-axes asks: it turns a locked-out sign-in into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "project.urls"
ASGI_APPLICATION = "project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.template.context_processors.i18n",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------
# Embedded default: a SQLite file under var/. Production: DATABASE_URL=postgres://...
DATABASE_URL = envstr("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'longhaul.sqlite3'}"
DATABASES = {"default": database_from_url("DATABASE_URL", DATABASE_URL)}
# Persistent connections: without them every job and every enqueue reconnects (FACTS.md).
DATABASES["default"]["CONN_MAX_AGE"] = envint("LONGHAUL_DB_CONN_MAX_AGE", 60, minimum=0)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("TEST", {})
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # A file, not :memory:, so the test database is shared with worker threads.
    DATABASES["default"]["TEST"]["NAME"] = str(VAR_DIR / "test.sqlite3")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Channels -------------------------------------------------------------------
REDIS_URL = envstr("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py's 5 s default read timeout equals channels_redis's blocking read and kills idle consumers.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 10}]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- WebSocket limits (project/socket_limits.py, tasks/consumers.py) --------------
# Live stream sockets one user, and one tenant, may hold at once; one more is closed with 4429 and told
# when to retry. A user has a few tabs, each with a thread stream and a task panel's stream or two: 20
# covers that and still stops a runaway script. 200 a tenant: ten such users at their limit together.
# Counted in Redis across every web process when REDIS_URL is set, else in the one process's memory.
LONGHAUL_WS_MAX_PER_USER = envint("LONGHAUL_WS_MAX_PER_USER", 20, minimum=1)
LONGHAUL_WS_MAX_PER_TENANT = envint("LONGHAUL_WS_MAX_PER_TENANT", 200, minimum=1)
# An open socket is authorized again this often (session or token, membership, the task or thread): the
# longest a signed-out user or a removed member goes on receiving a stream. Each check is three small queries.
LONGHAUL_WS_REAUTH_SECONDS = envint("LONGHAUL_WS_REAUTH_SECONDS", 30, minimum=1)

# --- Auth -----------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Sign-in backoff per username (project/sign_in_backoff.py, a django-axes handler): after
# LONGHAUL_LOGIN_MAX_FAILURES failed sign-ins for one username, from anywhere, each further password check
# waits 1 s after the last one, doubling up to LONGHAUL_LOGIN_MAX_DELAY_SECONDS. A try during the wait is
# refused (429) without checking the password or counting. An attacker can slow a username's sign-in but
# not lock it out; a fixed lock per (username, address) would add nothing the backoff does not already cap.
# The state lives in the database, shared by every web process.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a try during the wait before any password check
    "django.contrib.auth.backends.ModelBackend",
]
LONGHAUL_LOGIN_MAX_FAILURES = envint("LONGHAUL_LOGIN_MAX_FAILURES", 5, minimum=1)
# At most an hour: a longer wait is a lockout again.
LONGHAUL_LOGIN_MAX_DELAY_SECONDS = envint("LONGHAUL_LOGIN_MAX_DELAY_SECONDS", 300, minimum=1, maximum=3600)
# Proxies whose X-Forwarded-For is believed (IPs or CIDR networks); the client is the right-most untrusted
# hop (project/client_ip.py). Empty: REMOTE_ADDR is the client. Used in the sign-in log lines.
LONGHAUL_TRUSTED_PROXIES = trusted_networks("LONGHAUL_TRUSTED_PROXIES", envlist("LONGHAUL_TRUSTED_PROXIES", []))
AXES_ENABLED = envbool("LONGHAUL_LOGIN_LIMIT", True)
AXES_HANDLER = "project.sign_in_backoff.SignInBackoffHandler"
AXES_CLIENT_IP_CALLABLE = "project.client_ip.client_ip_for_request"
AXES_LOCKOUT_CALLABLE = "project.views.sign_in_locked_out"
# A successful sign-in clears the username's failures in the handler itself (AXES_RESET_ON_SUCCESS is axes' own).
AXES_DISABLE_ACCESS_LOG = True  # successful sign-ins are not kept: the table would only grow
AXES_ENABLE_ADMIN = False  # the handler keeps nothing in axes' tables; their admin pages would stay empty
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# --- Static files ---------------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "static"
WHITENOISE_USE_FINDERS = True  # serve straight from static/ without collectstatic in dev
WHITENOISE_AUTOREFRESH = DEBUG

# The pages speak English and Simplified Chinese (locale/; `make run` and `make test` compile the catalogs).
LANGUAGE_CODE = "en"
LANGUAGES = [("en", "English"), ("zh-hans", "简体中文")]
LOCALE_PATHS = [BASE_DIR / "locale"]
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

SESSION_COOKIE_SECURE = envbool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = envbool("CSRF_COOKIE_SECURE", not DEBUG)
# Served over TLS (README "Production"): redirect plain HTTP and send HSTS. Behind a proxy that ends TLS,
# LONGHAUL_TLS_PROXY_HEADER names the header it sets to "https" (e.g. X-Forwarded-Proto); only set it when
# the proxy always sets or strips that header, or a client could claim a secure request.
SECURE_SSL_REDIRECT = envbool("SECURE_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", False)
_TLS_PROXY_HEADER = envstr("LONGHAUL_TLS_PROXY_HEADER")
if _TLS_PROXY_HEADER:
    if not re.fullmatch(r"[A-Za-z0-9-]+", _TLS_PROXY_HEADER):
        raise ImproperlyConfigured("LONGHAUL_TLS_PROXY_HEADER must be a header name such as X-Forwarded-Proto")
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _TLS_PROXY_HEADER.upper().replace("-", "_"), "https")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
# Referrer-Policy "same-origin" and X-Content-Type-Options "nosniff" are SecurityMiddleware's defaults.
# The Content-Security-Policy (django-csp): scripts, styles, images and sockets from this origin only, no
# inline script, no plugins, never framed. The pages keep their script in static/js modules for this.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [csp.SELF],
        "script-src": [csp.SELF],
        "style-src": [csp.SELF],
        "img-src": [csp.SELF, "data:"],
        "connect-src": [csp.SELF],  # 'self' covers ws: and wss: to this host
        "object-src": [csp.NONE],
        "base-uri": [csp.NONE],
        "form-action": [csp.SELF],
        "frame-ancestors": [csp.NONE],
    },
}

# --- REST API -------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: an anonymous API call then gets 401 with WWW-Authenticate, not 403.
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["project.parsers.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "project.api_errors.render_api_error",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Longhaul API",
    "DESCRIPTION": "Durable, multi-tenant background tasks for long-running agent work.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "project.openapi.document_task_kinds"],
    "ENUM_NAME_OVERRIDES": {
        "TaskStatusEnum": "tasks.statuses.TaskStatus",
        "RunStatusEnum": "chat.models.Run.Status",
    },
}
# The largest request body; project.parsers enforces it for JSON (413), Django for forms.
DATA_UPLOAD_MAX_MEMORY_SIZE = envint("LONGHAUL_MAX_BODY_BYTES", 1_000_000, minimum=1024)
# Deepest JSON nesting a request may use: far above any real input, far below the recursion limit.
LONGHAUL_MAX_JSON_DEPTH = envint("LONGHAUL_MAX_JSON_DEPTH", 64, minimum=2, maximum=500)

# --- Request throttling (project/throttles.py) -----------------------------------
# Per user and per tenant, on the writes that make work: task submissions, answers to tasks, chat messages
# and new threads. Reads are not throttled. A rate is "N/s", "N/min", "N/hour" or "N/day", or "off". The
# defaults sit far above what a person or a well-behaved script does (a chat message takes seconds to
# answer, a thread is busy until then) and stop only a runaway loop; a tenant's are ten users' worth, so
# one user never spends the whole tenant's allowance. Queue quotas (LONGHAUL_MAX_QUEUED) limit the backlog.
LONGHAUL_THROTTLE_SUBMIT_USER = envrate("LONGHAUL_THROTTLE_SUBMIT_USER", "120/min")
LONGHAUL_THROTTLE_SUBMIT_TENANT = envrate("LONGHAUL_THROTTLE_SUBMIT_TENANT", "1200/min")
LONGHAUL_THROTTLE_ANSWER_USER = envrate("LONGHAUL_THROTTLE_ANSWER_USER", "60/min")
LONGHAUL_THROTTLE_ANSWER_TENANT = envrate("LONGHAUL_THROTTLE_ANSWER_TENANT", "600/min")
LONGHAUL_THROTTLE_MESSAGE_USER = envrate("LONGHAUL_THROTTLE_MESSAGE_USER", "60/min")
LONGHAUL_THROTTLE_MESSAGE_TENANT = envrate("LONGHAUL_THROTTLE_MESSAGE_TENANT", "600/min")
LONGHAUL_THROTTLE_THREAD_USER = envrate("LONGHAUL_THROTTLE_THREAD_USER", "60/min")
LONGHAUL_THROTTLE_THREAD_TENANT = envrate("LONGHAUL_THROTTLE_THREAD_TENANT", "600/min")
# The throttles count in the cache. Several daphnes behind a balancer must share the counts, so with Redis
# (REDIS_URL, already there for the channel layer) the cache is Redis. Without it, the embedded `make run`
# is one process and process memory counts exactly; several processes without Redis each count apart,
# which only makes the limits looser. Short socket timeouts: a Redis outage must not hang every write
# (the throttles let requests through while the cache is unreachable).
if REDIS_URL:
    CACHES = {"default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "longhaul",
        "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
    }}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- django-q2: the transport. The Task table is the truth. ---------------------
# The longest a job may run. A gateway job runs its calls on a thread beside the worker's jobs, outside this timeout
# (tasks/gateway_thread.py bounds it by its slice and its calls' lease).
Q_WORKER_TIMEOUT = envint("LONGHAUL_Q_TIMEOUT", 300, minimum=1)
Q_RETRY = envint("LONGHAUL_Q_RETRY", 330, minimum=2)
if Q_WORKER_TIMEOUT >= Q_RETRY:
    raise ImproperlyConfigured(
        "LONGHAUL_Q_TIMEOUT must be below LONGHAUL_Q_RETRY, otherwise a slow job is redelivered while it runs"
    )
Q_CLUSTER = {
    "name": "longhaul",
    "orm": "default",
    # django-q2's ORM broker over the cluster's queue and, under a key of their own, its step kicks.
    "broker_class": "tasks.broker.Broker",
    "workers": envint("LONGHAUL_WORKERS", 2, minimum=1),
    "timeout": Q_WORKER_TIMEOUT,
    "retry": Q_RETRY,
    "poll": envfloat("LONGHAUL_Q_POLL", 0.05, minimum=0.01),
    "bulk": envint("LONGHAUL_Q_BULK", 2, minimum=1),
    # Jobs a worker process runs before django-q2 replaces it (django-q2's default).
    "recycle": envint("LONGHAUL_Q_RECYCLE", 500, minimum=1),
    "ack_failures": True,
    "max_attempts": 1,
    "save_limit": 200,
    "catch_up": False,
    "label": "Worker queue",
}
# The workers that run steps, on every machine: a gateway batch that makes steps due kicks this many at most, each
# for the task due longest (tasks/kicks.py), and their turns go on to the rest. One machine: its worker processes.
LONGHAUL_STEP_WORKERS = envint("LONGHAUL_STEP_WORKERS", Q_CLUSTER["workers"], minimum=1)
# Chat runs (answers, notifications) on a queue of their own, served by `manage.py worker --queue chat`
# (django-q2 names a queue by its cluster); the same settings but for the workers and the label.
LONGHAUL_CHAT_QUEUE = "longhaul-chat"
Q_CLUSTER["ALT_CLUSTERS"] = {
    LONGHAUL_CHAT_QUEUE: {"workers": envint("LONGHAUL_CHAT_WORKERS", 2, minimum=1), "label": "Chat queue"},
}

# --- The runtime ----------------------------------------------------------------
LONGHAUL_CODE_VERSION = envstr("LONGHAUL_CODE_VERSION", "0.1.0")
# The debug task kinds (sleep: waits, fails and crashes on request) only when asked for, never implied by DEBUG.
LONGHAUL_DEBUG_DRIVERS = envbool("LONGHAUL_DEBUG_DRIVERS", False)
LONGHAUL_LEASE_SECONDS = envfloat("LONGHAUL_LEASE_SECONDS", 30.0, minimum=0.5)
LONGHAUL_MAX_ATTEMPTS = envint("LONGHAUL_MAX_ATTEMPTS", 5, minimum=1)
# Chat runs (answers and notifications) one tenant's threads may have in progress at once; the rest wait,
# oldest first. Far above one person's use; it keeps one tenant's many threads from holding every worker.
LONGHAUL_CHAT_RUNS_PER_TENANT = envint("LONGHAUL_CHAT_RUNS_PER_TENANT", 8, minimum=1)
LONGHAUL_RETRY_BASE_SECONDS = envfloat("LONGHAUL_RETRY_BASE_SECONDS", 1.0, minimum=0.0)
LONGHAUL_RETRY_CAP_SECONDS = envfloat("LONGHAUL_RETRY_CAP_SECONDS", 300.0, minimum=0.0)
LONGHAUL_STALL_SECONDS = envfloat("LONGHAUL_STALL_SECONDS", 300.0, minimum=1.0)
LONGHAUL_STEP_SLICE_MS = envint("LONGHAUL_STEP_SLICE_MS", 200, minimum=0)
LONGHAUL_IDEMPOTENCY_TTL = envint("LONGHAUL_IDEMPOTENCY_TTL", 24 * 3600, minimum=1)
# Retention, days per data class (0: for ever); tasks/retention.py purges with every sweep.
LONGHAUL_RETENTION_EVENTS_DAYS = envint(retention.setting_name("events"), retention.DEFAULT_DAYS["events"],
                                        minimum=0, maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_CHECKPOINTS_DAYS = envint(retention.setting_name("checkpoints"),
                                             retention.DEFAULT_DAYS["checkpoints"], minimum=0, maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_OPERATION_PAYLOADS_DAYS = envint(retention.setting_name("operation_payloads"),
                                                    retention.DEFAULT_DAYS["operation_payloads"], minimum=0,
                                                    maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_RESULTS_DAYS = envint(retention.setting_name("results"), retention.DEFAULT_DAYS["results"],
                                         minimum=0, maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_MESSAGES_DAYS = envint(retention.setting_name("messages"), retention.DEFAULT_DAYS["messages"],
                                          minimum=0, maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_AUDIT_DAYS = envint(retention.setting_name("audit"), retention.DEFAULT_DAYS["audit"],
                                       minimum=0, maximum=retention.MAX_DAYS)
LONGHAUL_RETENTION_ADMISSIONS_DAYS = envint(retention.setting_name("admissions"), retention.DEFAULT_DAYS["admissions"],
                                            minimum=0, maximum=retention.MAX_DAYS)
retention.check({"events": LONGHAUL_RETENTION_EVENTS_DAYS, "checkpoints": LONGHAUL_RETENTION_CHECKPOINTS_DAYS,
                 "operation_payloads": LONGHAUL_RETENTION_OPERATION_PAYLOADS_DAYS,
                 "results": LONGHAUL_RETENTION_RESULTS_DAYS, "messages": LONGHAUL_RETENTION_MESSAGES_DAYS,
                 "audit": LONGHAUL_RETENTION_AUDIT_DAYS, "admissions": LONGHAUL_RETENTION_ADMISSIONS_DAYS})
LONGHAUL_MAX_RUNNING = envint("LONGHAUL_MAX_RUNNING", 50, minimum=1)
LONGHAUL_MAX_QUEUED = envint("LONGHAUL_MAX_QUEUED", 10_000, minimum=1)
# Past this share of a queue's cap (a tenant's max_queued, or LONGHAUL_MAX_QUEUED), submissions below the
# queue's median priority are refused (429) so that the last places go to higher priorities.
LONGHAUL_SHED_THRESHOLD = envfloat("LONGHAUL_SHED_THRESHOLD", 0.8, minimum=0.01, maximum=1.0)
# The highest Tenant.weight anyone may set: a tenant admin edits their own tenant's quotas.
LONGHAUL_MAX_TENANT_WEIGHT = envint("LONGHAUL_MAX_TENANT_WEIGHT", 10, minimum=1)
LONGHAUL_SWEEP_BATCH = envint("LONGHAUL_SWEEP_BATCH", 500, minimum=1)
# Rows a liveness rule over every task waiting on a call reads per sweep, on from the last pass (tasks/liveness.py).
LONGHAUL_LIVENESS_SLICE = envint("LONGHAUL_LIVENESS_SLICE", 1000, minimum=1)
# Gateway pools (project/pools.py): defaults per kind of call, LONGHAUL_POOLS for one pool (JSON).
LONGHAUL_MODEL_CONCURRENCY = envint("LONGHAUL_MODEL_CONCURRENCY", 32, minimum=1)
LONGHAUL_TOOL_CONCURRENCY = envint("LONGHAUL_TOOL_CONCURRENCY", 64, minimum=1)
# Rate limits per pool, 0: none. A model pool may also limit tokens (prompt and completion) per minute.
LONGHAUL_MODEL_REQUESTS_PER_MINUTE = envint("LONGHAUL_MODEL_REQUESTS_PER_MINUTE", 0, minimum=0)
LONGHAUL_MODEL_TOKENS_PER_MINUTE = envint("LONGHAUL_MODEL_TOKENS_PER_MINUTE", 0, minimum=0)
LONGHAUL_TOOL_REQUESTS_PER_MINUTE = envint("LONGHAUL_TOOL_REQUESTS_PER_MINUTE", 0, minimum=0)
LONGHAUL_MCP_REQUESTS_PER_MINUTE = envint("LONGHAUL_MCP_REQUESTS_PER_MINUTE", 0, minimum=0)
LONGHAUL_POOLS = pools.parse(envstr("LONGHAUL_POOLS"))
# Calls one task has out at once, over all pools: a step that fans out 30 reads leaves room for others.
LONGHAUL_TASK_CALLS_IN_FLIGHT = envint("LONGHAUL_TASK_CALLS_IN_FLIGHT", 8, minimum=1)
# Calls one gateway job keeps out at once: the process's ceiling, set above what the pools allow together, so
# that the pools, not the job, decide what each remote takes. A job raises its open-file limit to match, or keeps
# fewer out if it cannot (tasks/descriptors.py).
LONGHAUL_GATEWAY_INFLIGHT = envint("LONGHAUL_GATEWAY_INFLIGHT", 1000, minimum=1)
# Gateway jobs that claim calls at once, each holding a turn (an advisory lock), in different worker processes:
# more than one spreads the calls' CPU over processes (and machines), at the cost of the steps beside them.
LONGHAUL_GATEWAY_TURNS = envint("LONGHAUL_GATEWAY_TURNS", 1, minimum=1, maximum=64)
LONGHAUL_GATEWAY_SLICE_SECONDS = envfloat("LONGHAUL_GATEWAY_SLICE_SECONDS", 60.0, minimum=1.0)
LONGHAUL_OPERATION_LEASE_SECONDS = envfloat("LONGHAUL_OPERATION_LEASE_SECONDS", 180.0, minimum=1.0)
LONGHAUL_NOTIFY_RETRY_BASE_SECONDS = envfloat("LONGHAUL_NOTIFY_RETRY_BASE_SECONDS", 2.0, minimum=0.0)
LONGHAUL_NOTIFY_RETRY_CAP_SECONDS = envfloat("LONGHAUL_NOTIFY_RETRY_CAP_SECONDS", 300.0, minimum=0.0)
# Busy-thread deferrals of one notification version before each further one counts as a failure.
LONGHAUL_NOTIFY_MAX_DEFERRALS = envint("LONGHAUL_NOTIFY_MAX_DEFERRALS", 100, minimum=1)
# The research agent's gateways (tasks/gateway/): offline by default, so it works with no network.
LONGHAUL_MODEL_PROVIDER = envstr("LONGHAUL_MODEL_PROVIDER", "offline")
LONGHAUL_MODEL_BASE_URL = envstr("LONGHAUL_MODEL_BASE_URL")
LONGHAUL_MODEL_API_KEY = envstr("LONGHAUL_MODEL_API_KEY")
LONGHAUL_MODEL = envstr("LONGHAUL_MODEL")
LONGHAUL_MODEL_TIMEOUT_S = envfloat("LONGHAUL_MODEL_TIMEOUT_S", 60.0, minimum=0.1)
LONGHAUL_OFFLINE_LATENCY_MS = envint("LONGHAUL_OFFLINE_LATENCY_MS", 0, minimum=0)
LONGHAUL_SEARCH_URL = envstr("LONGHAUL_SEARCH_URL")
LONGHAUL_ALLOW_PRIVATE_FETCH = envbool("LONGHAUL_ALLOW_PRIVATE_FETCH", False)
LONGHAUL_VISIT_MAX_BYTES = envint("LONGHAUL_VISIT_MAX_BYTES", 2_000_000, minimum=1024)
LONGHAUL_VISIT_TIMEOUT_S = envfloat("LONGHAUL_VISIT_TIMEOUT_S", 15.0, minimum=0.1)
LONGHAUL_CORPUS_PATH = envstr("LONGHAUL_CORPUS_PATH", str(VAR_DIR / "corpus.sqlite3"))
LONGHAUL_SOURCE_MAX_AGE_SECONDS = envint("LONGHAUL_SOURCE_MAX_AGE_SECONDS", 24 * 3600, minimum=1)
LONGHAUL_AGING_SECONDS = envfloat("LONGHAUL_AGING_SECONDS", 60.0, minimum=1.0)  # one priority point per this long queued
# With every slot taken, a tenant owed one by the weights gets one back at another tenant's next step
# boundary instead of waiting for a task to end (tasks/scheduling.py, take_a_slot_back).
LONGHAUL_TAKE_SLOTS_BACK = envbool("LONGHAUL_TAKE_SLOTS_BACK", True)
LONGHAUL_METRICS_TOKEN = envstr("LONGHAUL_METRICS_TOKEN")  # bearer token for /metrics; empty: staff sessions only
LONGHAUL_METRICS_LONG_WAIT_SECONDS = envfloat("LONGHAUL_METRICS_LONG_WAIT_SECONDS", 300.0, minimum=1.0)
LONGHAUL_STREAM_POLL_S = envfloat("LONGHAUL_STREAM_POLL_S", 1.0, minimum=0.01)  # stream fallback without Redis
LONGHAUL_STREAM_SAFETY_POLL_S = envfloat("LONGHAUL_STREAM_SAFETY_POLL_S", 15.0, minimum=0.01)  # with Redis
LONGHAUL_ALERT_EMAIL = envbool("LONGHAUL_ALERT_EMAIL", False)
LONGHAUL_NOTIFIER = envstr("LONGHAUL_NOTIFIER", "chat.notify.deliver")
# What became of a notification run, by its key (the sweeper asks about dispatched notifications).
LONGHAUL_NOTIFIER_RUN_STATE = envstr("LONGHAUL_NOTIFIER_RUN_STATE", "chat.notify.run_state")

# Remote MCP tasks (tasks/mcp/config.py describes the servers file).
LONGHAUL_MCP_SERVERS = envstr("LONGHAUL_MCP_SERVERS")  # path of a TOML or JSON file; empty: no servers
# The soonest a remote task is polled again (the server's pollIntervalMs is honoured up to 24 h).
LONGHAUL_MCP_POLL_FLOOR_MS = envint("LONGHAUL_MCP_POLL_FLOOR_MS", 1_000, minimum=10)
LONGHAUL_MCP_BACKOFF_CAP_SECONDS = envfloat("LONGHAUL_MCP_BACKOFF_CAP_SECONDS", 300.0, minimum=0.01)
LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = envfloat("LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS", 60.0, minimum=0.0)
LONGHAUL_MCP_CONCURRENCY = envint("LONGHAUL_MCP_CONCURRENCY", 8, minimum=1)  # calls in flight per MCP server
# A result over 64 KiB is not stored: this many characters of it are, with result_truncated.
LONGHAUL_MCP_RESULT_PREVIEW_CHARS = envint("LONGHAUL_MCP_RESULT_PREVIEW_CHARS", 2_000, minimum=100)

# Webhooks (webhooks/): signed deliveries of task events to tenants' endpoints, through an outbox.
# The URL rules are visit's (LONGHAUL_ALLOW_PRIVATE_FETCH lets loopback and private addresses in).
LONGHAUL_WEBHOOK_TIMEOUT_S = envfloat("LONGHAUL_WEBHOOK_TIMEOUT_S", 10.0, minimum=0.1)
LONGHAUL_WEBHOOK_MAX_RESPONSE_BYTES = envint("LONGHAUL_WEBHOOK_MAX_RESPONSE_BYTES", 64 * 1024, minimum=1024)
# A delivery's lease outlives its request: a worker killed mid-delivery frees the row when it expires.
LONGHAUL_WEBHOOK_LEASE_SECONDS = envfloat("LONGHAUL_WEBHOOK_LEASE_SECONDS", 60.0, minimum=1.0)
LONGHAUL_WEBHOOK_MAX_ATTEMPTS = envint("LONGHAUL_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
LONGHAUL_WEBHOOK_RETRY_BASE_SECONDS = envfloat("LONGHAUL_WEBHOOK_RETRY_BASE_SECONDS", 30.0, minimum=0.0)
LONGHAUL_WEBHOOK_RETRY_CAP_SECONDS = envfloat("LONGHAUL_WEBHOOK_RETRY_CAP_SECONDS", 3600.0, minimum=0.0)
# After a rotation the old secret still signs (a second signature) this long, so receivers can switch.
LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS = envint("LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS", 24 * 3600, minimum=0)
LONGHAUL_WEBHOOK_MAX_ENDPOINTS = envint("LONGHAUL_WEBHOOK_MAX_ENDPOINTS", 20, minimum=1)  # per tenant
if LONGHAUL_WEBHOOK_LEASE_SECONDS <= LONGHAUL_WEBHOOK_TIMEOUT_S:
    raise ImproperlyConfigured("LONGHAUL_WEBHOOK_LEASE_SECONDS must exceed LONGHAUL_WEBHOOK_TIMEOUT_S, otherwise a "
                               "delivery still under way is claimed again")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Every handler carries redact_secrets (project/logging.py): keys, tokens and passwords are replaced.
    "filters": {"redact_secrets": {"()": "project.logging.RedactSecrets"}},
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["redact_secrets"]}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {
        "django-q": {"level": envstr("Q_LOG_LEVEL", "WARNING")},  # django-q2 logs as "django-q"
        # httpx2 logs every request's URL at INFO, and the URLs the research tools visit come from task
        # input and observations, which stay out of INFO logs.
        "httpx2": {"level": "WARNING"},
        "httpcore2": {"level": "WARNING"},
        "mcp": {"level": "WARNING"},  # the MCP SDK's session logs URLs and session ids at INFO
        "axes": {"level": "WARNING"},  # a line per start and per sign-in, with nothing an operator acts on
    },
}
