/* Behaviour every page shares, from data attributes instead of inline scripts or on* handlers
   (the content security policy allows scripts from our static files only):
   - data-confirm on a form or a submit button: ask before submitting (a scale form with
     data-scale-current and data-scale-jump: before 0 replicas or a jump to data-scale-jump);
   - data-copy="<selector>" on a button: copy that element's text to the clipboard;
   - data-autosubmit on a select: submit its form when it changes;
   - data-follow on a log <pre>: keep it scrolled to its end, also after htmx swaps it in;
   - data-show-when="<name>=<value>" on a form field's wrapper: show it (and send its inputs)
     only while the form's control <name> has that value (MPS's thread percentage). */
(function () {
  "use strict";

  // A scale form (data-scale-current, data-scale-jump) asks before 0 replicas or a big jump.
  function scaleConfirmation(form) {
    if (!form.dataset || form.dataset.scaleCurrent === undefined) return "";
    const wanted = Number(form.elements.namedItem("replicas").value);
    const current = Number(form.dataset.scaleCurrent);
    const name = form.dataset.scaleName;
    if (wanted === 0 && current !== 0) {
      return "Scale " + name + " to 0 replicas? Every instance stops and its requests fail.";
    }
    if (wanted >= Number(form.dataset.scaleJump)) {
      return "Scale " + name + " from " + current + " to " + wanted + " replicas?";
    }
    return "";
  }

  document.addEventListener("submit", function (event) {
    const form = event.target;
    const submitter = event.submitter;
    const message = (submitter && submitter.dataset.confirm) || form.dataset.confirm ||
      scaleConfirmation(form);
    if (message && !window.confirm(message)) event.preventDefault();
  });

  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.querySelector(button.dataset.copy);
    if (!source || !navigator.clipboard) return;
    const label = button.dataset.copyLabel || button.textContent;
    button.dataset.copyLabel = label;
    navigator.clipboard.writeText(source.textContent).then(function () {
      button.textContent = "Copied";
    }, function () {
      button.textContent = "Copy failed";
    });
    window.setTimeout(function () { button.textContent = label; }, 1500);
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

// A statement's "Print" button (an inline handler would need a CSP exception).
document.addEventListener("click", function (event) {
  var button = event.target.closest ? event.target.closest("[data-print]") : null;
  if (button) { window.print(); }
});
