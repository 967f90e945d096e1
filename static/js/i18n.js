// The page's words in the page's language.
//
// Django's JavaScriptCatalog (the classic <script> before the modules in chat/page.html)
// defines the translations as `django.gettext` and friends; this module is the only one
// that reads them. Other modules import gettext, ngettext and interpolate from here and
// call them on literal strings, which is what `makemessages -d djangojs` looks for:
//
//   gettext("Cancel")
//   interpolate(gettext("Cancel “%(name)s”"), { name: task.name })
//   interpolate(ngettext("%(count)s quote", "%(count)s quotes", n), { count: n })
//
// Named placeholders only: translators may need to reorder them. What users and sources
// wrote (task names, questions, reports) goes in as a value and is never translated.

const catalog = globalThis.django;

/** The page's language, as <html lang> says ("en", "zh-hans"): for Intl formatters. */
export const language = document.documentElement.lang || "en";

/** `text` in the page's language (itself when there is no translation). */
export function gettext(text) {
  return catalog ? catalog.gettext(text) : text;
}

/** The singular or plural form for `count`, in the page's language. */
export function ngettext(singular, plural, count) {
  if (catalog) return catalog.ngettext(singular, plural, count);
  return count === 1 ? singular : plural;
}

/** Fill the %(name)s placeholders of a translated string from `values`. */
export function interpolate(template, values) {
  return template.replace(/%\((\w+)\)s/g, (whole, name) => (name in values ? String(values[name]) : whole));
}
