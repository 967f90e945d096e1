// Times as people read them in the chat and the task panel.

const MINUTE = 60_000;
const HOUR = 60 * MINUTE;
const DAY = 24 * HOUR;

/** "just now", "40 s", "5 min", "3 h", "2 d": how long ago `iso` was. */
export function timeSince(iso, now = Date.now()) {
  const ms = Math.max(0, now - Date.parse(iso));
  if (ms < 5_000) return "just now";
  if (ms < MINUTE) return `${Math.floor(ms / 1000)} s`;
  if (ms < HOUR) return `${Math.floor(ms / MINUTE)} min`;
  if (ms < DAY) return `${Math.floor(ms / HOUR)} h`;
  return `${Math.floor(ms / DAY)} d`;
}

/** A duration in words: "0.8 s", "42 s", "3 min 5 s", "2 h 10 min". */
export function duration(ms) {
  if (ms < 10_000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms < MINUTE) return `${Math.round(ms / 1000)} s`;
  if (ms < HOUR) return `${Math.floor(ms / MINUTE)} min ${Math.round((ms % MINUTE) / 1000)} s`;
  return `${Math.floor(ms / HOUR)} h ${Math.round((ms % HOUR) / MINUTE)} min`;
}

/** The local time of day ("14:03:07"), for timelines. */
export function clockTime(iso) {
  const options = { hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" };
  return new Date(iso).toLocaleTimeString([], options);
}

/** Date and time for a tooltip ("29 Nov 2026, 14:03"). */
export function fullTime(iso) {
  return new Date(iso).toLocaleString([], { dateStyle: "medium", timeStyle: "short" });
}
