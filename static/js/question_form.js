// The answer to a task's question, as a form: one control per field of the form the
// question asks to fill (text, number, yes/no, a choice), or one text box for a question
// answered in words. A remote tool's question also offers Decline and Dismiss, which are
// answers too (the tool hears "declined" or "dismissed without a choice").
//
// The panel (task_details.js) and the thread (thread_view.js) both show it. The server
// checks every answer against the form (POST /api/tasks/<id>/answer); one it refuses
// names its field ("answer.content.copies"), and the form marks that field.

import { api } from "./api.js";
import { h } from "./dom.js";
import { gettext, interpolate } from "./i18n.js";

const CONTENT_FIELD = "answer.content.";
let forms = 0; // each form's ids are its own: the same question shows in the panel and the thread

/** What an answer said, as a sentence for "You answered…" notes. */
function answerWords(body, fields) {
  if (typeof body === "string") return interpolate(gettext("You answered: %(answer)s"), { answer: body });
  if (body.action === "decline") return gettext("You declined the question.");
  if (body.action === "cancel") return gettext("You dismissed the question.");
  const parts = fields.filter((f) => f.name in body.content).map((f) => {
    let value = body.content[f.name];
    if (f.type === "boolean") value = value ? gettext("yes") : gettext("no");
    if (f.type === "choice") value = f.choice_titles[f.choices.indexOf(value)] || value;
    return `${f.title}: ${value}`;
  });
  // Translators: "; " joins the answered fields ("Title: Q3; Copies: 2").
  const joined = parts.join(gettext("; "));
  return interpolate(gettext("You answered: %(answer)s"), { answer: joined });
}

function control(field, id, described) {
  const common = { id, name: field.name, required: field.required, "aria-describedby": described };
  if (field.type === "boolean") return h("input", { ...common, type: "checkbox", required: false });
  if (field.type === "choice") {
    return h("select", common,
      h("option", { value: "" }, field.required ? gettext("Choose…") : gettext("(none)")),
      field.choices.map((choice, i) => h("option", { value: choice }, field.choice_titles[i] || choice)));
  }
  if (field.type === "number" || field.type === "integer") {
    return h("input", { ...common, type: "number", inputmode: field.type === "integer" ? "numeric" : "decimal",
                        step: field.type === "integer" ? "1" : "any", min: field.minimum, max: field.maximum });
  }
  return h("input", { ...common, type: "text", maxlength: field.max_length, minlength: field.min_length,
                      autocomplete: "off" });
}

function readValue(field, element) {
  if (field.type === "boolean") return element.checked;
  const raw = field.type === "text" ? element.value.trim() : element.value;
  if (raw === "") return undefined; // left empty: not sent (the server says if it was required)
  return field.type === "number" || field.type === "integer" ? Number(raw) : raw;
}

/**
 * A <form> answering `task`'s question. `fields`: the task's question_fields ([]: words).
 * `draft`: an object the caller keeps, so what was typed survives the form being drawn again.
 * `onAnswered(words)`: the server took the answer; `words` says what it was.
 */
export function questionForm(task, { fields = [], draft = {}, onAnswered = () => {} }) {
  const prefix = `q${(forms += 1)}`;
  const controls = new Map(); // field name -> {element, error}
  const formError = h("p", { class: "field-error", role: "alert", hidden: true });
  const send = h("button", { type: "submit", class: "button small primary" }, gettext("Send answer"));
  const buttons = [send];
  const remote = task.kind === "mcp";
  if (remote) {
    buttons.unshift(
      h("button", { type: "button", class: "button small ghost", dataset: { answer: "cancel" },
                    title: gettext("Close the question without choosing; the tool decides what happens next") },
        gettext("Dismiss")),
      h("button", { type: "button", class: "button small", dataset: { answer: "decline" },
                    title: gettext("Tell the tool you won't give this information") },
        gettext("Decline")));
  }

  const questionId = `${prefix}-question`;
  const question = h("p", { class: "question-text", id: questionId },
    h("strong", {}, gettext("The task asks:")), " ", task.question || gettext("(no question text)"));
  let body;
  if (fields.length) {
    body = h("div", { class: "question-fields" }, fields.map((field) => {
      const id = `${prefix}-${field.name}`;
      const hint = field.description ? h("span", { class: "field-hint", id: `${id}-hint` }, field.description) : null;
      const error = h("span", { class: "field-error", id: `${id}-error`, hidden: true });
      const element = control(field, id, [hint && hint.id, error.id].filter(Boolean).join(" "));
      if (field.name in draft) {
        if (field.type === "boolean") element.checked = draft[field.name];
        else element.value = draft[field.name];
      }
      element.addEventListener(field.type === "boolean" || field.type === "choice" ? "change" : "input", () => {
        draft[field.name] = field.type === "boolean" ? element.checked : element.value;
        element.removeAttribute("aria-invalid");
        error.hidden = true;
      });
      controls.set(field.name, { element, error });
      const optional = field.required ? null : h("span", { class: "optional" }, gettext("optional"));
      const label = h("label", { for: id, id: `${id}-label` }, field.title, optional ? " " : null, optional);
      // A form of one field is the question itself: its box is named by both.
      if (fields.length === 1) element.setAttribute("aria-labelledby", `${questionId} ${id}-label`);
      const kind = field.type === "boolean" ? "field check" : "field";
      return field.type === "boolean"
        ? h("div", { class: kind }, h("span", { class: "check-line" }, element, label), hint, error)
        : h("div", { class: kind }, label, hint, element, error);
    }));
  } else {
    const id = `${prefix}-text`;
    const input = h("textarea", { id, rows: 2, required: true, "aria-labelledby": questionId });
    input.value = draft.text || "";
    input.addEventListener("input", () => { draft.text = input.value; });
    controls.set("", { element: input, error: formError });
    body = input;
  }

  const form = h("form", { class: "answer-form note question", "aria-labelledby": questionId },
    question, body, formError, h("div", { class: "form-actions" }, buttons));

  function busy(on, clicked) {
    for (const button of buttons) button.disabled = on;
    send.textContent = on && clicked === send ? gettext("Sending…") : gettext("Send answer");
  }

  async function submit(answer, clicked) {
    formError.hidden = true;
    busy(true, clicked);
    try {
      await api(`/api/tasks/${task.id}/answer`, { method: "POST", body: { answer } });
      for (const key of Object.keys(draft)) delete draft[key];
      onAnswered(answerWords(answer, fields));
    } catch (failure) {
      busy(false);
      const named = failure.field && failure.field.startsWith(CONTENT_FIELD)
        ? controls.get(failure.field.slice(CONTENT_FIELD.length)) : null;
      const target = named || { element: null, error: formError };
      target.error.textContent = failure.message;
      target.error.hidden = false;
      if (target.element) {
        target.element.setAttribute("aria-invalid", "true");
        target.element.focus();
      }
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!fields.length) {
      const text = controls.get("").element.value.trim();
      if (text) submit(text, send);
      return;
    }
    const content = {};
    for (const field of fields) {
      const value = readValue(field, controls.get(field.name).element);
      if (value !== undefined) content[field.name] = value;
    }
    submit({ action: "accept", content }, send);
  });
  form.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-answer]");
    if (button) submit({ action: button.dataset.answer }, button);
  });
  return form;
}
