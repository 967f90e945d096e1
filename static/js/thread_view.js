// The conversation: messages fetched by id cursor and drawn once each, in order.
//
// What makes it fetch: the thread's WebSocket (any item is a wake-up: something in the
// thread changed), a reconnect of that socket (whatever happened meanwhile), a send,
// and three safety nets: every data-busy-poll-ms (2 s) while a run is active ("busy"),
// and for a while after a task reached a status the assistant posts about, until that
// post is here (the panel reports those tasks: expectNotice); otherwise every
// data-idle-poll-ms (15 s) while the page is in view. The socket tells of the thread's
// tasks, not of its messages: a message posted while nothing here waits for one (sent
// from another tab, a task's notice delivered late) shows within that.
//
// A message telling of a task's question carries the answer form under it, while the task
// still asks that question (the newest such message only); answered or withdrawn, in the
// panel or here, the form goes away. What the task asks is read from the task itself, and
// again whenever the thread's stream or the panel brings news of it (noteTask).
//
// A message that is a proposal of the model's (a remote tool call, a cancel) carries its card
// with Confirm and Decline (proposal_card.js); the message telling how it was decided redraws it.

import { api, newIdempotencyKey } from "./api.js";
import { h } from "./dom.js";
import { fullTime, shortTime } from "./format.js";
import { gettext, interpolate } from "./i18n.js";
import { renderMarkdown } from "./markdown.js";
import { questionForm } from "./question_form.js";
import { proposalCard } from "./proposal_card.js";
import { openStream } from "./task_stream.js";

const PAGE = 100;
const NOTICE_WAIT_MS = 60_000; // how long to look for a task's notification before giving up
const NEAR_BOTTOM_PX = 120;
const MAX_RETRY_MS = 30_000;

export class ThreadView {
  /**
   * Callbacks: onBusy(busy) for the composer, onStreamItem(item) for the task panel,
   * onReconnected() after the socket came back, onThreadCreated(thread) when the first
   * message made a thread, onShowTask(taskId) for a message's "Show task" button, and
   * onTaskMessage(taskId) when a message about a task arrived (its report, say), and
   * onAnswered(taskId) after a question was answered in the thread.
   */
  constructor({ threadId, conversation, messages, state, connection, welcome, callbacks }) {
    this.threadId = threadId || null;
    this.conversation = conversation;
    this.messages = messages;
    this.state = state;
    this.connection = connection;
    this.welcome = welcome;
    this.busyPollMs = Number(conversation.dataset.busyPollMs) || 2000;
    this.idlePollMs = Number(conversation.dataset.idlePollMs) || 15000;
    this.callbacks = callbacks;

    this.seen = new Set();
    this.userRuns = new Set(); // runs whose user message is drawn (to retire a "Sending…" bubble)
    this.lastId = 0;
    this.busy = false;
    this.loaded = false;
    this.fetching = null;
    this.again = false;
    this.pollTimer = null;
    this.failures = 0;
    this.notices = new Map(); // task id -> {after: message id, until: ms}
    this.questions = new Map(); // task id -> {slot, key, draft, answered}: the form under its newest asking message
    this.proposals = new Map(); // proposal id -> its card
    this.stream = null;
    this.everLive = false;
    this.streamStatus = null;

    messages.addEventListener("click", (event) => this.onClick(event));
    // A reader at the end of the conversation stays there when the page changes size
    // (a phone turned, the keyboard opened, the panel docked).
    this.atEnd = true;
    conversation.addEventListener("scroll", () => { this.atEnd = this.isNearBottom(); }, { passive: true });
    new ResizeObserver(() => { if (this.atEnd) this.scrollToEnd(); }).observe(conversation);
    // Out of view, the idle look waits; back in view, the page looks at once.
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) this.schedulePoll();
      else this.refresh();
    });
  }

  /** Load the messages; the stream opens once the page has its first picture (see chat.js). */
  async start() {
    if (!this.threadId) return;
    this.setState("loading");
    await this.refresh();
  }

  /** The first message on "/" created a thread: from now on this view follows it. */
  adoptThread(threadId) {
    this.threadId = threadId;
    this.loaded = true;
    this.openStream();
  }

  // --- fetching -------------------------------------------------------------------------

  /** Fetch what is new now, or right after the fetch in flight. */
  refresh() {
    if (!this.threadId) return Promise.resolve();
    if (this.fetching) {
      this.again = true;
      return this.fetching;
    }
    this.fetching = (async () => {
      do {
        this.again = false;
        await this.fetchNew();
      } while (this.again);
    })().finally(() => {
      this.fetching = null;
      this.schedulePoll();
    });
    return this.fetching;
  }

  async fetchNew() {
    try {
      for (;;) {
        const page = await api(`/api/threads/${this.threadId}/messages?after=${this.lastId}&limit=${PAGE}`);
        for (const message of page.results) this.append(message);
        this.setBusy(page.busy);
        if (page.results.length < PAGE) break;
      }
      this.failures = 0;
      this.loaded = true;
      this.setState(this.seen.size || this.messages.querySelector(".pending") ? "" : "empty");
    } catch (error) {
      this.failures += 1;
      if (error.status === 404) {
        this.setState("gone");
        this.stopStream();
        this.threadId = null;
      } else if (!this.loaded) {
        this.setState("error", error.message);
      }
    }
  }

  schedulePoll() {
    clearTimeout(this.pollTimer);
    this.pollTimer = null;
    if (!this.threadId) return;
    const now = Date.now();
    for (const [taskId, notice] of this.notices) {
      if (notice.until < now) this.notices.delete(taskId);
    }
    let ms = null;
    if (this.failures) ms = Math.min(MAX_RETRY_MS, this.busyPollMs * 2 ** (this.failures - 1));
    else if (this.busy || this.notices.size) ms = this.busyPollMs;
    else if (!document.hidden) ms = this.idlePollMs;
    if (ms !== null) this.pollTimer = setTimeout(() => this.refresh(), ms);
  }

  /** A task reached a status the assistant posts about: look for that post until it is here. */
  expectNotice(taskId) {
    if (!this.threadId || this.notices.has(taskId)) return;
    this.notices.set(taskId, { after: this.lastId, until: Date.now() + NOTICE_WAIT_MS });
    this.refresh();
  }

  setBusy(busy) {
    if (busy === this.busy) return;
    this.busy = busy;
    this.callbacks.onBusy(busy);
  }

  // --- the thread's stream -------------------------------------------------------------

  openStream() {
    if (!this.threadId || this.stream) return;
    this.stream = openStream(`/ws/threads/${this.threadId}/`, {
      after: 0,
      onEvent: (item) => {
        this.callbacks.onStreamItem(item);
        if (this.questions.has(item.task)) this.loadQuestion(item.task);
        this.refresh();
      },
      onStatus: (status) => this.setConnection(status),
      // After repeated socket failures: fetch every few seconds instead (this is a wake-up
      // stream, so "no items" is the honest answer; the fetch does the real work).
      poll: async () => {
        await this.refresh();
        return { items: [], end: null };
      },
    });
  }

  stopStream() {
    const stream = this.stream;
    this.stream = null;
    if (stream) stream.close();
  }

  setConnection(status) {
    const previous = this.streamStatus;
    this.streamStatus = status;
    const text = this.connection.querySelector("[data-connection-text]");
    if (status === "live") {
      this.connection.hidden = true;
      if (this.everLive && previous !== "live") {
        // Whatever happened while the socket was down: fetch it.
        this.refresh();
        this.callbacks.onReconnected();
      }
      this.everLive = true;
    } else if (status === "reconnecting") {
      text.textContent = gettext("Reconnecting…");
      this.connection.dataset.state = status;
      this.connection.hidden = false;
    } else if (status === "polling") {
      text.textContent = gettext("Live updates interrupted; checking every few seconds");
      this.connection.dataset.state = status;
      this.connection.hidden = false;
    } else if (status === "closed" && this.stream) {
      // Closed by the server for good (signed out, thread gone).
      text.textContent = gettext("Disconnected. Reload the page to continue.");
      this.connection.dataset.state = status;
      this.connection.hidden = false;
    }
  }

  // --- drawing --------------------------------------------------------------------------

  setState(kind, detail = "") {
    const state = this.state;
    state.dataset.state = kind;
    const words = {
      loading: [h("span", { class: "spinner", "aria-hidden": "true" }),
                h("span", {}, gettext("Loading the conversation…"))],
      empty: [h("p", {}, h("strong", {}, gettext("No messages yet.")), " ",
                gettext("Ask for research below; the answer comes back here."))],
      error: [h("span", {}, interpolate(gettext("Couldn't load the conversation. %(error)s"), { error: detail })),
              h("button", { type: "button", class: "button small", onclick: () => this.retryLoad() },
                gettext("Try again"))],
      gone: [h("span", {}, gettext("This thread was deleted.")), " ",
             h("a", { href: "/" }, gettext("Start a new one"))],
    }[kind];
    state.replaceChildren(...(words || []));
    state.hidden = !words;
  }

  retryLoad() {
    this.setState("loading");
    this.refresh();
  }

  isNearBottom() {
    const c = this.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < NEAR_BOTTOM_PX;
  }

  scrollToEnd() {
    this.conversation.scrollTop = this.conversation.scrollHeight;
  }

  append(message) {
    if (this.seen.has(message.id)) return;
    const stick = this.isNearBottom() || !this.loaded;
    this.seen.add(message.id);
    this.lastId = Math.max(this.lastId, message.id);
    if (message.task && message.role !== "user") {
      const notice = this.notices.get(message.task);
      if (notice && message.id > notice.after) this.notices.delete(message.task);
    }
    if (message.role === "user" && message.run) this.userRuns.add(message.run);
    const pending = message.role === "user" && message.run
      ? this.messages.querySelector(`.message.pending[data-run="${CSS.escape(message.run)}"]`) : null;
    const element = this.renderMessage(message);
    if (pending) pending.replaceWith(element);
    else this.messages.insertBefore(element, this.messages.querySelector(".message.pending"));
    this.state.hidden = true;
    if (this.welcome) this.welcome.hidden = true;
    if (stick || pending) this.scrollToEnd();
    if (message.task && message.role !== "user") this.callbacks.onTaskMessage(message.task);
    if (message.asks && message.task) this.askIn(element, message.task);
    if (message.decides) this.proposals.get(message.decides.id)?.redraw(message.decides);
  }

  // --- questions ------------------------------------------------------------------------

  /** The newest message asking `taskId`'s question holds its form; an older one lets it go. */
  askIn(element, taskId) {
    const slot = h("div", { class: "message-question" });
    element.append(slot);
    const entry = this.questions.get(taskId);
    if (entry) entry.slot.replaceChildren();
    this.questions.set(taskId, { slot, key: null, draft: {}, answered: null });
    this.loadQuestion(taskId);
  }

  async loadQuestion(taskId) {
    try {
      this.noteTask(await api(`/api/tasks/${taskId}`));
    } catch {
      // The panel's next list, or the next stream item, tries again.
    }
  }

  /** Fresher facts about a task (from the panel's list or the task's detail). */
  noteTask(task) {
    const entry = this.questions.get(task.id);
    if (!entry) return;
    const asking = task.status === "waiting_input";
    const key = JSON.stringify([asking, task.question, task.question_fields, entry.answered]);
    if (key === entry.key) return; // unchanged: a half-filled form stays as it is
    entry.key = key;
    if (entry.answered && entry.answered.question === task.question && (asking || entry.answered.shown)) {
      entry.answered.shown = true;
      entry.slot.replaceChildren(h("p", { class: "note", role: "status" }, entry.answered.words));
    } else if (asking) {
      entry.answered = null;
      entry.slot.replaceChildren(questionForm(task, {
        fields: task.question_fields || [],
        draft: entry.draft,
        onAnswered: (words) => {
          entry.answered = { question: task.question, words };
          this.noteTask(task);
          this.callbacks.onAnswered(task.id);
        },
      }));
    } else {
      entry.slot.replaceChildren(); // answered elsewhere, or withdrawn: nothing left to answer here
    }
  }

  renderMessage(message) {
    const mine = message.role === "user";
    const body = mine
      ? h("div", { class: "message-text" }, message.content)
      : h("div", { class: "prose" }, renderMarkdown(message.content, { idPrefix: `m${message.id}` }));
    const footer = !mine && message.task
      ? h("div", { class: "message-actions" },
          h("button", { type: "button", class: "link-button", dataset: { showTask: message.task } },
            gettext("Show task in panel")))
      : null;
    return h("article", {
      class: `message ${mine ? "from-user" : "from-assistant"}`,
      id: `m${message.id}`,
      dataset: { messageId: message.id, role: message.role, task: message.task || null, run: message.run || null },
      "aria-label": mine ? gettext("You said") : gettext("Longhaul said"),
    },
    h("div", { class: "message-meta" },
      h("span", { class: "author" }, mine ? gettext("You") : "Longhaul"),
      h("time", { datetime: message.created_at, title: fullTime(message.created_at) }, shortTime(message.created_at))),
    body, this.proposalIn(message), footer);
  }

  /** The card of a proposal the message makes (null for any other message). */
  proposalIn(message) {
    if (!message.proposal || !this.threadId) return null;
    // The thread tells what happened next: fetch it now rather than wait for the stream.
    const card = proposalCard(this.threadId, message.proposal, { onDecided: () => this.refresh() });
    this.proposals.set(message.proposal.id, card);
    return h("div", { class: "message-proposal" }, card);
  }

  /** The newest assistant message about a task (its report, once the task is done). */
  findReport(taskId) {
    const all = this.messages.querySelectorAll(`.message.from-assistant[data-task="${CSS.escape(taskId)}"]`);
    return all.length > 1 ? all[all.length - 1] : null; // the first one only says it started
  }

  highlight(element) {
    element.scrollIntoView({ block: "center" });
    element.classList.remove("flash");
    void element.offsetWidth; // restart the animation
    element.classList.add("flash");
    if (!element.hasAttribute("tabindex")) element.setAttribute("tabindex", "-1");
    element.focus({ preventScroll: true });
  }

  onClick(event) {
    const cite = event.target.closest("a.cite");
    if (cite) {
      // The source entry is in this message: bring it into view without touching history.
      const target = document.getElementById(cite.getAttribute("href").slice(1));
      if (target) {
        event.preventDefault();
        this.highlight(target);
      }
      return;
    }
    const show = event.target.closest("[data-show-task]");
    if (show) this.callbacks.onShowTask(show.dataset.showTask);
  }

  // --- sending --------------------------------------------------------------------------

  addPending(text) {
    const element = h("article", { class: "message from-user pending", "aria-label": gettext("Sending") },
      h("div", { class: "message-meta" },
        h("span", { class: "author" }, gettext("You")), h("span", {}, gettext("Sending…"))),
      h("div", { class: "message-text" }, text));
    this.messages.append(element);
    if (this.welcome) this.welcome.hidden = true;
    this.state.hidden = true;
    this.scrollToEnd();
    return element;
  }

  /**
   * Send a message (creating the thread first on "/"). The same Idempotency-Key goes
   * with every attempt of this send, so a retry after a lost answer is not a second message.
   */
  async send(text, key = newIdempotencyKey()) {
    const pending = this.addPending(text);
    try {
      if (!this.threadId) {
        const title = text.replace(/\s+/g, " ").slice(0, 60);
        const thread = await api("/api/threads", { method: "POST", body: { title } });
        this.callbacks.onThreadCreated(thread);
      }
      const run = await this.postMessage(text, key);
      if (this.userRuns.has(run.id)) pending.remove(); // a fetch already drew it
      else pending.dataset.run = run.id;
      this.setBusy(true);
    } catch (error) {
      pending.remove();
      if (error.code === "thread_busy") this.setBusy(true);
      if (!this.seen.size && this.loaded) this.setState("empty");
      throw error;
    } finally {
      this.refresh();
    }
  }

  async postMessage(text, key) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await api(`/api/threads/${this.threadId}/messages`, {
          method: "POST", body: { content: text }, headers: { "Idempotency-Key": key },
        });
      } catch (error) {
        // Unreachable or a gateway hiccup: the key makes trying again safe.
        const retryable = error.status === 0 || error.status === 502 || error.status === 503;
        if (!retryable || attempt >= 3) throw error;
        await new Promise((resolve) => setTimeout(resolve, 500 * attempt));
      }
    }
  }
}
