// The chat page: wires the thread list, the conversation, the composer and the task
// panel together, and owns the page-level things (drawers, the heading, the address bar).

import { api } from "./api.js";
import { Composer } from "./composer.js";
import { gettext, interpolate } from "./i18n.js";
import { TaskPanel } from "./task_panel.js";
import { ThreadList } from "./thread_list.js";
import { ThreadView } from "./thread_view.js";

const app = document.getElementById("app");
const panel = document.getElementById("task-panel");
const panelToggle = document.getElementById("panel-toggle");
const threadsToggle = document.getElementById("threads-toggle");
const scrim = document.getElementById("scrim");
const heading = document.getElementById("thread-heading");
const input = document.getElementById("composer-input");
const narrowPanel = window.matchMedia("(max-width: 1099.98px)");
const featuresError = document.getElementById("features-error");
let panelOn = false; // GET /api/features said the task panel is on, and it has been started

// --- drawers ---------------------------------------------------------------------------
//
// One drawer at a time: on a phone the thread list and the panel both slide over the
// conversation, so opening one closes the other (on wide screens the list is a column and
// its drawer state means nothing).

/** Open or close the task panel, keeping aria-expanded and focus in step. */
function setPanelOpen(open, { restoreFocus = true, focusPanel = true } = {}) {
  if (open && app.hasAttribute("data-threads-open")) setThreadsOpen(false, { focusList: false });
  panel.hidden = !open;
  panelToggle.setAttribute("aria-expanded", String(open));
  app.toggleAttribute("data-panel-open", open);
  if (open) {
    if (focusPanel) panel.focus();
  } else if (restoreFocus) {
    panelToggle.focus();
  }
}

/** Open or close the thread list (a drawer only on small screens). */
function setThreadsOpen(open, { focusList = true } = {}) {
  if (open && !panel.hidden) setPanelOpen(false, { restoreFocus: false });
  threadsToggle.setAttribute("aria-expanded", String(open));
  app.toggleAttribute("data-threads-open", open);
  if (open && focusList) document.getElementById("new-thread").focus();
}

panelToggle.addEventListener("click", () => setPanelOpen(panel.hidden));
document.getElementById("panel-close").addEventListener("click", () => setPanelOpen(false));
threadsToggle.addEventListener("click", () => setThreadsOpen(!app.hasAttribute("data-threads-open")));
document.getElementById("threads-close").addEventListener("click", () => {
  setThreadsOpen(false);
  threadsToggle.focus();
});
scrim.addEventListener("click", () => {
  if (!panel.hidden) setPanelOpen(false, { restoreFocus: false });
  setThreadsOpen(false);
});

document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || event.defaultPrevented || document.querySelector("dialog[open]")) return;
  if (!panel.hidden) {
    setPanelOpen(false);
  } else if (app.hasAttribute("data-threads-open")) {
    setThreadsOpen(false);
    threadsToggle.focus();
  }
});

// --- the parts -------------------------------------------------------------------------

function showTitle(title) {
  heading.textContent = title;
  heading.closest(".conversation-head").hidden = false;
  document.title = `${title} · ${app.dataset.tenantName} · Longhaul`;
}

const composer = new Composer({
  form: document.getElementById("composer"),
  input,
  button: document.getElementById("send"),
  status: document.getElementById("composer-status"),
  send: (text, key) => conversation.send(text, key),
});

const tasks = new TaskPanel({
  panel,
  badge: document.getElementById("task-count"),
  live: document.getElementById("task-live"),
  deleteDialog: document.getElementById("delete-task-dialog"),
  onTaskNews: (taskId) => conversation.expectNotice(taskId),
  findReport: (taskId) => conversation.findReport(taskId),
  onShowReport: (message) => {
    if (narrowPanel.matches) setPanelOpen(false, { restoreFocus: false });
    conversation.highlight(message);
  },
  onTaskUpdate: (task) => conversation.noteTask(task),
});

const threads = new ThreadList({
  list: document.getElementById("thread-list"),
  empty: document.getElementById("threads-empty"),
  error: document.getElementById("thread-list-error"),
  dialog: document.getElementById("delete-dialog"),
  onRenamed: (id, title) => {
    if (id === app.dataset.threadId) showTitle(title);
  },
  onDeleted: (id) => {
    if (id === app.dataset.threadId) location.assign("/");
  },
});

const conversation = new ThreadView({
  threadId: app.dataset.threadId,
  conversation: document.getElementById("conversation"),
  messages: document.getElementById("messages"),
  state: document.getElementById("conversation-state"),
  connection: document.getElementById("connection"),
  welcome: document.getElementById("welcome"),
  callbacks: {
    onBusy: (busy) => composer.setBusy(busy),
    onStreamItem: (item) => tasks.noteThreadEvent(item),
    onReconnected: () => tasks.refresh({ force: true }),
    onThreadCreated: (thread) => {
      // The first message on "/" made a thread: this page becomes that thread's page.
      app.dataset.threadId = thread.id;
      history.pushState({ thread: thread.id }, "", `/t/${thread.id}/`);
      threads.add({ id: thread.id, title: thread.title });
      showTitle(thread.title || gettext("Untitled thread"));
      conversation.adoptThread(thread.id);
      if (panelOn) tasks.setThread(thread.id);
    },
    onTaskMessage: (taskId) => tasks.noteTaskMessage(taskId),
    onAnswered: () => { if (panelOn) tasks.refresh({ force: true }); },
    onShowTask: async (taskId) => {
      setPanelOpen(true, { focusPanel: false });
      if (!tasks.reveal(taskId)) {
        await tasks.refresh({ force: true });
        if (!tasks.reveal(taskId)) panel.focus();
      }
    },
  },
});

for (const button of document.querySelectorAll(".suggestion")) {
  button.addEventListener("click", () => composer.fill(button.dataset.prompt));
}

document.getElementById("new-thread").addEventListener("click", () => {
  if (app.dataset.threadId) {
    location.assign("/");
  } else {
    setThreadsOpen(false);
    input.focus();
  }
});

// Back from a thread the page itself created: show the page for that address.
window.addEventListener("popstate", () => location.reload());

// The language switch comes back to this address, which may have changed since the page loaded.
const languageSwitch = document.querySelector(".topbar .language-switch");
languageSwitch?.addEventListener("submit", () => {
  languageSwitch.querySelector('input[name="next"]').value = location.pathname;
});

// --- features --------------------------------------------------------------------------
//
// What this deployment offers (GET /api/features): parts of the page marked
// data-feature="task_panel", "remote_tools" or "corpus" start hidden and are shown only
// when that feature is on. If the answer cannot be had, the panel stays hidden and a
// notice says so, with a way to try again, rather than a panel that cannot work.

async function loadFeatures() {
  try {
    const features = await api("/api/features");
    featuresError.hidden = true;
    const on = { task_panel: features.task_panel, remote_tools: features.remote_tools,
                 corpus: features.research.corpus };
    for (const element of document.querySelectorAll("[data-feature]")) {
      element.hidden = !on[element.dataset.feature];
    }
    if (features.task_panel && !panelOn) {
      panelOn = true;
      return tasks.setThread(app.dataset.threadId || null);
    }
  } catch (error) {
    featuresError.querySelector("[data-error-text]").textContent =
      interpolate(gettext("Couldn't load what this workspace offers, so the task panel is hidden. %(error)s"),
        { error: error.message });
    featuresError.hidden = false;
  }
  return undefined;
}

featuresError.querySelector("button").addEventListener("click", () => loadFeatures());

// --- start -----------------------------------------------------------------------------

if (app.dataset.threadId) {
  // The stream opens once messages and tasks are loaded: what it replays can then be told
  // apart from what is new.
  await Promise.all([conversation.start(), loadFeatures()]);
  composer.setReady();
  conversation.openStream();
} else {
  composer.setReady();
  await loadFeatures();
}
