// The chat page.
const toggle = document.getElementById("panel-toggle");
const panel = document.getElementById("task-panel");
toggle?.addEventListener("click", () => {
  const open = panel.hidden;
  panel.hidden = !open;
  toggle.setAttribute("aria-expanded", String(open));
});
