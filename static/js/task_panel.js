// The task panel: the thread's background tasks, Active and Recent, kept fresh by
// adaptive polling of GET /api/threads/<id>/tasks.
//
// Polling: every data-poll-active-ms (3 s) while any task is active, every
// data-poll-idle-ms (15 s) otherwise; never while the tab is hidden (a refresh runs as
// soon as it is visible again); never two requests in flight (a refresh asked for
// during one runs right after it). The thread's stream wakes the panel early when a
// task changes status, so a finished task moves without waiting for the next poll.

import { api } from "./api.js";
import { fromTemplate } from "./dom.js";
import { fullTime, timeAgo } from "./format.js";
import { gettext, interpolate } from "./i18n.js";
import { TaskDetails, cancellingWords } from "./task_details.js";

const STATUS_WORDS = {
  queued: gettext("Queued"),
  running: gettext("Running"),
  waiting_tool: gettext("Running"),
  waiting_input: gettext("Needs your answer"),
  retry_wait: gettext("Retrying soon"),
  paused: gettext("Paused"),
  partial: gettext("Stopped early"),
  succeeded: gettext("Done"),
  failed: gettext("Failed"),
  cancelled: gettext("Cancelled"),
};

const ON_REMOTE_SERVER = gettext("Running on the remote server");
const STOPPING_REMOTE = gettext("Stopping on the remote server");
const PHASE_WORDS = {
  admitted: gettext("Starting"),
  planning: gettext("Planning"),
  searching: gettext("Searching"),
  waiting_tool: gettext("Searching and reading"),
  source_read: gettext("Reading sources"),
  evidence_added: gettext("Collecting evidence"),
  drafting: gettext("Drafting the report"),
  retry_scheduled: gettext("Waiting to retry"),
  input_required: gettext("Waiting for you"),
  step_done: gettext("Working"),
  recovered: gettext("Resuming"),
  paused: gettext("Paused"),
  cancel_requested: gettext("Stopping"),
  remote_started: ON_REMOTE_SERVER,
  progress: ON_REMOTE_SERVER,
  answer_sent: ON_REMOTE_SERVER,
  cancelling_remote: STOPPING_REMOTE,
  remote_cancel_sent: STOPPING_REMOTE,
};

const KIND_WORDS = { research: gettext("Research"), sleep: gettext("Test task"), mcp: gettext("Remote tool") };

// Statuses the assistant tells the thread about (DESIGN §7): the page then expects a message.
const NEWSWORTHY = new Set(["succeeded", "failed", "cancelled", "partial", "waiting_input"]);
const PAUSABLE = new Set(["queued", "running", "waiting_tool", "waiting_input", "retry_wait"]);
const RESUMABLE = new Set(["paused", "partial"]);
// What DELETE /api/tasks/{id} takes: a task nothing will run again without its owner (tasks/deletion.py).
const DELETABLE = new Set(["succeeded", "failed", "cancelled", "partial"]);
const MAX_ERROR_BACKOFF_MS = 60_000;

function phaseWords(task) {
  if (task.is_terminal) return "";
  if (task.cancel_requested && task.cancel_attempts) return cancellingWords(task);
  if (task.status === "queued") return gettext("Waiting for a slot");
  if (task.status === "waiting_input") return gettext("Question for you");
  if (task.status === "paused" || task.status === "partial") return "";
  if (task.tracking_degraded) return gettext("Remote server not answering; still trying");
  return PHASE_WORDS[task.phase] || gettext("Working");
}

/** A server's or the network's message as a sentence, ready for more words after it. */
function sentence(message) {
  const text = message.replace(/^./, (c) => c.toUpperCase());
  return /[.!?。！？]$/.test(text) ? text : `${text}.`;
}

export class TaskPanel {
  /**
   * `onTaskNews(taskId)`: a task reached a status the assistant will post about.
   * `findReport(taskId)` / `onShowReport(element)`: the report message in the thread.
   * `onTaskUpdate(task)`: each row as it is listed (the thread's question forms follow them).
   */
  constructor({ panel, badge, live, deleteDialog, onTaskNews = () => {}, findReport = () => null,
                onShowReport = () => {}, onTaskUpdate = () => {} }) {
    this.panel = panel;
    this.deleteDialog = deleteDialog;
    this.badge = badge;
    this.live = live;
    this.activeList = panel.querySelector("#active-tasks");
    this.recentList = panel.querySelector("#recent-tasks");
    this.loading = panel.querySelector("#panel-loading");
    this.errorBox = panel.querySelector("#panel-error");
    this.activeMs = Number(panel.dataset.pollActiveMs) || 3000;
    this.idleMs = Number(panel.dataset.pollIdleMs) || 15000;
    this.callbacks = { onTaskNews, findReport, onShowReport, onTaskUpdate };

    this.threadId = null;
    this.tasks = new Map(); // id -> the latest row data
    this.rows = new Map(); // id -> <li>
    this.details = new Map(); // id -> TaskDetails of expanded rows
    this.cancelling = new Set();
    this.pausing = new Set();
    this.activeCount = 0;
    this.timer = null;
    this.inFlight = null;
    this.again = false;
    this.stale = false;
    this.failures = 0;
    this.loaded = false;
    this.listedThread = null; // the thread whose task list was drawn at least once
    this.everLoaded = false;

    panel.querySelector("#panel-retry").addEventListener("click", () => this.refresh({ force: true }));
    panel.addEventListener("click", (event) => this.onClick(event));
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) {
        clearTimeout(this.timer);
        this.timer = null;
      } else {
        this.refresh({ force: true });
      }
    });
    // "Started 3 minutes ago" keeps counting between polls.
    setInterval(() => this.renderTimes(), 15_000);
  }

  /** Follow a thread's tasks (null: no thread yet, nothing to show). */
  setThread(threadId) {
    this.threadId = threadId;
    this.panel.querySelector("#panel-scope").textContent = threadId
      ? gettext("Started in this thread") : gettext("Open or start a thread to see its tasks");
    if (threadId) {
      this.loading.hidden = this.loaded;
      return this.refresh({ force: true });
    }
    return Promise.resolve();
  }

  // --- polling ------------------------------------------------------------------------

  /** Load the list now, or right after the request in flight; while hidden, only mark it stale. */
  refresh({ force = false } = {}) {
    if (!this.threadId) return Promise.resolve();
    if (document.hidden && !force) {
      this.stale = true;
      return Promise.resolve();
    }
    if (this.inFlight) {
      this.again = true;
      return this.inFlight;
    }
    clearTimeout(this.timer);
    this.timer = null;
    this.panel.setAttribute("aria-busy", "true");
    this.inFlight = (async () => {
      do {
        this.again = false;
        this.stale = false;
        await this.load();
      } while (this.again);
    })().finally(() => {
      this.inFlight = null;
      this.panel.removeAttribute("aria-busy");
      this.schedule();
    });
    return this.inFlight;
  }

  schedule() {
    clearTimeout(this.timer);
    this.timer = null;
    if (!this.threadId || document.hidden) return;
    let ms = this.activeCount > 0 ? this.activeMs : this.idleMs;
    if (this.failures) ms = Math.min(MAX_ERROR_BACKOFF_MS, this.activeMs * 2 ** (this.failures - 1));
    this.timer = setTimeout(() => this.refresh(), ms);
  }

  async load() {
    const threadId = this.threadId;
    try {
      const data = await api(`/api/threads/${threadId}/tasks`);
      if (threadId !== this.threadId) return;
      this.failures = 0;
      this.everLoaded = true;
      this.panel.removeAttribute("data-unknown");
      this.errorBox.hidden = true;
      // The first list of a thread is what already happened; later ones may bring news.
      this.render(data.results, { first: this.listedThread !== threadId });
      this.listedThread = threadId;
      this.setActiveCount(data.active);
    } catch (error) {
      this.failures += 1;
      const text = error.status === 404 ? gettext("This thread no longer exists.")
        : interpolate(gettext("%(error)s Trying again shortly."), { error: sentence(error.message) });
      this.errorBox.querySelector("[data-error-text]").textContent = text;
      this.errorBox.hidden = false;
      // Never loaded: "Nothing running" would be a guess, so the empty states stay hidden.
      this.panel.toggleAttribute("data-unknown", !this.everLoaded);
      if (error.status === 404) this.threadId = null; // nothing to poll any more
    } finally {
      this.loaded = true;
      this.loading.hidden = true;
    }
  }

  setActiveCount(count) {
    this.activeCount = count;
    this.badge.querySelector("[data-count]").textContent = count > 9 ? "9+" : String(count);
    this.badge.hidden = count === 0;
  }

  /** A status change from the thread's stream: refresh at once if it is news to the panel. */
  noteThreadEvent(item) {
    const known = this.tasks.get(item.task);
    if (known && item.task_seq <= known.last_event_seq) return; // already in the list
    if (NEWSWORTHY.has(item.status)) this.callbacks.onTaskNews(item.task);
    this.refresh();
  }

  /** A message about a task arrived in the thread: an open row can now link to its report. */
  noteTaskMessage(taskId) {
    this.details.get(taskId)?.render();
  }

  // --- rows ---------------------------------------------------------------------------

  render(tasks, { first = false } = {}) {
    const seen = new Set();
    const placed = { active: null, recent: null }; // the last row placed in each list
    for (const task of tasks) {
      seen.add(task.id);
      const before = this.tasks.get(task.id);
      this.tasks.set(task.id, task);
      if (task.is_terminal) this.cancelling.delete(task.id);
      if (!PAUSABLE.has(task.status)) this.pausing.delete(task.id);
      const row = this.rows.get(task.id) || this.createRow(task);
      // Hiding a focused button (Cancel, once the task ended) or moving its row drops the
      // keyboard focus: note where it was, and put it back after.
      const focused = row.contains(document.activeElement) ? document.activeElement : null;
      this.updateRow(row, task);
      const which = task.is_terminal ? "recent" : "active";
      this.place(row, which === "recent" ? this.recentList : this.activeList, placed[which]);
      if (focused && document.activeElement !== focused) {
        (focused.isConnected && !focused.closest("[hidden]") ? focused : row.querySelector(".task-toggle")).focus();
      }
      placed[which] = row;
      if (before && before.status !== task.status) {
        const news = STATUS_WORDS[task.status] || task.status;
        this.announce(interpolate(gettext("%(name)s: %(news)s"), { name: task.name, news }));
      }
      // News the assistant will post about: a status change, or a task new since the last list
      // (a quick one can reach waiting_input before the panel ever saw it running, and its
      // events then arrive already listed).
      const news = before ? before.status !== task.status : !first;
      if (news && NEWSWORTHY.has(task.status)) this.callbacks.onTaskNews(task.id);
      this.callbacks.onTaskUpdate(task);
    }
    for (const [id, row] of this.rows) {
      if (!seen.has(id)) {
        this.details.get(id)?.close();
        this.details.delete(id);
        row.remove();
        this.rows.delete(id);
        this.tasks.delete(id);
      }
    }
  }

  /** Put the row after `previous` in `list`, moving it only if it is elsewhere. */
  place(row, list, previous) {
    const wanted = previous ? previous.nextElementSibling : list.firstElementChild;
    if (row.parentElement === list && row === wanted) return;
    list.insertBefore(row, wanted);
  }

  createRow(task) {
    const row = fromTemplate("task-row-template");
    const id = task.id;
    row.dataset.taskId = id;
    const name = row.querySelector(".task-name");
    name.id = `task-${id}-name`;
    row.querySelector(".task-meta").id = `task-${id}-meta`;
    const toggle = row.querySelector(".task-toggle");
    toggle.setAttribute("aria-labelledby", name.id);
    toggle.setAttribute("aria-describedby", `task-${id}-meta`);
    const details = row.querySelector(".task-details");
    details.id = `task-${id}-details`;
    toggle.setAttribute("aria-controls", details.id);
    this.rows.set(id, row);
    return row;
  }

  updateRow(row, task) {
    row.dataset.status = task.status;
    row.querySelector(".task-name").textContent = task.name || gettext("Untitled task");
    row.querySelector(".status-word").textContent = STATUS_WORDS[task.status] || task.status;
    row.querySelector(".task-kind").textContent = KIND_WORDS[task.kind] || task.kind;
    const details = this.details.get(task.id);
    if (!details || task.is_terminal) row.querySelector(".task-phase").textContent = phaseWords(task);
    this.renderTime(row, task);

    const cancel = row.querySelector('[data-action="cancel"]');
    const cancelling = task.cancel_requested || this.cancelling.has(task.id);
    cancel.hidden = task.is_terminal;
    cancel.textContent = cancelling ? gettext("Cancelling…") : gettext("Cancel");
    cancel.setAttribute("aria-label", interpolate(
      cancelling ? gettext("Cancelling “%(name)s”") : gettext("Cancel “%(name)s”"), { name: task.name }));
    // aria-disabled, not disabled: a disabled button drops keyboard focus.
    cancel.setAttribute("aria-disabled", String(cancelling));

    const pause = row.querySelector('[data-action="pause"]');
    const pausing = this.pausing.has(task.id);
    pause.hidden = !PAUSABLE.has(task.status) || cancelling;
    pause.textContent = pausing ? gettext("Pausing…") : gettext("Pause");
    pause.setAttribute("aria-label", interpolate(
      pausing ? gettext("Pausing “%(name)s”") : gettext("Pause “%(name)s”"), { name: task.name }));
    pause.setAttribute("aria-disabled", String(pausing));

    const resume = row.querySelector('[data-action="resume"]');
    resume.hidden = !RESUMABLE.has(task.status) || cancelling;
    resume.setAttribute("aria-label", interpolate(gettext("Resume “%(name)s”"), { name: task.name }));

    const remove = row.querySelector('[data-action="delete"]');
    remove.hidden = !DELETABLE.has(task.status);
    remove.setAttribute("aria-label", interpolate(gettext("Delete “%(name)s”"), { name: task.name }));

    if (details) details.update(task);
  }

  renderTime(row, task) {
    const since = row.querySelector(".task-since");
    if (task.is_terminal && task.finished_at) {
      const ago = timeAgo(task.finished_at);
      since.textContent = ago ? interpolate(gettext("ended %(ago)s"), { ago }) : gettext("ended just now");
      since.title = fullTime(task.finished_at);
    } else {
      const start = task.started_at || task.created_at;
      const ago = timeAgo(start);
      since.textContent = ago ? interpolate(gettext("started %(ago)s"), { ago }) : gettext("started just now");
      since.title = fullTime(start);
    }
  }

  renderTimes() {
    for (const [id, row] of this.rows) this.renderTime(row, this.tasks.get(id));
  }

  announce(text) {
    this.live.textContent = text;
  }

  // --- actions ------------------------------------------------------------------------

  onClick(event) {
    const cite = event.target.closest("a.cite");
    if (cite) {
      // A citation in a report read here: its source is in the same report, below.
      const target = document.getElementById(cite.getAttribute("href").slice(1));
      if (target) {
        event.preventDefault();
        target.setAttribute("tabindex", "-1");
        target.scrollIntoView({ block: "nearest" });
        target.focus({ preventScroll: true });
      }
      return;
    }
    const toggle = event.target.closest(".task-toggle");
    if (toggle) return this.toggle(toggle.closest(".task-row"));
    const button = event.target.closest("button[data-action]");
    if (!button || button.getAttribute("aria-disabled") === "true") return;
    const row = button.closest(".task-row");
    const action = button.dataset.action;
    if (action === "cancel") this.act(row, "cancel", this.cancelling);
    if (action === "pause") this.act(row, "pause", this.pausing);
    if (action === "resume") this.act(row, "resume", null);
    if (action === "delete") this.confirmDelete(row);
  }

  /** Delete asks first; the row goes once the server has deleted the task. */
  confirmDelete(row) {
    const id = row.dataset.taskId;
    const name = this.tasks.get(id).name;
    const dialog = this.deleteDialog;
    dialog.querySelector("[data-task-name]").textContent = name;
    dialog.returnValue = "";
    dialog.addEventListener("close", async () => {
      if (dialog.returnValue !== "delete") return;
      const errorLine = row.querySelector(".task-row-error");
      errorLine.hidden = true;
      try {
        await api(`/api/tasks/${id}`, { method: "DELETE" });
      } catch (error) {
        if (error.status !== 404) { // already gone is what we wanted
          errorLine.textContent = interpolate(gettext("Couldn't delete: %(error)s"), { error: error.message });
          errorLine.hidden = false;
          return;
        }
      }
      const next = row.nextElementSibling || row.previousElementSibling;
      this.details.get(id)?.close();
      this.details.delete(id);
      row.remove();
      this.rows.delete(id);
      this.tasks.delete(id);
      this.announce(interpolate(gettext("%(name)s: %(news)s"), { name, news: gettext("Deleted") }));
      next?.querySelector(".task-toggle")?.focus();
      this.refresh({ force: true });
    }, { once: true });
    dialog.showModal();
  }

  /** Cancel, pause or resume: the row says so at once, the server catches up. */
  async act(row, action, pendingSet) {
    const id = row.dataset.taskId;
    const errorLine = row.querySelector(".task-row-error");
    errorLine.hidden = true;
    pendingSet?.add(id);
    this.updateRow(row, this.tasks.get(id));
    try {
      await api(`/api/tasks/${id}/${action}`, { method: "POST", body: {} });
      const words = {
        cancel: gettext("Cancel requested"), pause: gettext("Pause requested"), resume: gettext("Resumed"),
      };
      this.announce(interpolate(gettext("%(name)s: %(news)s"), { name: this.tasks.get(id).name, news: words[action] }));
    } catch (error) {
      pendingSet?.delete(id);
      const failed = {
        cancel: gettext("Couldn't cancel: %(error)s"),
        pause: gettext("Couldn't pause: %(error)s"),
        resume: gettext("Couldn't resume: %(error)s"),
      };
      errorLine.textContent = interpolate(failed[action], { error: error.message });
      errorLine.hidden = false;
      this.updateRow(row, this.tasks.get(id));
    }
    this.refresh({ force: true });
  }

  toggle(row, { open } = {}) {
    const id = row.dataset.taskId;
    const toggle = row.querySelector(".task-toggle");
    const expand = open ?? toggle.getAttribute("aria-expanded") !== "true";
    toggle.setAttribute("aria-expanded", String(expand));
    const container = row.querySelector(".task-details");
    container.hidden = !expand;
    if (expand) {
      let details = this.details.get(id);
      if (!details) {
        details = new TaskDetails(container, this.tasks.get(id), {
          onPhase: (event) => this.onLivePhase(row, event),
          onEnded: () => this.refresh({ force: true }),
          onAnswered: () => this.refresh({ force: true }),
          findReport: this.callbacks.findReport,
          onShowReport: this.callbacks.onShowReport,
        });
        this.details.set(id, details);
      }
      details.open();
    } else {
      this.details.get(id)?.close();
    }
  }

  /** A live event of an expanded row: its phase line follows the timeline, not the last poll. */
  onLivePhase(row, event) {
    const task = this.tasks.get(row.dataset.taskId);
    if (!task || task.is_terminal) return;
    let words = PHASE_WORDS[event.kind];
    if (event.kind === "step_done") words = interpolate(gettext("Step %(step)s of %(of)s"), event.data);
    if (words) row.querySelector(".task-phase").textContent = words;
  }

  /** Expand a task's row and bring it into view (from "Show task" in the thread). */
  reveal(taskId) {
    const row = this.rows.get(taskId);
    if (!row) return false;
    this.toggle(row, { open: true });
    row.scrollIntoView({ block: "nearest" });
    row.querySelector(".task-toggle").focus();
    return true;
  }
}
