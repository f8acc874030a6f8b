/* The capacity curve of a deployment's page: its figures are in the page (JSON, built
   server-side like the dashboards'); plotly.js is fetched once the page is parsed (unless the
   engine metrics' script already did), then each chart is drawn. */
(function () {
  "use strict";
  const root = document.getElementById("capacity-charts");
  const data = document.getElementById("capacity-figures");
  if (!root || !data) return;
  const figures = JSON.parse(data.textContent);
  const config = { displaylogo: false, responsive: true,
                   modeBarButtonsToRemove: ["lasso2d", "select2d"] };

  function draw() {
    for (const [name, figure] of Object.entries(figures)) {
      const el = document.getElementById("capacity-chart-" + name);
      if (!el) continue;
      Plotly.react(el, figure.data, figure.layout, config).then(() => {
        el.dataset.rendered = "1";
      });
    }
  }

  function whenLoaded(tries) {
    if (window.Plotly) { draw(); return; }
    if (tries === 0) {
      const script = document.createElement("script");
      script.src = root.dataset.plotly;
      script.onload = draw;
      document.head.appendChild(script);
      return;
    }
    setTimeout(() => whenLoaded(tries - 1), 100);
  }
  // The engine metrics' script fetches plotly.js too: wait a moment for it before asking again.
  whenLoaded(document.getElementById("dashboard") ? 100 : 0);
})();
