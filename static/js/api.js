// Talking to Longhaul's REST API from the page: JSON in and out, the session's CSRF
// token on every write, and one error shape.
//
// The API answers errors as {"error": "...", "code": "...", "field": "..."}; every
// failure here (a network error included) is thrown as an ApiError carrying them. The
// API's own text is English for API clients; for the codes a person meets in the page,
// the message is the page's words in the page's language.

import { gettext, interpolate } from "./i18n.js";

const CODE_WORDS = {
  thread_busy: gettext("Longhaul is still answering in this thread."),
  thread_gone: gettext("This thread was deleted."),
  not_found: gettext("It no longer exists, or it isn't yours."),
  not_pausable: gettext("This task can't be paused now."),
  not_resumable: gettext("This task can't be resumed now."),
  not_waiting: gettext("The task isn't waiting for an answer any more."),
  invalid_transition: gettext("The task has moved on meanwhile."),
  queue_full: gettext("Too many tasks are waiting. Try again in a little while."),
  idempotency_key_reused: gettext("This was already sent with different content."),
  body_too_large: gettext("That is too long to send."),
  not_authenticated: gettext("You are signed out. Reload the page to sign in again."),
  permission_denied: gettext("You aren't allowed to do that."),
  internal: gettext("Something went wrong on the server. Try again in a moment."),
};

/** A failed API call: `status` is 0 when the server could not be reached. */
export class ApiError extends Error {
  constructor(message, { status = 0, code = "network", field = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.field = field;
  }
}

function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  return match ? decodeURIComponent(match[1]) : "";
}

/**
 * Call the API at `path` ("/api/..."); resolves to the parsed JSON (null for 204).
 * `body` is sent as JSON; `headers` are added (e.g. Idempotency-Key).
 */
export async function api(path, { method = "GET", body, headers = {}, signal } = {}) {
  const init = {
    method,
    signal,
    credentials: "same-origin",
    headers: { Accept: "application/json", ...headers },
  };
  if (method !== "GET" && method !== "HEAD") {
    init.headers["X-CSRFToken"] = csrfToken();
  }
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(gettext("Longhaul could not be reached. Check your connection."));
  }
  if (response.status === 204) return null;
  let data = null;
  try {
    data = await response.json();
  } catch {
    // An HTML error page from a proxy, say: the status still tells what happened.
  }
  if (!response.ok) {
    const code = (data && data.code) || "http_error";
    const message = CODE_WORDS[code] || (data && data.error)
      || interpolate(gettext("The server answered %(status)s."), { status: response.status });
    throw new ApiError(message, {
      status: response.status,
      code,
      field: (data && data.field) || null,
    });
  }
  return data;
}

/** A fresh random key, for Idempotency-Key headers (crypto.randomUUID needs a secure context). */
export function newIdempotencyKey() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
