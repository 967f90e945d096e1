// Building DOM nodes from data without ever parsing it as HTML.

/**
 * A new element: h("button", {type: "button", class: "x", onclick: f}, "text", child).
 * Strings become text nodes; null, undefined and false attributes or children are skipped.
 */
export function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") element.className = value;
    else if (name === "dataset") {
      for (const [key, data] of Object.entries(value)) {
        if (data !== null && data !== undefined) element.dataset[key] = String(data);
      }
    }
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

/** A copy of a <template>'s first element. */
export function fromTemplate(id) {
  return document.getElementById(id).content.firstElementChild.cloneNode(true);
}
