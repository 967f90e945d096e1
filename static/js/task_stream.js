// Live progress of a task (or any stream of the same protocol) over WebSocket.
//
// Protocol (tasks/consumers.py): every item is a JSON frame with an ascending `seq`;
// {"type": "end", status, result_version} says the subject ended and all was sent.
// The client keeps the last seq it saw, so a reconnect asks for exactly what it missed;
// items at or below it are ignored, so nothing is handled twice.
//
// Close codes: 4400/4401/4403/4404 are final (bad cursor, signed out, no longer a member,
// no such task); 4429 means "you fell behind, reconnect with your last seq" and is answered
// at once, unless a {"type": "close", retry_after} frame came first: then it means "too many
// live streams" and the client waits that long (daphne drops close reasons, so the server
// says it in a frame). Anything else is retried with capped, jittered exponential backoff. After
// WS_FAILURES_BEFORE_POLLING failures in a row the client polls the REST API instead
// (when the stream has one), and tries the WebSocket again now and then.
//
// onStatus receives "live", "reconnecting", "polling" or "closed".

const FINAL_CODES = new Set([4400, 4401, 4403, 4404]);
const FINAL_HTTP = new Set([400, 401, 403, 404]);
const TOO_FAR_BEHIND = 4429;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const BACKOFF_BASE_MS = 500;
const BACKOFF_CAP_MS = 30_000;
const WS_FAILURES_BEFORE_POLLING = 4;
const POLL_MS = 2_000;
const POLL_LIMIT = 200;
const RETRY_WS_AFTER_MS = 60_000;

/** Backoff for the nth failure in a row: doubling up to the cap, then a random half to a full step. */
function backoffMs(failures) {
  const step = Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** (failures - 1));
  return step / 2 + Math.random() * (step / 2);
}

function socketUrl(path, after) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}?after=${after}`;
}

async function getJson(url) {
  const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!response.ok) {
    const error = new Error(`${url} answered ${response.status}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

/**
 * Follow a stream at `path` (e.g. "/ws/threads/<id>/") from cursor `after`.
 * `poll(after)`, if given, is the fallback: it resolves to {items, end} read over HTTP
 * (end: the end message, or null). Returns {close()}.
 */
export function openStream(path, { after = 0, onEvent = () => {}, onEnd = () => {}, onStatus = () => {}, poll } = {}) {
  let cursor = after;
  let status = null;
  let socket = null;
  let timer = null;
  let failures = 0;
  let stopped = false;
  let lastEnd = null;
  let retryAfterMs = null; // from the server's close frame: how long it asked us to wait

  function setStatus(next) {
    if (next !== status) {
      status = next;
      onStatus(next);
    }
  }

  function handle(message) {
    if (message.type === "close") {
      // Spread out the tabs that were refused together, so they do not all come back at once.
      retryAfterMs = message.retry_after ? message.retry_after * 1000 * (1 + Math.random() / 2) : null;
    } else if (message.type === "end") {
      // A reconnect (or a poll) repeats the end; report each distinct one once.
      const key = JSON.stringify(message);
      if (key !== lastEnd) {
        lastEnd = key;
        onEnd(message);
      }
    } else if (message.seq > cursor) {
      cursor = message.seq;
      onEvent(message);
    }
  }

  function stop() {
    stopped = true;
    clearTimeout(timer);
    if (socket) {
      socket.onclose = null;
      socket.close(1000);
    }
    setStatus("closed");
  }

  function connect() {
    socket = new WebSocket(socketUrl(path, cursor));
    socket.onopen = () => {
      failures = 0;
      setStatus("live");
    };
    socket.onmessage = (event) => handle(JSON.parse(event.data));
    socket.onclose = (event) => {
      socket = null;
      if (stopped) return;
      if (FINAL_CODES.has(event.code)) return stop();
      const waitMs = retryAfterMs;
      retryAfterMs = null;
      if (event.code === TOO_FAR_BEHIND && waitMs === null) return connect();
      failures += 1;
      if (poll && failures >= WS_FAILURES_BEFORE_POLLING) return startPolling();
      setStatus("reconnecting");
      timer = setTimeout(connect, Math.max(waitMs ?? 0, backoffMs(failures)));
    };
  }

  function startPolling() {
    setStatus("polling");
    const retryWsAt = Date.now() + RETRY_WS_AFTER_MS;
    const pollOnce = async () => {
      let more = false;
      try {
        const page = await poll(cursor);
        if (stopped) return;
        page.items.forEach(handle);
        if (page.end) handle(page.end);
        more = page.items.length >= POLL_LIMIT;
      } catch (error) {
        if (FINAL_HTTP.has(error.status)) return stop();
        // Otherwise the network or the server is down for now: poll again later.
      }
      if (stopped) return;
      if (Date.now() >= retryWsAt) {
        failures = WS_FAILURES_BEFORE_POLLING - 1; // one more WebSocket failure brings polling back
        return connect();
      }
      // An ended task may still get a late event, but rarely: look less often.
      timer = setTimeout(pollOnce, more ? 0 : lastEnd ? POLL_MS * 5 : POLL_MS);
    };
    pollOnce();
  }

  connect();
  return { close: stop };
}

/** The REST fallback of a task stream: events after a seq, and the end once the task has ended. */
async function pollTaskEvents(taskId, after) {
  const base = `/api/tasks/${encodeURIComponent(taskId)}`;
  const page = await getJson(`${base}/events?after=${after}&limit=${POLL_LIMIT}`);
  const items = page.results;
  const last = items.length ? items[items.length - 1] : null;
  let end = null;
  if (items.length < POLL_LIMIT && (last === null || TERMINAL.has(last.status))) {
    const task = await getJson(base);
    if (task.is_terminal && task.last_event_seq <= (last ? last.seq : after)) {
      end = { type: "end", status: task.status, result_version: task.result_version };
    }
  }
  return { items, end };
}

/** Follow a task's events (ws/tasks/<id>/), falling back to polling its events endpoint. */
export function openTaskStream(taskId, { after = 0, onEvent, onEnd, onStatus } = {}) {
  return openStream(`/ws/tasks/${encodeURIComponent(taskId)}/`, {
    after, onEvent, onEnd, onStatus, poll: (cursor) => pollTaskEvents(taskId, cursor),
  });
}
