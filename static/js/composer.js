// The message box: Enter sends, Shift+Enter adds a line; while the assistant is
// answering (a run is active in the thread) sending waits, and the reason is shown.

import { newIdempotencyKey } from "./api.js";
import { gettext, interpolate } from "./i18n.js";

const BUSY_REASON = gettext(
  "Longhaul is answering in this thread. You can send your next message when it has finished.");

export class Composer {
  /** `send(text, key)` posts the message and rejects with an ApiError if it could not. */
  constructor({ form, input, button, status, send }) {
    this.form = form;
    this.input = input;
    this.button = button;
    this.status = status;
    this.sendMessage = send;
    this.ready = false; // the page sends nothing before it knows whether the thread is busy
    this.busy = false;
    this.sending = false;
    this.error = "";
    this.lastFailed = null; // {text, key}: re-sending the same text reuses its key

    input.addEventListener("input", () => this.fit());
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
  }

  /** The box grows with its text up to the CSS max-height; empty, it is one line. */
  fit() {
    this.input.style.height = "";
    if (this.input.value) this.input.style.height = `${this.input.scrollHeight}px`;
  }

  /** The page has loaded what it needs: sending may begin (the button is disabled in the HTML). */
  setReady() {
    this.ready = true;
    this.render();
  }

  setBusy(busy) {
    this.busy = busy;
    if (busy) this.error = "";
    this.render();
  }

  fill(text) {
    this.input.value = text;
    this.fit();
    this.input.focus();
  }

  render() {
    const blocked = !this.ready || this.busy || this.sending;
    this.button.disabled = blocked;
    this.form.toggleAttribute("data-busy", blocked);
    let text = "";
    if (this.error) text = this.error;
    else if (this.sending) text = gettext("Sending…");
    else if (this.busy) text = BUSY_REASON;
    this.status.textContent = text;
    this.status.hidden = !text;
    this.status.dataset.kind = this.error ? "error" : "busy";
  }

  async submit() {
    const text = this.input.value.trim();
    if (!text || !this.ready || this.busy || this.sending) return;
    const key = this.lastFailed && this.lastFailed.text === text ? this.lastFailed.key : newIdempotencyKey();
    this.sending = true;
    this.error = "";
    this.input.value = "";
    this.fit();
    this.render();
    try {
      await this.sendMessage(text, key);
      this.lastFailed = null;
    } catch (error) {
      // Nothing was lost: the text goes back in the box to send again.
      if (!this.input.value) {
        this.input.value = text;
        this.fit();
      }
      this.lastFailed = { text, key };
      this.error = error.code === "thread_busy" ? ""
        : interpolate(gettext("Not sent: %(error)s"), { error: error.message });
    } finally {
      this.sending = false;
      this.render();
    }
  }
}
