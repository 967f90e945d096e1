// Times, durations and numbers as people read them in the chat and the task panel, in
// the page's language (Intl does the wording: "3 minutes ago", "3分钟前").

import { language } from "./i18n.js";

const SECOND = 1_000;
const MINUTE = 60 * SECOND;
const HOUR = 60 * MINUTE;
const DAY = 24 * HOUR;

const relative = new Intl.RelativeTimeFormat(language, { numeric: "always", style: "long" });
const units = {};
function unit(name) {
  units[name] ??= new Intl.NumberFormat(language, { style: "unit", unit: name, unitDisplay: "short" });
  return units[name];
}

/**
 * How long ago `iso` was, as a whole phrase ("3 minutes ago", "3分钟前"), or null for the
 * last few seconds, which callers word as "just now".
 */
export function timeAgo(iso, now = Date.now()) {
  const ms = Math.max(0, now - Date.parse(iso));
  if (ms < 5 * SECOND) return null;
  if (ms < MINUTE) return relative.format(-Math.floor(ms / SECOND), "second");
  if (ms < HOUR) return relative.format(-Math.floor(ms / MINUTE), "minute");
  if (ms < DAY) return relative.format(-Math.floor(ms / HOUR), "hour");
  return relative.format(-Math.floor(ms / DAY), "day");
}

/** A duration in short units: "0.8 sec", "42 sec", "3 min 5 sec", "2 hr 10 min" (in Chinese "3分钟 5秒"). */
export function duration(ms) {
  if (ms < 10 * SECOND) return unit("second").format(Number((ms / SECOND).toFixed(1)));
  if (ms < MINUTE) return unit("second").format(Math.round(ms / SECOND));
  const [big, bigMs, small, smallMs] = ms < HOUR
    ? ["minute", MINUTE, "second", SECOND] : ["hour", HOUR, "minute", MINUTE];
  return `${unit(big).format(Math.floor(ms / bigMs))} ${unit(small).format(Math.round((ms % bigMs) / smallMs))}`;
}

/** A count with the language's digit grouping ("12,400"). */
export function number(n) {
  return n.toLocaleString(language);
}

/** The local time of day ("14:03:07"), for timelines. */
export function clockTime(iso) {
  const options = { hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" };
  return new Date(iso).toLocaleTimeString(language, options);
}

/** Hours and minutes ("14:03", "下午2:03"), beside a message. */
export function shortTime(iso) {
  return new Date(iso).toLocaleTimeString(language, { hour: "2-digit", minute: "2-digit" });
}

/** Date and time for a tooltip ("29 Nov 2026, 14:03", "2026年11月29日 14:03"). */
export function fullTime(iso) {
  return new Date(iso).toLocaleString(language, { dateStyle: "medium", timeStyle: "short" });
}
