// The expanded part of a task row: what the task is doing and has done.
//
// While open it follows the task's events over its WebSocket (openTaskStream resumes
// from the last seq it saw, so a reconnect neither repeats nor skips an event) and
// draws them as a timeline; it reads the task's detail (steps, retries, budget) and,
// once there is one, its result (sources, evidence, usage).

import { api } from "./api.js";
import { h } from "./dom.js";
import { clockTime, duration, number, shortTime } from "./format.js";
import { gettext, interpolate, ngettext } from "./i18n.js";
import { renderMarkdown } from "./markdown.js";
import { questionForm } from "./question_form.js";
import { openTaskStream } from "./task_stream.js";

// Why a task failed or a source was skipped (tasks.statuses.ErrorClass), in words.
const ERROR_WORDS = {
  transient: gettext("transient"),
  rate_limited: gettext("rate limited"),
  timeout: gettext("timeout"),
  invalid_input: gettext("invalid input"),
  permanent: gettext("permanent"),
  budget_exhausted: gettext("budget exhausted"),
  cancelled: gettext("cancelled"),
  poison: gettext("poison"),
  queue_timeout: gettext("queue timeout"),
  internal: gettext("internal"),
  error: gettext("error"),
};

function errorWords(errorClass) {
  const key = errorClass || "error";
  return ERROR_WORDS[key] || key.replace(/_/g, " ");
}

// Why a task that had started waits for a slot again (transitions.requeue_failed, transitions.yield_slot).
const QUEUED_AGAIN = {
  requeued: () => gettext("Queued again"),
  yielded: () => gettext("Gave its slot to waiting work; it goes on at its next turn"),
};

const EVENT_WORDS = {
  queued: (d) => (QUEUED_AGAIN[d.reason] || (() => gettext("Queued")))(),
  admitted: () => gettext("Started"),
  planning: () => gettext("Planning sub-questions"),
  plan_ready: (d) => interpolate(
    ngettext("Planned %(count)s sub-question", "Planned %(count)s sub-questions", d.subquestions),
    { count: d.subquestions }),
  searching: (d) => interpolate(
    d.rephrased ? gettext("Searching again: “%(query)s”") : gettext("Searching: “%(query)s”"), d),
  source_read: (d) => interpolate(gettext("Read source [%(n)s] %(title)s"), d),
  source_skipped: (d) => (d.error_class
    ? interpolate(gettext("Skipped a source (%(reason)s)"), { reason: errorWords(d.error_class) })
    : gettext("Skipped a source")),
  evidence_added: (d) => interpolate(ngettext("Found %(count)s quote for sub-question %(subquestion)s",
    "Found %(count)s quotes for sub-question %(subquestion)s", d.count), d),
  drafting: (d) => interpolate(gettext("Drafting the report from %(evidence)s quotes"), d),
  result_ready: (d) => interpolate(
    ngettext("Report ready, citing %(sources)s source", "Report ready, citing %(sources)s sources", d.sources), d),
  step_done: (d) => interpolate(gettext("Step %(step)s of %(of)s done"), d),
  waiting_tool: () => gettext("Waiting for searches and reads"),
  tool_results_ready: () => gettext("Results in"),
  retry_scheduled: (d) => interpolate(
    gettext("Will retry after an error (%(reason)s)"), { reason: errorWords(d.error_class) }),
  retrying: () => gettext("Retrying"),
  pool_paused: (d) => interpolate(gettext("Waiting for the %(pool)s pool: rate limited until %(until)s"),
    { pool: d.pool, until: shortTime(d.until) }),
  recovered: () => gettext("Picked up again after a worker stopped"),
  input_required: (d) => interpolate(gettext("Asked: %(question)s"), d),
  input_received: () => gettext("Got your answer"),
  pause_requested: () => gettext("Pause requested"),
  paused: () => gettext("Paused"),
  cancel_requested: () => gettext("Cancel requested"),
  cancelled: () => gettext("Cancelled"),
  partial: (d) => (d.scope ? interpolate(gettext("Stopped early: %(scope)s"), d) : gettext("Stopped early")),
  succeeded: () => gettext("Finished"),
  failed: (d) => interpolate(gettext("Failed: %(reason)s"), { reason: errorWords(d.error_class) }),
  deferred: () => gettext("Waiting for a free slot"),
  stalled: () => gettext("No progress for a while"),
  lease_released: () => gettext("Handed back by its worker"),
  remote_started: (d) => (d.server ? interpolate(gettext("Started %(tool)s on %(server)s"), d)
    : interpolate(gettext("Started %(tool)s"), d)),
  question_withdrawn: () => gettext("The question was withdrawn"),
  progress: (d) => d.message,
  answer_sent: () => gettext("Sent your answer to the remote tool"),
  tracking_degraded: () => gettext("The remote server stopped answering; still trying"),
  tracking_restored: () => gettext("The remote server answers again"),
  cancelling_remote: () => gettext("Asking the remote server to stop"),
  remote_cancel_sent: () => gettext("The remote server was asked to stop"),
  remote_cancel_unconfirmed: (d) => (d.attempts
    ? interpolate(ngettext("The remote server did not confirm the stop after %(attempts)s attempt",
      "The remote server did not confirm the stop after %(attempts)s attempts", d.attempts), d)
    : gettext("The remote server did not confirm the stop")),
};

/** "Cancelling… (attempt 2: the server did not answer)": a remote task's cancel, while it is retried. */
export function cancellingWords(task) {
  if (!task.cancel_attempts) return gettext("Cancelling…");
  const words = task.cancel_error
    ? gettext("Cancelling… (attempt %(attempt)s: the server did not answer)")
    : gettext("Cancelling… (attempt %(attempt)s)");
  return interpolate(words, { attempt: task.cancel_attempts });
}

/** The words for one event of the timeline. */
export function describeEvent(event) {
  const words = EVENT_WORDS[event.kind];
  return words ? words(event.data || {}) : event.kind.replace(/_/g, " ");
}

const NOTIFICATION_WORDS = {
  retry: gettext("Posting the update to this thread failed; Longhaul is retrying."),
  dead_letter: gettext(
    "The update could not be posted to this thread. An admin can send it again from the admin pages."),
};

function fact(label, value) {
  return value === null || value === undefined || value === "" ? null : [h("dt", {}, label), h("dd", {}, value)];
}

/** "12 of 200 allowed": what a budget allows is the task's limit, not a goal. */
function used(count, limit) {
  if (!limit) return number(count);
  return interpolate(gettext("%(count)s of %(limit)s allowed"), { count: number(count), limit: number(limit) });
}

const DETAIL_REFRESH_MS = 2000; // at most this often while events stream in

export class TaskDetails {
  /**
   * `element` is the row's details container. Callbacks: onPhase(event) for the row's
   * phase line, onEnded() when the stream says the task ended, onAnswered() after an
   * answer was accepted, findReport(taskId) for the task's report message in the thread
   * (or null) and onShowReport(message) to bring it into view.
   */
  constructor(element, task, { onPhase, onEnded, onAnswered, findReport, onShowReport }) {
    this.element = element;
    this.task = task;
    this.callbacks = { onPhase, onEnded, onAnswered, findReport, onShowReport };
    this.events = new Map(); // seq -> event: each drawn once, in order
    this.lastSeq = 0;
    this.stream = null;
    this.streamStatus = "";
    this.ended = false;
    this.detail = null;
    this.result = null;
    this.resultVersion = 0;
    this.answerDraft = {}; // what was typed into the answer form, kept while the form is redrawn
    this.answered = null; // {question, words} given here, shown from then on
    this.build();
  }

  build() {
    const id = this.task.id;
    this.notes = h("div", { class: "detail-notes" });
    this.facts = h("dl", { class: "facts" });
    this.resultBox = h("div", { class: "detail-result" });
    this.liveLabel = h("span", { class: "live-label", role: "status" });
    this.timeline = h("ol", { class: "timeline", "aria-labelledby": `timeline-${id}` });
    this.timelineEmpty = h("p", { class: "timeline-empty" }, gettext("Loading the timeline…"));
    this.element.replaceChildren(
      this.notes,
      this.facts,
      this.resultBox,
      h("div", { class: "timeline-head" }, h("h4", { id: `timeline-${id}` }, gettext("Timeline")), this.liveLabel),
      this.timelineEmpty,
      this.timeline,
    );
  }

  open() {
    this.render();
    this.follow();
    this.loadDetail();
    this.loadResult();
  }

  close() {
    if (this.stream) this.stream.close();
    this.stream = null;
    this.setLive("");
  }

  /** A fresher panel row for this task arrived. */
  update(task) {
    const before = this.task;
    this.task = task;
    if (before.status !== task.status) this.loadDetail();
    if (task.result_version !== this.resultVersion) this.loadResult();
    if (!this.stream && !this.ended && !task.is_terminal) this.follow();
    this.render();
  }

  follow() {
    if (this.stream) return;
    this.stream = openTaskStream(this.task.id, {
      after: this.lastSeq,
      onEvent: (event) => this.addEvent(event),
      onEnd: () => {
        this.ended = true;
        // A finished task sends nothing more worth a socket; the timeline stays.
        this.close();
        this.loadDetail();
        this.callbacks.onEnded();
      },
      onStatus: (status) => this.setLive(status),
    });
  }

  setLive(status) {
    this.streamStatus = status;
    const words = {
      live: gettext("Live"), reconnecting: gettext("Reconnecting…"), polling: gettext("Checking every few seconds"),
    };
    this.liveLabel.textContent = words[status] || "";
    this.liveLabel.dataset.state = status;
  }

  addEvent(event) {
    if (this.events.has(event.seq)) return;
    this.events.set(event.seq, event);
    const inOrder = event.seq > this.lastSeq;
    this.lastSeq = Math.max(this.lastSeq, event.seq);
    this.timelineEmpty.hidden = true;
    const item = h("li", { dataset: { seq: event.seq, kind: event.kind } },
      h("time", { datetime: event.at }, clockTime(event.at)),
      h("span", {}, describeEvent(event)));
    // Events come in seq order; a stray older one would still land in its place.
    const later = inOrder ? null : [...this.timeline.children].find((li) => Number(li.dataset.seq) > event.seq);
    this.timeline.insertBefore(item, later || null);
    this.callbacks.onPhase(event);
    this.renderFacts();
    this.loadDetailSoon();
  }

  /** Steps and retries move with the events; read them again, but not for every event. */
  loadDetailSoon() {
    if (this.detailTimer) return;
    this.detailTimer = setTimeout(() => {
      this.detailTimer = null;
      if (this.stream) this.loadDetail();
    }, DETAIL_REFRESH_MS);
  }

  async loadDetail() {
    try {
      this.detail = await api(`/api/tasks/${this.task.id}`);
      this.renderFacts();
    } catch {
      // The row still shows what the panel knows; the next refresh tries again.
    }
  }

  async loadResult() {
    const version = this.task.result_version;
    if (!version || version === this.resultVersion) return;
    try {
      const data = await api(`/api/tasks/${this.task.id}/result`);
      this.result = data.result || {};
      this.resultVersion = data.result_version;
      this.render();
    } catch {
      // 409 not_ready is a race with the panel's list; the next update asks again.
    }
  }

  render() {
    this.renderNotes();
    this.renderFacts();
    this.renderResult();
    if (!this.events.size && (this.ended || this.task.is_terminal) && !this.stream) {
      this.timelineEmpty.textContent = gettext("No events recorded.");
    }
  }

  renderNotes() {
    const task = this.task;
    // Rebuilt only when what they say changes: an answer being typed must survive a refresh.
    const key = JSON.stringify([task.status, task.cancel_requested, task.error_class, task.error_message,
                                task.notification, task.question, task.question_fields, task.tracking_degraded,
                                task.remote_error, task.cancel_attempts, task.cancel_error, this.answered]);
    if (key === this.notesKey) return;
    this.notesKey = key;
    const notes = [];
    if (task.cancel_requested && !task.is_terminal) {
      notes.push(h("p", { class: "note", dataset: { cancelling: "" } }, task.cancel_attempts
        ? cancellingWords(task) : gettext("Cancelling: the task stops at its next safe point.")));
      if (task.cancel_error) notes.push(h("p", { class: "note-detail" }, task.cancel_error));
    }
    if (task.tracking_degraded && !task.is_terminal) {
      notes.push(h("div", { class: "note warning" },
        h("strong", {}, gettext("The remote server stopped answering; Longhaul keeps trying.")),
        task.remote_error ? h("p", {}, interpolate(gettext("Last error: %(error)s"), { error: task.remote_error }))
          : null));
    }
    if (task.status === "paused") {
      notes.push(h("p", { class: "note" }, gettext("Paused with everything it has done so far. Resume to go on.")));
    }
    if (task.status === "failed") {
      notes.push(h("div", { class: "note error" },
        h("strong", {}, interpolate(gettext("Failed: %(reason)s"), { reason: errorWords(task.error_class) })),
        task.error_message ? h("p", {}, task.error_message) : null));
    }
    if (task.notification && NOTIFICATION_WORDS[task.notification]) {
      notes.push(h("p", { class: "note warning", dataset: { notification: task.notification } },
        NOTIFICATION_WORDS[task.notification]));
    }
    const answeredThis = this.answered && this.answered.question === task.question;
    if (task.status === "waiting_input" && !answeredThis) notes.push(this.answerForm());
    if (this.answered) notes.push(h("p", { class: "note", role: "status" }, this.answered.words));
    this.notes.replaceChildren(...notes);
  }

  answerForm() {
    return questionForm(this.task, {
      fields: this.task.question_fields || [],
      draft: this.answerDraft,
      onAnswered: (words) => {
        this.answered = { question: this.task.question, words };
        this.renderNotes();
        this.callbacks.onAnswered();
      },
    });
  }

  renderFacts() {
    const task = this.task;
    const detail = this.detail || {};
    const budget = detail.budget || {};
    const usage = (this.result && this.result.usage) || null;
    const started = task.started_at || task.created_at;
    const end = task.finished_at ? Date.parse(task.finished_at) : Date.now();
    const sources = this.sourceList();
    const evidence = this.evidenceCount();
    const rows = [
      fact(task.is_terminal ? gettext("Took") : gettext("Running for"),
        duration(Math.max(0, end - Date.parse(started)))),
      fact(gettext("Steps taken"),
        detail.current_step !== undefined ? used(detail.current_step, budget.max_steps) : null),
      fact(gettext("Retries"), detail.retries ? used(detail.retries, budget.max_retries) : null),
      fact(gettext("Sources read"), task.kind === "research" || sources.length ? number(sources.length) : null),
      fact(gettext("Evidence"), evidence !== null
        ? interpolate(ngettext("%(count)s quote", "%(count)s quotes", evidence), { count: number(evidence) }) : null),
      fact(gettext("Model calls"), usage ? used(usage.model_calls || 0, budget.max_model_calls) : null),
      fact(gettext("Tool calls"), usage ? used(usage.tool_calls || 0, budget.max_tool_calls) : null),
      fact(gettext("Tokens"), usage ? used(usage.tokens || 0, budget.max_tokens) : null),
      fact(gettext("Model"), detail.model_name && detail.prompt_version
        ? interpolate(gettext("%(model)s, prompts version %(version)s"),
          { model: detail.model_name, version: detail.prompt_version }) : detail.model_name || null),
    ];
    this.facts.replaceChildren(...rows.filter(Boolean).flat());
  }

  /** Sources: the result's (those cited) once there is one, else those read so far. */
  sourceList() {
    if (this.result && Array.isArray(this.result.sources)) return this.result.sources;
    const byNumber = new Map();
    for (const event of this.events.values()) {
      if (event.kind === "source_read") byNumber.set(event.data.n, event.data);
    }
    return [...byNumber.values()];
  }

  evidenceCount() {
    if (this.result && Array.isArray(this.result.evidence)) return this.result.evidence.length;
    let count = null;
    for (const event of this.events.values()) {
      if (event.kind === "evidence_added") count = (count || 0) + (event.data.count || 0);
    }
    return count;
  }

  renderResult() {
    const result = this.result;
    const sources = this.sourceList();
    const message = this.callbacks.findReport(this.task.id);
    // Rebuilt only when something changed, so an open report stays open.
    const key = JSON.stringify([this.resultVersion, sources.length, Boolean(message)]);
    if (key === this.resultKey) return;
    this.resultKey = key;
    const parts = [];
    if (result && result.scope && result.scope !== "complete") {
      parts.push(h("p", { class: "note" }, interpolate(gettext("Covers %(scope)s."), result)));
    }
    if (sources.length) {
      parts.push(h("h4", {}, gettext("Sources")),
        h("ol", { class: "source-list" }, sources.map((s) => h("li", { value: s.n },
          h("span", { class: "source-title" }, s.title || s.url),
          h("span", { class: "source-url" }, s.url)))));
    }
    if (result && typeof result.report === "string") {
      const actions = [];
      if (message) {
        const show = () => this.callbacks.onShowReport(message);
        actions.push(h("button", { type: "button", class: "button small", onclick: show },
          gettext("Show the report in the thread")));
      }
      const report = h("details", { class: "report" }, h("summary", {}, gettext("Read the report here")));
      report.addEventListener("toggle", () => {
        if (report.open && report.children.length === 1) {
          report.append(h("div", { class: "prose" }, renderMarkdown(result.report, { idPrefix: `r-${this.task.id}` })));
        }
      });
      parts.push(h("div", { class: "result-actions" }, actions), report);
    } else if (result && (result.summary || result.text)) {
      parts.push(h("h4", {}, result.is_error ? gettext("What the tool reported") : gettext("Result")),
        h("p", { class: "result-summary" }, result.summary));
      if (typeof result.text === "string" && result.text.length > result.summary.length) {
        const whole = h("details", { class: "report" }, h("summary", {}, gettext("Show the whole result")));
        whole.addEventListener("toggle", () => {
          if (whole.open && whole.children.length === 1) whole.append(h("pre", { class: "result-text" }, result.text));
        });
        parts.push(whole);
      }
      if (result.truncated) {
        parts.push(h("p", { class: "note" },
          interpolate(gettext("The result was cut: %(kept)s of %(chars)s characters are kept."),
            { kept: number(result.text.length), chars: number(result.chars) })));
      }
    }
    this.resultBox.replaceChildren(...parts);
  }
}
