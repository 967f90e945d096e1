// A small, safe Markdown renderer for chat messages and task reports.
//
// Two passes. First, Markdown becomes an HTML string in which every piece of the
// author's text is escaped before any markup is added (code, links and citations are
// built from escaped parts and set aside, so later rules cannot reach into them).
// Second, that string is parsed inertly and rebuilt node by node from a whitelist of
// elements and attributes: whatever the first pass got wrong, nothing else gets through.
//
// Supported: headings, paragraphs, lists (nested by indentation), blockquotes, fenced
// code blocks, rules, **bold**, *italic*, `code`, [links](https://...), bare http(s)
// URLs, and reports' numbered sources: a block of lines "[n] title — url" becomes a
// source list, and each [n] in the text a link to its entry within the message.
// Links go only to http(s) or to a plain path on this site such as a report's cited-source
// page (new tab, rel="noopener noreferrer"), or to those anchors.

import { gettext, interpolate } from "./i18n.js";

const MAX_DEPTH = 8; // blockquotes and lists nest at most this deep; deeper is plain text

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])(\s+|$)(.*)$/;
const SOURCE = /^ {0,3}\[(\d{1,4})\]\s+(\S.*)$/;

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** Text made safe to place in HTML, in content or in a quoted attribute. */
export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

/** The path if it is a plain path on this site ("/tasks/…/sources/2/"), else null. */
export function safeLocalPath(raw) {
  return /^\/(?!\/)[A-Za-z0-9\-._~/]*$/.test(raw) ? raw : null;
}

/** The URL if it is an absolute http(s) URL, else null. */
export function safeHttpUrl(raw) {
  try {
    const url = new URL(raw);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

// --- inline ------------------------------------------------------------------------

// Finished HTML is parked in a list and marked in the text by private-use characters,
// which the author's text cannot contain (they are removed from it first).
const OPEN = "\uE000";
const CLOSE = "\uE001";
const PARKED = /\uE000(\d+)\uE001/g;
const HAS_PARKED = /\uE000\d+\uE001/;

function externalLink(href, labelHtml) {
  return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}

/**
 * Inline Markdown as HTML. `into`: the parked list of an enclosing call (a link's label), whose
 * placeholders the text already holds; they are left for that call to put back.
 */
function renderInline(text, ctx, { links = true, into = null } = {}) {
  const parked = into || [];
  const park = (html) => `${OPEN}${parked.push(html) - 1}${CLOSE}`;
  let s = into ? text : text.replace(/[\uE000\uE001]/g, "");

  // One scan, left to right: an escaped backtick opens no code span, and a code span keeps its backslashes.
  s = s.replace(/\\([\\`*_{}[\]()#+\-.!<>|~])|(`+)([^`]|[^`][\s\S]*?[^`])\2(?!`)/g,
    (_, escaped, ticks, code) => park(escaped ? escapeHtml(escaped) : `<code>${escapeHtml(code.trim())}</code>`));
  if (links) {
    s = s.replace(/\[([^\]\n]+)\]\(\s*<?([^()\s<>]+)>?\s*\)/g, (whole, label, url) => {
      const href = safeHttpUrl(url) || safeLocalPath(url);
      const labelHtml = renderInline(label, ctx, { links: false, into: parked });
      return park(href ? externalLink(href, labelHtml) : labelHtml);
    });
    s = s.replace(/<(https?:\/\/[^\s<>]+)>|\bhttps?:\/\/[^\s<>"'`]+/gi, (whole, bracketed) => {
      let url = bracketed || whole;
      let tail = "";
      if (!bracketed) {
        // A sentence's punctuation after a bare URL is not part of it.
        const trailing = url.match(/[.,;:!?)\]'"]+$/);
        if (trailing) {
          tail = trailing[0];
          url = url.slice(0, -tail.length);
        }
      }
      const href = safeHttpUrl(url);
      return park(href ? externalLink(href, escapeHtml(url)) : escapeHtml(url)) + escapeHtml(tail);
    });
    s = s.replace(/\[(\d{1,4})\](?!\()/g, (whole, n) => {
      if (!ctx.sources.has(n)) return whole;
      return park(`<a class="cite" href="#${ctx.idPrefix}-src-${n}">[${n}]</a>`);
    });
  }

  s = escapeHtml(s);
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>");
  s = s.replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>");
  s = s.replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/\n/g, "<br>");
  if (into) return s;

  for (let round = 0; round < 4 && HAS_PARKED.test(s); round += 1) {
    s = s.replace(PARKED, (_, i) => parked[Number(i)]);
  }
  return s;
}

// --- blocks ------------------------------------------------------------------------

function isBlank(line) {
  return line.trim() === "";
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || SOURCE.test(line);
}

/** The lines of one list item (its marker removed, its indentation taken off) and where the next begins. */
function collectItem(lines, start, contentIndent) {
  const first = lines[start].match(ITEM);
  const body = [first[4]];
  let i = start + 1;
  let loose = false;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      // A blank line continues the item only if indented content follows it.
      let next = i + 1;
      while (next < lines.length && isBlank(lines[next])) next += 1;
      if (next < lines.length && lines[next].search(/\S/) >= contentIndent) {
        body.push("");
        loose = true;
        i += 1;
        continue;
      }
      break;
    }
    const indent = line.search(/\S/);
    if (indent >= contentIndent) {
      body.push(line.slice(contentIndent));
    } else if (ITEM.test(line) || startsBlock(line)) {
      break;
    } else {
      body.push(line.trim()); // a lazy continuation of the item's paragraph
    }
    i += 1;
  }
  return { body, next: i, loose };
}

function renderList(lines, start, ctx, depth) {
  const first = lines[start].match(ITEM);
  const ordered = /\d/.test(first[2]);
  const startNumber = ordered ? parseInt(first[2], 10) : 1;
  const items = [];
  let i = start;
  while (i < lines.length) {
    const match = lines[i].match(ITEM);
    if (!match || /\d/.test(match[2]) !== ordered) break;
    const contentIndent = match[1].length + match[2].length + Math.min(Math.max(match[3].length, 1), 4);
    const item = collectItem(lines, i, contentIndent);
    items.push(item);
    i = item.next;
    // Blank lines between items keep the list going.
    let next = i;
    while (next < lines.length && isBlank(lines[next])) next += 1;
    if (next < lines.length && next > i && ITEM.test(lines[next])) i = next;
  }
  const tight = items.every((item) => !item.loose);
  const html = items.map((item) => `<li>${renderBlocks(item.body, ctx, depth + 1, { tight })}</li>`).join("");
  const tag = ordered ? "ol" : "ul";
  const startAttr = ordered && startNumber !== 1 ? ` start="${startNumber}"` : "";
  return { html: `<${tag}${startAttr}>${html}</${tag}>`, next: i };
}

function renderBlocks(lines, ctx, depth = 0, { tight = false } = {}) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      i += 1;
      continue;
    }
    let match;
    if ((match = line.match(FENCE))) {
      const fence = match[1];
      const code = [];
      i += 1;
      while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length))
                                    && /^ {0,3}[`~]+\s*$/.test(lines[i]))) {
        code.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (or the end of the message)
      out.push(`<pre><code>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if ((match = line.match(HEADING))) {
      // The page and the message own h1; a report's "#" is a section of the message.
      const level = Math.min(match[1].length + 1, 6);
      out.push(`<h${level}>${renderInline(match[2] || "", ctx)}</h${level}>`);
      i += 1;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i += 1;
    } else if (QUOTE.test(line) && depth < MAX_DEPTH) {
      const quoted = [];
      while (i < lines.length && !isBlank(lines[i]) && (QUOTE.test(lines[i]) || !startsBlock(lines[i]))) {
        quoted.push(lines[i].replace(QUOTE, ""));
        i += 1;
      }
      out.push(`<blockquote>${renderBlocks(quoted, ctx, depth + 1)}</blockquote>`);
    } else if (ITEM.test(line) && depth < MAX_DEPTH) {
      const list = renderList(lines, i, ctx, depth);
      out.push(list.html);
      i = list.next;
    } else if (SOURCE.test(line)) {
      const entries = [];
      while (i < lines.length && (match = lines[i].match(SOURCE))) {
        const [, n, rest] = match;
        entries.push(`<li id="${ctx.idPrefix}-src-${n}" value="${n}">${renderInline(rest, ctx, { links: true })}</li>`);
        i += 1;
      }
      out.push(`<ol class="sources">${entries.join("")}</ol>`);
    } else {
      const paragraph = [line.trim()];
      i += 1;
      while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i])) {
        paragraph.push(lines[i].trim());
        i += 1;
      }
      const html = renderInline(paragraph.join("\n"), ctx);
      out.push(tight ? html : `<p>${html}</p>`);
    }
  }
  return out.join("");
}

// --- the whitelist pass --------------------------------------------------------------

const ALLOWED = new Set(["p", "br", "strong", "em", "code", "pre", "blockquote", "ul", "ol", "li", "a", "hr",
                         "h2", "h3", "h4", "h5", "h6"]);
const SAFE_ID = /^[A-Za-z][\w-]{0,80}$/;

function copyAllowedAttributes(from, to) {
  const tag = to.localName;
  if (tag === "a") {
    const href = from.getAttribute("href") || "";
    if (href.startsWith("#") && SAFE_ID.test(href.slice(1))) {
      to.setAttribute("href", href);
      const cited = from.getAttribute("class") === "cite" && href.match(/-src-(\d{1,4})$/);
      if (cited) {
        to.className = "cite";
        to.setAttribute("aria-label", interpolate(gettext("source %(n)s"), { n: cited[1] }));
      }
    } else if (safeHttpUrl(href) || safeLocalPath(href)) {
      to.setAttribute("href", safeHttpUrl(href) || safeLocalPath(href));
      to.setAttribute("target", "_blank");
      to.setAttribute("rel", "noopener noreferrer");
    }
  } else if (tag === "ol") {
    if (from.getAttribute("class") === "sources") to.className = "sources";
    const start = from.getAttribute("start");
    if (start && /^\d{1,9}$/.test(start)) to.setAttribute("start", start);
  } else if (tag === "li") {
    const id = from.getAttribute("id");
    if (id && SAFE_ID.test(id)) to.id = id;
    const value = from.getAttribute("value");
    if (value && /^\d{1,9}$/.test(value)) to.setAttribute("value", value);
  }
}

function rebuild(node, into) {
  for (const child of node.childNodes) {
    if (child.nodeType === Node.TEXT_NODE) {
      into.append(document.createTextNode(child.data));
    } else if (child.nodeType === Node.ELEMENT_NODE) {
      const tag = child.localName;
      if (ALLOWED.has(tag)) {
        const copy = document.createElement(tag);
        copyAllowedAttributes(child, copy);
        rebuild(child, copy);
        into.append(copy);
      } else if (tag !== "script" && tag !== "style" && tag !== "template") {
        rebuild(child, into); // unknown markup: keep its text, drop the element
      }
    }
  }
}

/** Only whitelisted elements and attributes of an HTML string, as a DocumentFragment. */
export function sanitize(html) {
  // DOMParser documents are inert: no scripts run, no images load, while parsing.
  const parsed = new DOMParser().parseFromString(`<body>${html}</body>`, "text/html");
  const fragment = document.createDocumentFragment();
  rebuild(parsed.body, fragment);
  return fragment;
}

/** The first pass alone: Markdown to an HTML string (escaped, but not yet whitelisted). */
export function markdownToHtml(source, { idPrefix = "md" } = {}) {
  const lines = String(source ?? "").replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n");
  const sources = new Set();
  for (const line of lines) {
    const match = line.match(SOURCE);
    if (match) sources.add(match[1]);
  }
  return renderBlocks(lines, { idPrefix: SAFE_ID.test(idPrefix) ? idPrefix : "md", sources });
}

/** Markdown as safe DOM nodes; `idPrefix` keeps each message's source anchors unique in the page. */
export function renderMarkdown(source, options = {}) {
  return sanitize(markdownToHtml(source, options));
}
