// The chat page: the task panel, the thread drawer on small screens, and the composer.

const app = document.getElementById("app");
const panel = document.getElementById("task-panel");
const panelToggle = document.getElementById("panel-toggle");
const panelClose = document.getElementById("panel-close");
const threadsToggle = document.getElementById("threads-toggle");
const scrim = document.getElementById("scrim");
const badge = document.getElementById("task-count");
const composer = document.getElementById("composer");
const input = document.getElementById("composer-input");

/** Open or close the task panel, keeping aria-expanded and focus in step. */
function setPanelOpen(open, { restoreFocus = true } = {}) {
  panel.hidden = !open;
  panelToggle.setAttribute("aria-expanded", String(open));
  app.toggleAttribute("data-panel-open", open);
  if (open) {
    panel.focus();
  } else if (restoreFocus) {
    panelToggle.focus();
  }
}

/** Open or close the thread list (a drawer only on small screens). */
function setThreadsOpen(open) {
  threadsToggle.setAttribute("aria-expanded", String(open));
  app.toggleAttribute("data-threads-open", open);
  if (open) {
    document.getElementById("new-thread").focus();
  }
}

/** Show the number of active tasks; the badge hides at zero. */
export function setActiveCount(count) {
  badge.querySelector("[data-count]").textContent = String(count);
  badge.hidden = count === 0;
}

/** Announce a progress update politely to screen readers. */
export function announce(text) {
  document.getElementById("task-live").textContent = text;
}

panelToggle.addEventListener("click", () => setPanelOpen(panel.hidden));
panelClose.addEventListener("click", () => setPanelOpen(false));
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
  if (event.key !== "Escape" || event.defaultPrevented) return;
  if (!panel.hidden) {
    setPanelOpen(false);
  } else if (app.hasAttribute("data-threads-open")) {
    setThreadsOpen(false);
    threadsToggle.focus();
  }
});

// The composer grows with its text up to the CSS max-height; empty, it is one line.
function fitComposer() {
  input.style.height = "";
  if (input.value) input.style.height = `${input.scrollHeight}px`;
}
input.addEventListener("input", fitComposer);

// Enter sends, Shift+Enter keeps a new line (the convention of chat apps).
input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    composer.requestSubmit();
  }
});

// Chat runs are not wired yet: a send is announced as an event for the code that
// will post it, and never leaves the page.
composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  composer.dispatchEvent(new CustomEvent("longhaul:send", { detail: { text } }));
});

for (const button of document.querySelectorAll(".suggestion")) {
  button.addEventListener("click", () => {
    input.value = button.dataset.prompt;
    fitComposer();
    input.focus();
  });
}

document.getElementById("new-thread").addEventListener("click", () => {
  setThreadsOpen(false);
  input.focus();
});
