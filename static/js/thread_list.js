// The thread list: the current thread marked, a thread added when the first message
// creates it, rename in place, and delete after a confirmation dialog.

import { api } from "./api.js";
import { fromTemplate, h } from "./dom.js";
import { gettext, interpolate } from "./i18n.js";

export class ThreadList {
  /**
   * `onRenamed(id, title)` and `onDeleted(id)` tell the page, which owns the heading
   * and the address bar.
   */
  constructor({ list, empty, error, dialog, onRenamed = () => {}, onDeleted = () => {} }) {
    this.list = list;
    this.empty = empty;
    this.error = error;
    this.dialog = dialog;
    this.onRenamed = onRenamed;
    this.onDeleted = onDeleted;
    list.addEventListener("click", (event) => {
      const button = event.target.closest("button[data-action]");
      if (!button) return;
      const item = button.closest(".thread-item");
      if (button.dataset.action === "rename") this.startRename(item);
      if (button.dataset.action === "delete") this.confirmDelete(item);
    });
  }

  item(id) {
    return this.list.querySelector(`.thread-item[data-thread-id="${CSS.escape(id)}"]`);
  }

  /** Put a new thread at the top of the list, marked as the current one. */
  add({ id, title }) {
    const item = fromTemplate("thread-item-template");
    item.dataset.threadId = id;
    item.querySelector(".thread-link").href = `/t/${id}/`;
    this.list.prepend(item);
    this.setTitle(item, title || gettext("Untitled thread"));
    this.setCurrent(id);
    this.empty.hidden = true;
  }

  setCurrent(id) {
    for (const link of this.list.querySelectorAll(".thread-link")) {
      const current = link.closest(".thread-item").dataset.threadId === id;
      if (current) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
  }

  setTitle(item, title) {
    item.dataset.title = title;
    item.querySelector(".thread-title").textContent = title;
    const rename = interpolate(gettext("Rename “%(title)s”"), { title });
    const remove = interpolate(gettext("Delete “%(title)s”"), { title });
    item.querySelector('[data-action="rename"]').setAttribute("aria-label", rename);
    item.querySelector('[data-action="delete"]').setAttribute("aria-label", remove);
  }

  showError(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }

  /** Swap the link for a text field; Enter or leaving the field saves, Escape keeps the old title. */
  startRename(item) {
    if (item.querySelector(".rename-form")) return;
    const link = item.querySelector(".thread-link");
    const actions = item.querySelector(".thread-actions");
    const old = item.dataset.title;
    const inputId = `rename-${item.dataset.threadId}`;
    const input = h("input", { id: inputId, type: "text", value: old, maxlength: 200, autocomplete: "off" });
    const form = h("form", { class: "rename-form" },
      h("label", { class: "visually-hidden", for: inputId }, gettext("Thread title")),
      input,
      h("button", { type: "submit", class: "button small primary" }, gettext("Save")));
    let finished = false;

    const finish = async (save, { refocus = true } = {}) => {
      if (finished) return;
      finished = true;
      const title = input.value.trim();
      form.remove();
      link.hidden = false;
      actions.hidden = false;
      if (refocus) item.querySelector('[data-action="rename"]').focus();
      if (!save || !title || title === old) return;
      this.setTitle(item, title); // at once; put back if the server refuses
      try {
        await api(`/api/threads/${item.dataset.threadId}`, { method: "PATCH", body: { title } });
        this.showError("");
        this.onRenamed(item.dataset.threadId, title);
      } catch (error) {
        this.setTitle(item, old);
        this.showError(interpolate(gettext("Couldn't rename the thread: %(error)s"), { error: error.message }));
      }
    };

    form.addEventListener("submit", (event) => {
      event.preventDefault();
      finish(true);
    });
    input.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.preventDefault(); // the page's Escape closes drawers; here it only cancels the edit
        event.stopPropagation();
        finish(false);
      }
    });
    form.addEventListener("focusout", (event) => {
      if (!form.contains(event.relatedTarget)) finish(true, { refocus: false });
    });
    link.hidden = true;
    actions.hidden = true;
    item.prepend(form);
    input.focus();
    input.select();
  }

  confirmDelete(item) {
    const title = item.dataset.title;
    this.dialog.querySelector("[data-thread-title]").textContent = title;
    this.dialog.returnValue = "";
    this.dialog.addEventListener("close", async () => {
      if (this.dialog.returnValue !== "delete") return;
      const id = item.dataset.threadId;
      try {
        await api(`/api/threads/${id}`, { method: "DELETE" });
      } catch (error) {
        if (error.status !== 404) { // already gone is what we wanted
          const words = gettext("Couldn't delete “%(title)s”: %(error)s");
          this.showError(interpolate(words, { title, error: error.message }));
          return;
        }
      }
      this.showError("");
      const next = item.nextElementSibling || item.previousElementSibling;
      item.remove();
      this.empty.hidden = this.list.children.length > 0;
      (next ? next.querySelector(".thread-link") : document.getElementById("new-thread")).focus();
      this.onDeleted(id);
    }, { once: true });
    this.dialog.showModal();
  }
}
