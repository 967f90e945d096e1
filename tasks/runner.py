"""Execute a claimed task's steps: safe points, the driver, the fenced commit.

One step runs outside any transaction and never waits on the network; its checkpoint,
events, status, the calls it requests and the next kick then commit together, guarded
by the fencing token. Telling a remote server to stop (a cancel round, or abandoning
remote work when a task ends otherwise) is a call requested in that same fenced
transaction, so a worker fenced out stops nothing. When nothing else waits for a
worker, the next step runs in place for a short time slice instead of a broker round trip.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from tasks import clock, kicks, leases, operations, transitions
from tasks.alerts import raise_alert
from tasks.budgets import Budget, retry_at
from tasks.context import StepContext
from tasks.drain import draining
from tasks.drivers import (
    Ask,
    Continue,
    Driver,
    Finish,
    Outcome,
    RemoteCancelling,
    RemoteFacts,
    get_driver,
    remote_cancelling,
)
from tasks.errors import (
    BudgetExhausted,
    CancelRequested,
    InternalError,
    InvalidInput,
    LeaseLost,
    PauseRequested,
    RateLimited,
    RemoteCancelled,
    RemoteFailed,
    StepError,
)
from tasks.events import NewEvent, append
from tasks.heartbeat import heartbeat
from tasks.models import Alert, Checkpoint, Task
from tasks.statuses import ErrorClass
from tasks.stopping import driver_or_none, latest_checkpoint, must_win, reads_checkpoint, stop_as_requested

log = logging.getLogger(__name__)
DEFER_FOR = timedelta(seconds=60)
ALREADY_TRACKED = "this remote task is already tracked by another of your tasks"
MAX_REMOTE_ERROR_CHARS = 4000  # a remote task's last poll or cancel error, as stored
CLAIM_ANSWER_STANDS = 0.05  # seconds: a claim's look at what else waits stands for a step this short


@dataclass
class Turn:
    """One job's turn at running steps, until its slice ends."""

    owner: str
    ends: float  # time.monotonic() when the worker goes back to the broker
    waiting: leases.Waiting | None = None  # what the last step's probe found (None: it did not probe)
    handed_on: bool = False  # the last step released its task with a kick, which carries the work on

    def lasts(self) -> bool:
        return not draining.is_set() and time.monotonic() < self.ends

    def hand_on(self) -> None:
        """Inside the commit of a step whose task is released with its next step due: the kick that carries the
        work on (the turn ends). It is for the task due longest, not for this one: a task handed on waits behind
        the tasks due before it, whose kicks may be this one (kicks.kick_steps)."""
        kicks.kick_due_longest()
        self.handed_on = True


def run(task: Task, *, owner: str) -> None:
    """Run steps of a task this worker has just claimed, then of the tasks due after it, until the
    slice ends, other work waits or nothing is due."""
    turn = Turn(owner, ends=time.monotonic() + settings.LONGHAUL_STEP_SLICE_MS / 1000)
    current: Task | None = task
    carried: dict | None = None
    try:
        while current is not None:
            try:
                kept, carried = run_step(current, turn=turn, carried=carried)
            except LeaseLost:
                # Another worker owns the task now; this one writes nothing more to it.
                log.warning("task %s: lease lost, stopping", current.pk)
                return
            current = kept if kept is not None else _go_on(turn)
    finally:
        if not turn.handed_on:
            # Whatever is due (tasks this turn released without a kick, or another turn's) gets a kick, so the
            # worker it reaches goes on to the rest: a due task always has a kick or a turn on its way.
            kicks.kick_first_due(now=clock.now())


def _go_on(turn: Turn) -> Task | None:
    """The task due longest, claimed, when the turn lasts, other steps are due and no other job waits."""
    if not turn.lasts():
        return None
    waiting = turn.waiting or kicks.waiting(now=clock.now(), besides=0)
    if waiting.jobs or not waiting.steps:
        return None
    return leases.claim_next(owner=turn.owner, now=clock.now())


def run_step(task: Task, *, turn: Turn, carried: dict | None = None) -> tuple[Task | None, dict | None]:
    """One step. Returns the task and the state it checkpointed when this worker keeps the lease for
    the next step, which then runs in place: `carried` is that state, so the next step reads nothing
    the commit before it just wrote or checked (its checkpoint, calls still out, a stop request)."""
    token = task.fencing_token
    now = clock.now()
    turn.waiting, turn.handed_on = None, False
    if task.cancel_requested_at:
        remote = remote_cancelling(driver_or_none(task.kind))
        if remote is not None:
            checkpoint = latest_checkpoint(task)
            if remote.remote_to_cancel(task.pk, checkpoint.state if checkpoint else None):
                return _cancel_remotely(task, token, remote, checkpoint.state if checkpoint else {},
                                        owner=turn.owner), None
        return _stop_at_safe_point(task, token, CancelRequested()), None
    if task.pause_requested_at:
        return _stop_at_safe_point(task, token, PauseRequested()), None
    if task.attempts > settings.LONGHAUL_MAX_ATTEMPTS:
        message = f"gave up after {task.attempts - 1} attempts that never finished the step"
        _end_failed(task, token, ErrorClass.POISON, message)
        with transaction.atomic():
            raise_alert(Alert.Kind.POISON, f"task {task.name!r}: {message}", now=clock.now(), task=task)
        return None, None
    if task.yield_requested_at:  # after the poison check: giving the slot back must not hide a crash loop
        return _yield_slot(task, token), None
    try:
        driver = get_driver(task.kind)
    except InvalidInput as exc:
        return _end_failed(task, token, ErrorClass.PERMANENT, str(exc)), None
    # A remote task's steps are polls, as many as the remote job takes: its wall time bounds it, not a step count.
    steps_done = 0 if remote_cancelling(driver) is not None else task.current_step
    reason = Budget.of(task.budget).exhausted(steps_done=steps_done, started_at=task.started_at, now=now)
    if reason:
        return _end_for_budget(task, token, driver, reason), None

    outcomes: list[operations.OpOutcome] | None = None  # the last step's calls, read with the wait check
    resume, task.resume = task.resume, None  # what the claim read for this step, if it did
    if carried is not None:
        state = carried
    else:
        if task.current_step > 0:
            # The claim read the calls of the step before (none: it asked for none), or they are read now.
            outcomes, waits = (operations.read_outcomes(resume.calls) if resume is not None
                               else operations.outcomes_and_wait(task.pk, task.current_step - 1))
            if waits:
                if _wait_again(task, token):
                    # Resumed (after a pause, say) while calls of the last step were still out: it waits for them.
                    return None, None
                outcomes = None  # they finished meanwhile: the step reads them again
        checkpoint = resume.checkpoint if resume is not None else latest_checkpoint(task)
        if checkpoint is not None and checkpoint.schema_version > driver.schema_version:
            # A newer worker wrote this checkpoint; leave the task for a worker that can read it.
            log.warning("task %s: checkpoint schema %s is newer than %s", task.pk, checkpoint.schema_version,
                        driver.schema_version)
            return _defer(task, token, reason=f"needs a worker that reads checkpoint schema "
                                              f"{checkpoint.schema_version}"), None
        state = checkpoint.state if checkpoint else driver.initial_state(task.input)

    # The claim or the commit that handed this worker the task read its stop requests and fencing token
    # a moment ago: the step's first safe point need not read them again.
    ctx = StepContext(task, token=token, checked=True, outcomes=outcomes)
    heartbeat.hold(task.pk, owner=turn.owner, token=token)
    try:
        ctx.check_safe_point()
        outcome = driver.step(state, ctx)
    except (CancelRequested, PauseRequested) as stop:
        return _stop_at_safe_point(task, token, stop), None
    except BudgetExhausted as exc:
        return _end_for_budget(task, token, driver, str(exc), state=exc.state), None
    except StepError as exc:
        return _after_error(task, token, exc), None
    except LeaseLost:
        raise
    except Exception as exc:  # a bug in a driver must not crash-loop the worker
        log.exception("task %s: step %s raised", task.pk, task.current_step)
        return _after_error(task, token, InternalError(f"internal error ({type(exc).__name__})",
                                                       detail=traceback.format_exc())), None
    finally:
        heartbeat.drop(task.pk)

    # The task's next step: in place when nothing else waits; at the back of the line, with no kick, when
    # other tasks' steps are due (this worker goes on to the task due longest); else by a kick.
    if isinstance(outcome, Continue) and turn.lasts():
        turn.waiting = _claim_still_says(resume)
        if turn.waiting is None:
            turn.waiting = kicks.waiting(now=clock.now(), besides=task.pk)
    going_on = turn.waiting is not None and not turn.waiting.jobs
    kept = _commit(task, token, driver, outcome, ctx, keep_lease=going_on and not turn.waiting.steps,
                   hand_on=None if going_on else turn.hand_on, state_before=state)
    # What a step resumed from the database would read: JSON, so a step run in place sees the same types.
    return kept, (json.loads(json.dumps(outcome.state)) if kept is not None else None)


def _claim_still_says(resume: leases.Resume | None) -> leases.Waiting | None:
    """What the claim of this step's task found waiting besides it, if the claim was a moment ago: the step
    commits by that answer instead of asking again. It is as old as the claim (from the moment it was sent)
    and the step together; older than CLAIM_ANSWER_STANDS, the step asks again. Stale, it costs one step: a
    job that came meanwhile waits for this worker's next look (the step in place after this one asks; the
    next claim answers again), and a step thought due that another worker took leaves this one to take the
    next due task or end its turn."""
    if resume is None or resume.waiting is None or time.monotonic() - resume.read_at > CLAIM_ANSWER_STANDS:
        return None
    return resume.waiting


def _commit(task: Task, token: int, driver: Driver, outcome: Outcome, ctx: StepContext, *,
            keep_lease: bool, hand_on: Callable[[], None] | None = kicks.kick_due_longest,
            state_before: dict | None = None) -> Task | None:
    """`hand_on` kicks for a task released with its next step due now (Turn.hand_on); None: no kick, the
    worker goes on to the task due longest (and kicks the task due longest when its turn ends)."""
    now = clock.now()
    events = [*ctx.events, *outcome.events]
    tried = False
    if _plain(outcome) and (keep_lease or hand_on is None) and transitions.commits_alone(events):
        # The common step with nothing to write beside it (no kick: the task stays with this worker, or the
        # worker goes on to the task due longest): its fenced statement commits by itself, with no BEGIN and
        # COMMIT round trips. When it loses, it wrote nothing: the locked commit below decides.
        if transitions.commit_step(task, token=token, now=now, keep_lease=keep_lease, events=events,
                                   guard=transitions.NO_STOP_REQUESTED, alone=True,
                                   checkpoint=_checkpoint(task, token, driver, outcome.state, now=now)):
            return task if keep_lease else None
        tried = True
    elif (_asks_for_calls(outcome) and _due_now_at_the_gateway(outcome, now)
          and transitions.calls_commit_alone(events, tool=_asks_for_tools(outcome))
          and not _quiet(outcome, state_before, events, task.current_step)):
        # A step that asks for calls a gateway job runs now (research): the move, its checkpoint, its events, the
        # calls and their gateway kick (while a turn is free) in one fenced statement that commits by
        # itself. It loses, writing nothing, when the lease moved on, a stop or the slot back was asked for, or a
        # pool of its calls is paused (news the locked commit below writes with the move).
        if _wait_for_requests(task, token, outcome, events, now=now, guard=transitions.NO_STOP_REQUESTED,
                              checkpoint=_checkpoint(task, token, driver, outcome.state, now=now), alone=True):
            return None
        tried = True
    with transaction.atomic():
        if _plain(outcome) and not tried:
            # The common step, checkpoint and next step due, in one fenced statement with no row read first:
            # it loses (and writes nothing) when the lease moved on or a stop was asked for since the
            # task was read, and the step is then committed below, under the row lock.
            won = transitions.commit_step(task, token=token, now=now, keep_lease=keep_lease, events=events,
                                          guard=transitions.NO_STOP_REQUESTED,
                                          checkpoint=_checkpoint(task, token, driver, outcome.state, now=now))
            if won:
                if not keep_lease:
                    if hand_on is not None:
                        hand_on()
                    return None
                return task
        elif _asks_for_calls(outcome) and not tried and not _quiet(outcome, state_before, events, task.current_step):
            # A step that asks for calls (research, MCP): the same fenced statement with no row read first (the
            # checkpoint its own), then its calls; the locked commit below when it loses.
            if _wait_for_requests(task, token, outcome, events, now=now, guard=transitions.NO_STOP_REQUESTED,
                                  checkpoint=_checkpoint(task, token, driver, outcome.state, now=now)):
                return None
        elif isinstance(outcome, Finish) and outcome.remote is None:
            # A step that ends the task: the same fenced statement writes its checkpoint and the end, with no row
            # read first; when it loses (the lease moved on, or a stop was asked for: a remote task's cancel
            # discards what its step learned), the locked commit below decides.
            if transitions.succeed(task, token=token, now=now, result=outcome.result, events=events,
                                   guard=transitions.NO_STOP_REQUESTED,
                                   checkpoint=_checkpoint(task, token, driver, outcome.state, now=now)):
                return None
        fresh = leases.lock_fenced(task.pk, token)
        if fresh.cancel_requested_at and remote_cancelling(driver) is not None:
            # What a step learned from a remote server after the cancel request is discarded (DESIGN §10).
            stop_as_requested(fresh, now=now, token=token)
            return None
        if outcome.remote is not None and not _remember_remote(fresh, token, outcome.remote):
            must_win(transitions.fail(fresh, now=now, token=token, error_class=ErrorClass.PERMANENT,
                                      message=ALREADY_TRACKED))
            # No abandon: the remote task is another task's work, which must go on.
            return None
        quiet = _quiet(outcome, state_before, events, fresh.current_step)
        if not quiet:
            _checkpoint(fresh, token, driver, outcome.state, now=now).save(force_insert=True)
        if isinstance(outcome, Finish):
            # A late cancel loses to a finished result: the work is done and recorded.
            must_win(transitions.succeed(fresh, token=token, now=now, result=outcome.result, events=events))
            return None
        stop_requested = bool(fresh.cancel_requested_at or fresh.pause_requested_at)
        if isinstance(outcome, Ask) and not stop_requested:
            asking_step = fresh.current_step
            must_win(transitions.wait_input(fresh, token=token, now=now, question=outcome.question, events=events,
                                            form=outcome.form))
            if outcome.watch is not None:
                # Runs while the owner thinks; tasks/operations.py withdraws the question if the remote moved on.
                due = operations.request_watch(fresh, token=token, watch=outcome.watch, now=now, step=asking_step)
                kicks.kick_calls(task.pk, at=due)
            return None
        if isinstance(outcome, Continue) and outcome.requests and not stop_requested:
            must_win(_wait_for_requests(fresh, token, outcome, events, now=now, step_done=not quiet))
            return None
        # Asked to give its slot back: the step commits, then the task queues again (in the same transaction).
        yielding = fresh.yield_requested_at is not None and isinstance(outcome, Continue)
        keep = keep_lease or stop_requested or yielding
        must_win(transitions.commit_step(fresh, token=token, now=now, keep_lease=keep and not isinstance(outcome, Ask),
                                     events=events))
        if stop_requested:
            stop_as_requested(fresh, now=now, token=token)
            return None
        if yielding:
            must_win(transitions.yield_slot(fresh, token=token, now=now))
            return None
        if not keep:
            if hand_on is not None:
                hand_on()
            return None
        return fresh


def _checkpoint(task: Task, token: int, driver: Driver, state: dict, *, now: datetime) -> Checkpoint:
    """The checkpoint of the step `task` is at, unsaved: the commit that moves the task on writes it."""
    return Checkpoint(task=task, step=task.current_step + 1, fencing_token=token, state=state,
                      schema_version=driver.schema_version, at=now)


def _plain(outcome: Outcome) -> bool:
    """A step that only moves the task on: no calls to wait for, no remote facts, no end, no question."""
    return isinstance(outcome, Continue) and not outcome.requests and outcome.remote is None


def _asks_for_calls(outcome: Outcome) -> bool:
    """A step that moves the task on to wait for its calls, learning no remote facts."""
    return isinstance(outcome, Continue) and bool(outcome.requests) and outcome.remote is None


def _asks_for_tools(outcome: Continue) -> bool:
    return any(r.kind == "tool" for r in outcome.requests)


def _due_now_at_the_gateway(outcome: Continue, now: datetime) -> bool:
    """Calls a gateway job runs as soon as it claims them: of no remote server (whose task the step follows
    with transitions.wait_for_remote), none put off to later (whose kick is the step's to write, for then)."""
    return all(r.kind != "mcp" and (r.not_before is None or r.not_before <= now) for r in outcome.requests)


def _quiet(outcome: Outcome, state_before: dict | None, events: list[NewEvent], current_step: int) -> bool:
    """A poll that learned nothing new is no step: no checkpoint (the last one says the same) and no step
    counted, only its next poll, which joins the calls of the step that asked for the first."""
    return (isinstance(outcome, Continue) and bool(outcome.requests) and outcome.state == state_before
            and not events and current_step > 0)


def _wait_for_requests(task: Task, token: int, outcome: Continue, events: list[NewEvent], *, now: datetime,
                       step_done: bool = True, guard: Q | None = None, checkpoint: Checkpoint | None = None,
                       alone: bool = False) -> bool:
    """In the step's commit: store the calls the step asked for and wait for them, holding no worker;
    False (nothing written) when the fenced UPDATE lost. `step_done=False`: the step counts for nothing,
    and its calls join those of the step before. `guard`, `checkpoint`: as transitions.commit_step's.
    `alone`: outside any transaction, the calls stored by the fenced statement, which commits by itself and
    loses too while a pool of the calls is paused (runner._commit says when it may)."""
    step = task.current_step if step_done else task.current_step - 1  # before the transition moves it on
    if any(r.kind == "mcp" for r in outcome.requests):
        # The remote tool is working: the task says running while its calls (and polls) are out.
        won = transitions.wait_for_remote(task, token=token, now=now, events=events, step_done=step_done,
                                          tracking_degraded=outcome.tracking_degraded, guard=guard,
                                          checkpoint=checkpoint)
    else:
        assert step_done or not alone, "a step that counts for nothing adds its calls to the step before's (request())"
        calls = operations.new_calls(task, token=token, requests=outcome.requests, now=now, step=step) if alone else ()
        # Stored by the move's own statement, which kicks a gateway job for them too (every call is due now, and
        # none of their pools is paused: the move's guard).
        kick = kicks.calls_kick_in_move(task.pk) if calls else None
        won = transitions.wait_for_operations(task, token=token, now=now, tool=_asks_for_tools(outcome), events=events,
                                              step_done=step_done, guard=guard, checkpoint=checkpoint, calls=calls,
                                              also=kick)
        if won and calls:
            return True
    if not won:
        return False
    due = operations.request(task, token=token, requests=outcome.requests, now=now, step=step, new_step=step_done)
    kicks.kick_calls(task.pk, at=due)
    return True


def _cancel_remotely(task: Task, token: int, driver: RemoteCancelling, state: dict, *, owner: str) -> None:
    """One round of telling a remote server to stop, as calls a gateway job makes; the task ends
    cancelled once the remote has stopped, is gone, or did not confirm in time."""
    ctx = StepContext(task, token=token)
    heartbeat.hold(task.pk, owner=owner, token=token)
    try:
        outcome = driver.cancel_step(state, ctx)
    except LeaseLost:
        raise
    except Exception:  # a bug here must not keep the task from ending: cancel it here, saying so
        log.exception("task %s: remote cancel round failed", task.pk)
        ctx.events.append(NewEvent("remote_cancel_unconfirmed",
                                   {"message": "asking the remote server to stop failed"}))
        outcome = None
    finally:
        heartbeat.drop(task.pk)
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        if outcome is not None and outcome.remote is not None:
            _remember_remote(fresh, token, outcome.remote)
        if outcome is None or not outcome.requests:
            events = [*ctx.events, *(outcome.events if outcome else [])]
            if events:
                append(fresh, events, status=fresh.status, at=now)
            must_win(transitions.cancel(fresh, now=now, token=token))
            return None
        events = [*ctx.events, *outcome.events]
        if outcome.state != state or events:
            _checkpoint(fresh, token, get_driver(task.kind), outcome.state, now=now).save(force_insert=True)
        must_win(_wait_for_requests(fresh, token, outcome, events, now=now))
    return None


def _remember_remote(task: Task, token: int, facts: RemoteFacts) -> bool:
    """Inside the fenced commit: store what the step learned about its remote task on the task row.
    False when the handle is one this owner already tracks on that server (nothing is written then)."""
    fields = remote_fields(facts)
    if not fields:
        return True
    try:
        with transaction.atomic():  # a savepoint: a refused handle leaves the step's transaction usable
            Task.objects.filter(pk=task.pk, fencing_token=token).update(**fields)
    except IntegrityError:
        if facts.handle is None:
            raise
        log.info("task %s: its remote task is already tracked by another task of its owner", task.pk)
        return False
    for name, value in fields.items():
        setattr(task, name, value)
    return True


def remote_fields(facts: RemoteFacts) -> dict[str, Any]:
    """The task columns a RemoteFacts sets (None leaves a column as it is)."""
    fields: dict[str, Any] = {}
    if facts.handle is not None:
        fields["remote_handle"] = facts.handle or None
    if facts.server is not None:
        fields["remote_server"] = facts.server[:64]
    if facts.poll_error is not None:
        fields["remote_poll_error"] = facts.poll_error[:MAX_REMOTE_ERROR_CHARS]
    if facts.cancel_attempts is not None:
        fields["remote_cancel_attempts"] = max(0, facts.cancel_attempts)
    if facts.cancel_error is not None:
        fields["remote_cancel_error"] = facts.cancel_error[:MAX_REMOTE_ERROR_CHARS]
    return fields


def _defer(task: Task, token: int, *, reason: str) -> None:
    """Leave the task for a worker that reads its checkpoint. A stop asked for since the claim goes first
    when it needs nothing from that checkpoint (a pause, a plain cancel): deferred, it would wait a minute
    unread. A cancel keeping results, or one that stops remote work, reads the checkpoint: it waits for a
    worker that can."""
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        if (fresh.cancel_requested_at or fresh.pause_requested_at) and not reads_checkpoint(fresh):
            stop_as_requested(fresh, now=now, token=token)
            return None
        must_win(transitions.defer(fresh, token=token, now=now, until=now + DEFER_FOR, reason=reason))
    return None


def _wait_again(task: Task, token: int) -> bool:
    """Wait for the last step's calls again; False when they all finished meanwhile. True also when a stop
    asked for since the claim ended or paused the task instead.

    Checked again under the row lock: a call that finished after the first look found the task
    claimed (not waiting), so it did not make the task due, and a wait now would be forever.
    """
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        if fresh.cancel_requested_at or fresh.pause_requested_at:
            # Asked since the claim, which saw the lease held and left the stop to this holder: it goes first,
            # or the task would wait for its calls (a poll an hour away) before anything acted on it.
            stop_as_requested(fresh, now=now, token=token)
            return True
        step = task.current_step - 1
        if not operations.unfinished(task.pk, step):
            return False
        if operations.waits_on(task.pk, step, "mcp"):
            must_win(transitions.wait_for_remote(fresh, token=token, now=now, events=[], step_done=False))
        else:
            tool = operations.waits_on_tool(task.pk, step)
            must_win(transitions.wait_for_operations(fresh, token=token, now=now, tool=tool, events=[],
                                                 step_done=False))
        kicks.kick_calls(task.pk, at=operations.first_due(task.pk, step, now))
    return True


def _yield_slot(task: Task, token: int) -> None:
    """Give the slot back before the step runs (admission asked, tasks/scheduling.py)."""
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        if fresh.cancel_requested_at or fresh.pause_requested_at:
            stop_as_requested(fresh, now=now, token=token)  # a stop asked for since the claim goes first
            return
        must_win(transitions.yield_slot(fresh, token=token, now=now))


def _stop_at_safe_point(task: Task, token: int, stop: CancelRequested | PauseRequested) -> None:
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        stop_as_requested(fresh, now=clock.now(), token=token)
    return None


def _end_failed(task: Task, token: int, error_class: str, message: str, detail: str = "",
                result: dict | None = None) -> None:
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        must_win(transitions.fail(fresh, now=now, token=token, error_class=error_class, message=message, detail=detail,
                              result=result))
        # Remote work must not outlive the task: a call to stop it, in the fenced end (a worker fenced out
        # raised LeaseLost above, so it never stops its successor's remote job).
        operations.request_abandon(fresh, now=now)
    return None


def _end_for_budget(task: Task, token: int, driver: Driver, reason: str, *, state: dict | None = None) -> None:
    """End partial with what the work so far can deliver, or failed when it delivers nothing.
    `state`: what the step that ran out had learned; it is checkpointed first, as a counted step."""
    now = clock.now()
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        checkpointed = state is not None
        if checkpointed:
            _checkpoint(fresh, token, driver, state, now=now).save(force_insert=True)
        else:
            checkpoint = latest_checkpoint(fresh)
            state = checkpoint.state if checkpoint else None
        partial = driver.partial_result(state) if state else None
        if partial is not None:
            must_win(transitions.finish_partial(fresh, now=now, token=token, result=partial.result,
                                            scope=f"{partial.scope}; stopped by budget ({reason})",
                                            reason="budget_exhausted", step_done=checkpointed))
        else:
            must_win(transitions.fail(fresh, now=now, token=token, error_class=ErrorClass.BUDGET_EXHAUSTED,
                                  message=f"stopped before any result: {reason}", step_done=checkpointed))
        operations.request_abandon(fresh, now=now)  # in the fenced end, as in _end_failed
    return None


def _after_error(task: Task, token: int, exc: StepError) -> None:
    budget = Budget.of(task.budget)
    if isinstance(exc, RemoteCancelled):
        now = clock.now()
        with transaction.atomic():
            fresh = leases.lock_fenced(task.pk, token)
            must_win(transitions.cancel(fresh, now=now, token=token, reason=str(exc)))
        return None
    if not exc.retryable:
        return _end_failed(task, token, exc.error_class, str(exc), exc.detail,
                           result=exc.result if isinstance(exc, RemoteFailed) else None)
    if task.retries >= budget.max_retries:
        return _end_failed(task, token, exc.error_class,
                           f"gave up after {task.retries} retries: {exc}", exc.detail)
    now = clock.now()
    hint = exc.retry_after if isinstance(exc, RateLimited) else None
    run_at = retry_at(now, task.retries, hint=hint)
    with transaction.atomic():
        fresh = leases.lock_fenced(task.pk, token)
        must_win(transitions.schedule_retry(fresh, token=token, now=now, run_at=run_at,
                                        error_class=exc.error_class, message=str(exc)[:500]))
        kicks.kick("advance", task.pk, at=run_at)
    return None

