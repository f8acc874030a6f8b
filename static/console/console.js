/* Behaviour every page shares, from data attributes instead of inline scripts or on* handlers
   (the content security policy allows scripts from our static files only):
   - data-confirm on a form or a submit button: ask before submitting;
   - data-copy="<selector>" on a button: copy that element's text to the clipboard;
   - data-autosubmit on a select: submit its form when it changes;
   - data-follow on a log <pre>: keep it scrolled to its end, also after htmx swaps it in;
   - data-show-when="<name>=<value>" on a form field's wrapper: show it (and send its inputs)
     only while the form's control <name> has that value (MPS's thread percentage). */
(function () {
  "use strict";

  document.addEventListener("submit", function (event) {
    const form = event.target;
    const submitter = event.submitter;
    const message = (submitter && submitter.dataset.confirm) || form.dataset.confirm;
    if (message && !window.confirm(message)) event.preventDefault();
  });

  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.querySelector(button.dataset.copy);
    if (source && navigator.clipboard) navigator.clipboard.writeText(source.textContent);
    button.textContent = "Copied";
  });

  function showWhen(root) {
    root.querySelectorAll("[data-show-when]").forEach(function (wrapper) {
      const form = wrapper.closest("form");
      const [name, value] = wrapper.dataset.showWhen.split("=");
      const control = form && form.elements.namedItem(name);
      if (!control) return;
      const shown = control.value === value;
      wrapper.hidden = !shown;
      wrapper.querySelectorAll("input, select, textarea").forEach(function (input) {
        input.disabled = !shown;
      });
    });
  }
  document.addEventListener("DOMContentLoaded", function () { showWhen(document); });

  document.addEventListener("change", function (event) {
    if (event.target.form) showWhen(event.target.form);
    const select = event.target;
    if (select.matches && select.matches("select[data-autosubmit]") && select.form) {
      select.form.submit();
    }
  });

  function follow(root) {
    root.querySelectorAll("pre[data-follow]").forEach(function (el) {
      el.scrollTop = el.scrollHeight;
    });
  }
  document.addEventListener("DOMContentLoaded", function () { follow(document); });
  document.addEventListener("htmx:afterSwap", function (event) { follow(event.target); });
})();
