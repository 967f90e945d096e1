"""Tenancy and the durable task runtime's tables.

Rows here are written by other processes at the same time: status, lease and
notification columns change only through conditional UPDATEs in
tasks/transitions.py and tasks/leases.py, never through read-modify-save().
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from tasks.sealed import SealedJSONField, SealedModel, SealedQuerySet, SealedTextField
from tasks.statuses import CLAIMABLE, HOLDS_SLOT, TERMINAL, ErrorClass, NotificationStatus, OperationStatus, TaskStatus

if TYPE_CHECKING:
    from tasks.leases import Resume


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    max_running = models.PositiveIntegerField(default=4, help_text="Tasks holding a running slot at once.")
    max_queued = models.PositiveIntegerField(default=1000, help_text="Tasks waiting for admission at once.")
    weight = models.PositiveIntegerField(default=1, help_text="Share of running slots relative to other tenants.")
    retention = models.JSONField(
        default=dict, blank=True,
        help_text="Per data class, the days this tenant's data is kept instead of the system's "
                  "LONGHAUL_RETENTION_<CLASS>_DAYS (0: for ever); set in the admin, checked by tasks/retention.py.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class TenantKey(models.Model):
    """One version of a tenant's data key, wrapped by a master key (tasks/crypto.py). The newest version not
    destroyed seals new content; older ones open what they sealed until `rotate_tenant_key` has resealed it.
    A destroyed key keeps its row without the key: what it sealed reads as erased (crypto-shredding)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="keys",
                               db_index=False)  # tenant_key_version_unique leads with it
    version = models.PositiveIntegerField()
    master_key_id = models.CharField(max_length=32, help_text="The LONGHAUL_MASTER_KEYS entry that wraps it.")
    wrapped = models.BinaryField(blank=True, help_text="Nonce and AES-256-GCM ciphertext of the data key; "
                                                       "empty once destroyed.")
    created_at = models.DateTimeField()
    destroyed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "version"], name="tenant_key_version_unique")]

    def __str__(self) -> str:
        return f"{self.tenant_id} v{self.version}{' (destroyed)' if self.destroyed_at else ''}"


class Membership(models.Model):
    class Role(models.TextChoices):
        MEMBER = "member"
        ADMIN = "admin"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships",
                             db_index=False)  # membership_user_tenant_unique leads with it
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class Task(SealedModel):
    # No step's UPDATE of this row is HOT (its lease and due time are indexed), so each one writes an entry into
    # every index the row is in: the foreign keys below have no index of their own where another index leads
    # with them (tenant, thread), and the ones nearly always NULL (the *_requested_by) index only their values.
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="tasks", db_index=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="tasks")
    # Named by string so that tasks never imports chat (DESIGN §3).
    thread = models.ForeignKey("chat.Thread", null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks",
                               db_index=False)
    kind = models.CharField(max_length=32)
    name = models.CharField(max_length=200)
    input = SealedJSONField(default=dict)
    budget = models.JSONField(default=dict)
    priority = models.SmallIntegerField(default=0)

    status = models.CharField(max_length=16, choices=TaskStatus.choices, default=TaskStatus.QUEUED)
    error_class = models.CharField(max_length=32, choices=ErrorClass.choices, blank=True)
    error_message = models.TextField(blank=True, help_text="Shown to the task's owner.")
    error_detail = models.TextField(blank=True, help_text="Internal; never leaves the server.")
    version = models.PositiveBigIntegerField(default=0, help_text="Bumped by every status change and claim.")

    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fencing_token = models.PositiveBigIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    last_progress_at = models.DateTimeField(null=True, blank=True)
    stalled_at = models.DateTimeField(null=True, blank=True)
    current_step = models.PositiveIntegerField(default=0, help_text="Steps completed and checkpointed.")
    waiting_reason = models.CharField(max_length=64, blank=True)
    tracking_degraded = models.BooleanField(
        default=False, help_text="A remote task's server stopped answering polls; cleared by the next good one.")
    attempts = models.PositiveIntegerField(default=0, help_text="Claims of the current step; reset when it commits.")
    retries = models.PositiveIntegerField(default=0, help_text="Retries drawn from the task's retry budget.")
    next_run_at = models.DateTimeField(null=True, blank=True)
    queue_deadline_at = models.DateTimeField(null=True, blank=True)

    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    cancel_reason = models.CharField(max_length=500, blank=True)
    cancel_keep_results = models.BooleanField(default=False)
    pause_requested_at = models.DateTimeField(null=True, blank=True)
    pause_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    pause_reason = models.CharField(max_length=500, blank=True)
    delete_requested_at = models.DateTimeField(
        null=True, blank=True,
        help_text="Its owner deleted it (or its thread) while it could still run: hidden at once, cancelled, and "
                  "deleted by the sweeper once it has ended (tasks/deletion.py).")
    delete_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    yield_requested_at = models.DateTimeField(
        null=True, blank=True,
        help_text="Admission asked this running task to give its slot back at its next step boundary: another "
                  "tenant is owed it (tasks/scheduling.py). Cleared when it leaves running.")

    question = SealedTextField(blank=True, help_text="What the task asks its owner while waiting_input.")
    question_form = SealedJSONField(null=True, blank=True,
                                     help_text="The requested schema of a structured answer; None: free text.")
    answer = SealedTextField(blank=True, help_text="The owner's answer, read by the next step.")
    answer_data = SealedJSONField(null=True, blank=True, help_text="The owner's structured answer, if any.")

    # A remote task's handle (never leaves the server) and what its polls and cancels last said.
    remote_handle = models.CharField(max_length=255, null=True, blank=True)
    remote_server = models.CharField(max_length=64, blank=True)
    remote_poll_error = models.TextField(blank=True, help_text="The last poll error, redacted.")
    remote_cancel_attempts = models.PositiveIntegerField(default=0)
    remote_cancel_error = models.TextField(blank=True, help_text="Why the last remote cancel attempt failed, redacted.")

    result = SealedJSONField(null=True, blank=True)
    result_version = models.PositiveIntegerField(default=0)

    code_version = models.CharField(max_length=64, blank=True)
    schema_version = models.PositiveIntegerField(default=0)
    model_name = models.CharField(max_length=200, blank=True)
    prompt_version = models.CharField(max_length=64, blank=True)
    tool_protocol = models.CharField(max_length=64, blank=True)

    last_event_seq = models.PositiveBigIntegerField(default=0)

    # The notification outbox (DESIGN §7): newest event worth telling vs newest told.
    event_fingerprint = models.CharField(max_length=64, blank=True)
    event_version = models.PositiveIntegerField(default=0)
    notified_version = models.PositiveIntegerField(default=0)
    notification_status = models.CharField(max_length=16, choices=NotificationStatus.choices,
                                           default=NotificationStatus.NONE)
    dispatch_version = models.PositiveIntegerField(default=0)
    dispatch_attempt = models.PositiveIntegerField(default=0)
    dispatch_event = SealedJSONField(null=True, blank=True)
    notification_error = models.TextField(blank=True)
    notification_attempt_count = models.PositiveIntegerField(
        default=0, help_text="Failed deliveries of the newest version; reset by a new version and by a delivery.")
    notification_deferrals = models.PositiveIntegerField(
        default=0, help_text="Times the newest version found its thread busy; past a ceiling they count as failures.")
    notification_dispatches = models.PositiveIntegerField(
        default=0, help_text="Deliveries started, ever: the attempt in run keys, so a revived dead letter gets a new key.")
    next_notification_at = models.DateTimeField(null=True, blank=True)
    notification_lease_owner = models.CharField(max_length=200, blank=True)
    notification_lease_expires_at = models.DateTimeField(null=True, blank=True)

    created_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()

    # Not a column: what the claim that returned this row read beside it for the step it resumes
    # (tasks/leases.py); None when the step must read it itself. Consumed by that step (tasks/runner.py).
    resume: Resume | None = None

    objects = SealedQuerySet.as_manager()
    class Meta:
        constraints = [
            # One active task per remote task: the same owner cannot track a server's handle twice at once
            # (a task that ended lets go of it: servers may reuse ids). Used by runner._remember_remote, which
            # turns its violation into "already tracked", and by drivers.mcp._tracked_elsewhere.
            models.UniqueConstraint(fields=["owner", "remote_server", "remote_handle"], name="task_remote_handle_unique",
                                    condition=Q(remote_handle__isnull=False) & ~Q(status__in=sorted(TERMINAL))),
        ]
        indexes = [
            # retention.purge: ended tasks in the order they ended.
            models.Index(fields=["finished_at", "id"], name="task_ended_idx",
                         condition=Q(status__in=sorted(TERMINAL))),
            # deletion.finish_pending: tasks deleted while they could still run, waiting to end.
            models.Index(fields=["id"], name="task_delete_pending_idx", condition=Q(delete_requested_at__isnull=False)),
            # leases.claim, kicks.kick_first_due and sweeper.kick_due: "claimable and due", in the order they
            # claim (due time, then id). With the id in the key the claim of the task due longest reads the index
            # in order and stops at its first free row; keyed by due time alone, PostgreSQL had to sort each due
            # time's rows, and chose a bitmap scan that read every due row and every dead index entry a step
            # leaves (it never marks them dead, as an ordered scan does), at every claim.
            models.Index(fields=["next_run_at", "id"], name="task_due_idx", condition=Q(status__in=sorted(CLAIMABLE))),
            # scheduling.admit: the tenant's queued tasks in priority and age order.
            models.Index(
                fields=["tenant", "-priority", "created_at"],
                name="task_queued_idx",
                condition=Q(status=TaskStatus.QUEUED),
            ),
            # scheduling.running_counts: slots held per tenant.
            models.Index(fields=["tenant"], name="task_slot_idx", condition=Q(status__in=sorted(HOLDS_SLOT))),
            # sweeper.find_stalled and lease expiry: tasks a worker holds.
            models.Index(fields=["lease_expires_at"], name="task_leased_idx", condition=~Q(lease_owner="")),
            # api: a tenant's tasks, newest first.
            models.Index(fields=["tenant", "-created_at"], name="task_tenant_recent_idx"),
            models.Index(fields=["thread", "-created_at"], name="task_thread_recent_idx"),
            # Deleting a user sets these NULL where they name the user.
            *(models.Index(fields=[field], name=f"task_{field}_idx", condition=Q(**{f"{field}__isnull": False}))
              for field in ("cancel_requested_by", "pause_requested_by", "delete_requested_by")),
            # chat.api.panel_tasks: a thread's tasks not ended, newest first, however many have ended in it.
            models.Index(fields=["thread", "-created_at"], name="task_thread_active_idx",
                         condition=~Q(status__in=sorted(TERMINAL))),
            # metrics: parked tasks per tenant.
            models.Index(fields=["tenant", "status"], name="task_parked_idx",
                         condition=Q(status__in=["partial", "paused", "waiting_input"])),
            # metrics and the admin's dead-letter view: dead letters per tenant.
            models.Index(fields=["tenant"], name="task_dead_letter_idx", condition=Q(notification_status="dead_letter")),
            # notifications.kick_due and the sweeper: outbox rows waiting for delivery.
            models.Index(fields=["next_notification_at"], name="task_notify_due_idx",
                         condition=Q(notification_status__in=["pending", "retry", "claimed", "dispatched"])),
            # liveness.waits_for_nothing: tasks waiting for their calls, held by nobody.
            models.Index(fields=["id"], name="task_waiting_calls_idx",
                         condition=Q(lease_owner="", next_run_at__isnull=True)
                         & (Q(status=TaskStatus.WAITING_TOOL)
                            | Q(status=TaskStatus.RUNNING, waiting_reason__in=["model", "tool"]))),
            # liveness.never_due: claimable rows with no due time that wait for no call (a violation, so this
            # index is all but empty); without it the rule reads every task waiting on its calls, each sweep.
            models.Index(fields=["id"], name="task_never_due_idx",
                         condition=Q(status__in=sorted(CLAIMABLE), next_run_at__isnull=True)
                         & ~Q(status=TaskStatus.RUNNING, waiting_reason__in=["model", "tool"])),
            # scheduling.head_of_queue: tasks queued only to cancel their remote work go first.
            models.Index(fields=["tenant", "updated_at", "id"], name="task_cancel_queued_idx",
                         condition=Q(status=TaskStatus.QUEUED, waiting_reason="cancel")),
            # liveness.stop_not_acted_on: active tasks asked to cancel or pause.
            models.Index(fields=["id"], name="task_stop_requested_idx",
                         condition=(Q(cancel_requested_at__isnull=False) | Q(pause_requested_at__isnull=False))
                         & Q(status__in=["queued", "running", "waiting_tool", "waiting_input", "retry_wait",
                                         "paused", "partial"])),
            # liveness.notifications_untold: a newer event on a row the deliverer does not look at (rare).
            models.Index(fields=["id"], name="task_untold_idx",
                         condition=Q(event_version__gt=F("notified_version"), notification_status__in=["none",
                                                                                                       "delivered"])),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"


# Events whose data stays in the clear: metrics count them by a key of their data in SQL, and they carry
# an error class and a redacted message, no content. Every other event's data is sealed.
CLEAR_EVENTS = frozenset({"retry_scheduled"})


class TaskEvent(SealedModel):
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events",
                             db_index=False)  # event_task_seq_unique leads with it
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=40)
    status = models.CharField(max_length=16, choices=TaskStatus.choices)
    data = SealedJSONField(default=dict, when=lambda event: bool(event.data) and event.kind not in CLEAR_EVENTS)
    at = models.DateTimeField()

    objects = SealedQuerySet.as_manager()
    class Meta:
        ordering = ["task", "seq"]
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="event_task_seq_unique")]
        indexes = [
            # metrics: recent admissions, takeovers and retries.
            models.Index(fields=["kind", "at"], name="event_metrics_idx",
                         condition=Q(kind__in=["admitted", "recovered", "retry_scheduled"])),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} {self.kind}"


class Checkpoint(SealedModel):
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="checkpoints",
                             db_index=False)  # checkpoint_task_step_unique leads with it
    step = models.PositiveIntegerField()
    fencing_token = models.PositiveBigIntegerField()
    state = SealedJSONField(default=dict, tenant="task__tenant_id")
    schema_version = models.PositiveIntegerField()
    at = models.DateTimeField()

    objects = SealedQuerySet.as_manager()
    class Meta:
        ordering = ["task", "step"]
        # A step commits at most once: a zombie's duplicate would collide here even if the fence failed.
        constraints = [models.UniqueConstraint(fields=["task", "step"], name="checkpoint_task_step_unique")]


class Operation(SealedModel):
    class Mode(models.TextChoices):
        GATEWAY = "gateway"  # a network call a step requested; a gateway job runs it
        LOCAL = "local"  # a database-local effect a step performed itself (the sleep driver's SleepEffect)

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="operations")
    key = models.CharField(max_length=200, unique=True, help_text="task:step:n, the same on every attempt.")
    step = models.PositiveIntegerField()
    n = models.PositiveIntegerField()
    kind = models.CharField(max_length=16)  # model, tool, mcp; effect for local ones
    name = models.CharField(max_length=100)
    pool = models.CharField(max_length=240, blank=True,
                            help_text="The pool whose slots and rate it takes (tasks/pools.py): kind:model, kind:tool "
                                      "or mcp:server; empty for local effects.")
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.GATEWAY)
    args_digest = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=OperationStatus.choices, default=OperationStatus.STARTED)
    result = SealedJSONField(null=True, blank=True, tenant="task__tenant_id")
    error_class = models.CharField(max_length=32, blank=True)
    error_message = models.TextField(blank=True)
    attempts = models.PositiveIntegerField(default=1)
    has_side_effects = models.BooleanField(
        default=False, help_text="Must not run twice: if its gateway job dies during it, it fails, not runs again.")
    fencing_token = models.PositiveBigIntegerField()
    args = SealedJSONField(null=True, blank=True, tenant="task__tenant_id",
                           help_text="What a gateway job executes; None for local effects.")
    not_before = models.DateTimeField(null=True, blank=True,
                                      help_text="Not run before this time (a remote job's next poll); None: at once.")
    usage = models.JSONField(default=dict, blank=True)
    version = models.CharField(max_length=200, blank=True,
                               help_text="The model (with the prompts' version) or the tool protocol that ran it.")
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = SealedQuerySet.as_manager()
    class Meta:
        ordering = ["task", "step", "n"]
        indexes = [
            # operations.claim_batch: pending operations of a pool, oldest first.
            models.Index(fields=["pool", "id"], name="operation_pool_pending_idx", condition=Q(status="pending")),
            # operations.claim_batch and pool counts: operations in flight, by lease expiry.
            models.Index(fields=["pool", "lease_expires_at"], name="operation_pool_inflight_idx",
                         condition=Q(status="started", mode="gateway")),
            # operations.due_exists (the sweeper) and claims: pending gateway calls by the time they are due.
            models.Index(fields=["not_before"], name="operation_due_idx", condition=Q(status="pending", mode="gateway")),
            # The same, due at once (no not_before): an index of its own, as the planner guesses half of all pending
            # calls have none (most finished calls have none) and would otherwise read every unfinished call.
            models.Index(fields=["id"], name="operation_due_now_idx",
                         condition=Q(status="pending", mode="gateway", not_before__isnull=True)),
            # liveness.orphaned_operations: the calls not yet finished, a slice of them by id each pass.
            models.Index(fields=["id"], name="operation_unfinished_idx", condition=Q(status__in=["pending", "started"])),
        ]

    def __str__(self) -> str:
        return self.key

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.pool and self.mode == self.Mode.GATEWAY:
            from tasks.pools import key_of  # tasks.pools reads these models

            self.pool = key_of(self.kind, self.name, self.args)
        super().save(*args, **kwargs)


class IdempotencyRecord(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+",
                               db_index=False)  # idempotency_tenant_user_key_unique leads with it
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    kind = models.CharField(max_length=32)
    request_digest = models.CharField(max_length=64)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "user", "key"], name="idempotency_tenant_user_key_unique")
        ]


class AuditEntry(models.Model):
    tenant = models.ForeignKey(Tenant, null=True, on_delete=models.SET_NULL, related_name="+",
                               db_index=False)  # audit_tenant_recent_idx leads with it
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64)
    details = models.JSONField(default=dict)
    at = models.DateTimeField()

    class Meta:
        ordering = ["-at"]
        verbose_name_plural = "audit entries"
        indexes = [
            models.Index(fields=["tenant", "-at"], name="audit_tenant_recent_idx"),
            # retention.purge: entries in the order they were written.
            models.Index(fields=["at", "id"], name="audit_at_idx"),
            # metrics: recent refused submissions.
            models.Index(fields=["at"], name="audit_rejected_idx", condition=Q(action="task.rejected")),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.target_type} {self.target_id}"


class SleepEffect(models.Model):
    """The debug `sleep` driver's side effect. No unique constraint on purpose:
    a step whose effect ran twice shows up as two rows."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    step = models.PositiveIntegerField()
    at = models.DateTimeField()


class SweepCursor(models.Model):
    """Where a liveness rule's rotating slice stopped on its last pass (tasks/liveness.py), kept here so every
    worker process's sweep goes on from it."""

    rule = models.CharField(max_length=64, unique=True)
    after_id = models.BigIntegerField(default=0, help_text="The next pass reads the rows after this id.")

    def __str__(self) -> str:
        return f"{self.rule}: after {self.after_id}"


class RetentionMark(models.Model):
    """How far the purge of one data class has gone (tasks/retention.py), and how much it purged."""

    data_class = models.CharField(max_length=32)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
                               help_text="The tenant whose override this pass follows; empty: everyone else.")
    up_to = models.DateTimeField(null=True, blank=True, help_text="The moment of the last row purged.")
    up_to_id = models.BigIntegerField(default=0, help_text="The id of the last row purged, at that moment.")
    purged = models.PositiveBigIntegerField(default=0, help_text="Rows purged (or emptied) so far.")
    last_run_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["data_class"], condition=Q(tenant__isnull=True),
                                    name="retention_mark_system_unique"),
            models.UniqueConstraint(fields=["data_class", "tenant"], condition=Q(tenant__isnull=False),
                                    name="retention_mark_tenant_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.data_class}{f' ({self.tenant})' if self.tenant_id else ''}: {self.purged} purged"


class Pool(models.Model):
    """What the gateway keeps of one pool between claims, shared by every process (tasks/pools.py):
    its rate allowances and its pause. Its limits are settings; a row exists once the pool was used."""

    key = models.CharField(max_length=240, unique=True, help_text="kind:name, as Operation.pool.")
    requests_allowance = models.FloatField(default=0.0, help_text="Requests it may still start (requests/min).")
    tokens_allowance = models.FloatField(default=0.0, help_text="Tokens it may still spend (tokens/min).")
    refilled_at = models.DateTimeField(null=True, blank=True)
    paused_until = models.DateTimeField(null=True, blank=True,
                                        help_text="A provider answered 429 with Retry-After: nothing starts before.")
    pause_reason = models.CharField(max_length=200, blank=True)
    pauses = models.PositiveBigIntegerField(default=0, help_text="How often a 429 paused it.")

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return self.key


class Alert(models.Model):
    """Something an operator should look at, raised by the runtime; shown in the admin until acknowledged."""

    class Kind(models.TextChoices):
        DEAD_LETTER = "dead_letter"
        STALLED = "stalled"
        POISON = "poison"
        QUOTA_REJECTIONS = "quota_rejections"
        LIVENESS = "liveness"  # the sweeper found a row with no way forward and repaired it

    kind = models.CharField(max_length=32, choices=Kind.choices)
    rule = models.CharField(max_length=64, blank=True, help_text="For a liveness repair: the rule the row broke.")
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    task = models.ForeignKey(Task, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    message = models.TextField()
    created_at = models.DateTimeField()
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    acknowledged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # admin index: open alerts, newest first.
            models.Index(fields=["-created_at"], name="alert_open_idx", condition=Q(acknowledged_at__isnull=True)),
            # metrics: liveness repairs counted by rule.
            models.Index(fields=["rule"], name="alert_liveness_idx", condition=Q(kind="liveness")),
        ]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message[:60]}"


class SignInBackoff(models.Model):
    """Failed sign-ins for one username and when its password may next be checked (project/sign_in_backoff.py).

    Here rather than in django-axes' tables: axes forgets failures by one cool-off for every user at once,
    which cannot express a delay that doubles per username.
    """

    username = models.CharField(max_length=255, unique=True)
    failures = models.PositiveIntegerField(default=0)
    retry_at = models.DateTimeField()

    class Meta:
        indexes = [
            # sign_in_backoff.forget_quiet_usernames: rows whose last try is older than the memory.
            models.Index(fields=["retry_at"], name="signin_backoff_retry_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.username}: {self.failures} failures"


class AdmissionRecord(models.Model):
    """One submission as admission saw it (tasks/admission_records.py writes it, tasks/replay.py reads it):
    when it arrived, when it first got and gave back a slot, how it ended, and the policy in force at the
    decision. A compact row of its own, not a view of Task: it outlives the task (`task_id` is no foreign
    key) and also records submissions refused before any task existed."""

    task_id = models.BigIntegerField(null=True, blank=True, db_index=True, help_text="None for a refused submission.")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    priority = models.SmallIntegerField()
    kind = models.CharField(max_length=32)
    max_wall_seconds = models.PositiveIntegerField(help_text="The task's wall-time budget: caps a guessed duration.")
    arrived_at = models.DateTimeField()
    refused = models.BooleanField(default=False)
    rule = models.CharField(max_length=32, blank=True, help_text="Which limit refused it (QuotaExceeded.rule).")
    admitted_at = models.DateTimeField(null=True, blank=True, help_text="The first admission; later ones are not kept.")
    started_at = models.DateTimeField(null=True, blank=True, help_text="The first claim of its first step.")
    slot_released_at = models.DateTimeField(null=True, blank=True,
                                            help_text="When it first gave its slot back (ended, paused, asked...).")
    finished_at = models.DateTimeField(null=True, blank=True, help_text="Its last end.")
    outcome = models.CharField(max_length=16, blank=True, help_text="Its terminal status, once it ended.")
    # The policy in force at the decision: arrival (or refusal), then overwritten by the first admission.
    weight = models.PositiveIntegerField()
    max_running = models.PositiveIntegerField()
    max_queued = models.PositiveIntegerField()
    system_max_running = models.PositiveIntegerField()
    system_max_queued = models.PositiveIntegerField()
    aging_seconds = models.FloatField()
    shed_threshold = models.FloatField()

    class Meta:
        indexes = [
            # replay.load and retention.purge: decisions in the order they arrived.
            models.Index(fields=["arrived_at", "id"], name="admission_arrived_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}:{self.task_id or 'refused'} at {self.arrived_at:%Y-%m-%d %H:%M:%S}"
