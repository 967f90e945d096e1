// A side effect the model proposed (a remote tool call, a cancel), as a card under its message:
// what, where, with which arguments, and Confirm / Decline. Nothing runs until the user confirms
// (chat/proposals.py); a decided card shows the decision instead of the buttons.
//
// Everything the model or a server wrote (tool, arguments, task names) goes in as text, never HTML.
// Deciding twice is refused by the server (409 already_decided): the card then shows the decision
// it already had, read again from the server.

import { api } from "./api.js";
import { h } from "./dom.js";
import { fullTime } from "./format.js";
import { gettext, interpolate } from "./i18n.js";

let cards = 0; // each card's ids are its own

function heading(proposal) {
  if (proposal.action === "cancel_background_task") {
    return interpolate(gettext("Cancel the task “%(name)s”?"), { name: proposal.name });
  }
  return interpolate(gettext("Run the remote tool “%(tool)s” on %(server)s?"),
    { tool: proposal.tool, server: proposal.server });
}

function facts(proposal) {
  if (proposal.action !== "start_remote_tool") return null;
  return h("dl", { class: "proposal-facts" },
    h("dt", {}, gettext("Tool")), h("dd", {}, proposal.tool),
    h("dt", {}, gettext("Server")), h("dd", {}, proposal.server),
    h("dt", {}, gettext("Task name")), h("dd", {}, proposal.name),
    h("dt", {}, gettext("Arguments")),
    h("dd", {}, h("pre", { class: "proposal-arguments" },
      h("code", {}, JSON.stringify(proposal.arguments || {}, null, 2)))));
}

// What came of it is the next message of the thread (the proposal's outcome): not said twice here.
function decisionWords(proposal) {
  return proposal.status === "confirmed" ? gettext("You confirmed this.") : gettext("You declined this.");
}

/**
 * A <section> for `proposal` (the messages API's shape) in thread `threadId`.
 * `onDecided(proposal)`: the server took the decision (or had one already).
 */
export function proposalCard(threadId, proposal, { onDecided = () => {} } = {}) {
  const prefix = `p${(cards += 1)}`;
  const card = h("section", { class: "note proposal", "aria-labelledby": `${prefix}-title`,
                              dataset: { proposal: proposal.id } });
  const path = `/api/threads/${threadId}/proposals/${proposal.id}`;

  function draw(current) {
    card.dataset.status = current.status;
    const title = h("p", { class: "proposal-title", id: `${prefix}-title` }, h("strong", {}, heading(current)));
    if (current.status !== "pending") {
      const when = current.decided_at
        ? h("time", { datetime: current.decided_at, class: "note-detail" }, fullTime(current.decided_at)) : null;
      card.replaceChildren(...[title, facts(current),
        h("p", { class: "proposal-decision", role: "status" }, decisionWords(current)), when].filter(Boolean));
      return;
    }
    const error = h("p", { class: "field-error", role: "alert", hidden: true });
    const confirm = h("button", { type: "button", class: "button small primary", dataset: { decision: "confirm" } },
      gettext("Confirm"));
    const decline = h("button", { type: "button", class: "button small", dataset: { decision: "decline" } },
      gettext("Decline"));
    const hint = h("p", { class: "note-detail", id: `${prefix}-hint` },
      gettext("The assistant proposed this on its own; nothing runs until you confirm."));
    confirm.setAttribute("aria-describedby", hint.id);

    async function decide(button) {
      error.hidden = true;
      confirm.disabled = decline.disabled = true;
      button.setAttribute("aria-busy", "true");
      try {
        const decided = await api(path, { method: "POST", body: { decision: button.dataset.decision } });
        draw(decided);
        onDecided(decided);
      } catch (failure) {
        if (failure.code === "already_decided") {
          // Decided elsewhere (another tab, a double click): show what was decided.
          try {
            const current = await api(path);
            draw(current);
            onDecided(current);
            return;
          } catch (again) {
            failure = again;
          }
        }
        button.removeAttribute("aria-busy");
        confirm.disabled = decline.disabled = false;
        error.textContent = failure.message;
        error.hidden = false;
      }
    }

    confirm.addEventListener("click", () => decide(confirm));
    decline.addEventListener("click", () => decide(decline));
    card.replaceChildren(...[title, facts(current), hint, error,
      h("div", { class: "form-actions" }, decline, confirm)].filter(Boolean));
  }

  draw(proposal);
  card.redraw = draw; // fresher facts (a message telling the decision) redraw the same card
  return card;
}
