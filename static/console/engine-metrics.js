/* The engine metric charts of a deployment's or an instance's page: plotly.js and the
   dashboards' script (dashboard.js draws them), fetched once the page is parsed, so plotly's
   4.8 MB never delays htmx binding the page's buttons. */
(function () {
  "use strict";
  const root = document.getElementById("dashboard");
  if (!root) return;
  function add(src, then) {
    const script = document.createElement("script");
    script.src = src;
    if (then) script.onload = then;
    document.head.appendChild(script);
  }
  add(root.dataset.plotly, () => add(root.dataset.script));
})();
