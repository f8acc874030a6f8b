/* Dashboards: fetch the figures (built server-side with plotly) and draw them with plotly.js;
   refresh on a timer the user picks. The page holds one element per chart: #chart-<name>. */
(function () {
  "use strict";
  const root = document.getElementById("dashboard");
  if (!root) return;
  const url = root.dataset.url;
  const tables = document.getElementById("dashboard-tables");
  const stamp = document.getElementById("refreshed");
  const every = document.getElementById("refresh-every");
  const config = { displaylogo: false, responsive: true,
                   modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  let timer = null;

  function query() {
    const params = new URLSearchParams(window.location.search);
    params.set("range", root.dataset.range);
    return params.toString();
  }

  async function load() {
    root.classList.add("stale");
    try {
      const response = await fetch(url + "?" + query(), { headers: { Accept: "application/json" },
                                                         credentials: "same-origin" });
      if (!response.ok) throw new Error(response.status + " " + response.statusText);
      const data = await response.json();
      for (const [name, figure] of Object.entries(data.figures)) {
        const el = document.getElementById("chart-" + name);
        if (!el) continue;
        await Plotly.react(el, figure.data, figure.layout, config);
        const points = figure.data.reduce(
          (n, trace) => n + (trace.y || trace.x || []).filter((v) => v !== null && v !== 0).length, 0);
        el.dataset.points = String(points);
        el.dataset.rendered = "1";
        if (!el.dataset.clicks) {
          el.dataset.clicks = "1";
          el.on("plotly_click", openRequests);
        }
      }
      if (tables) tables.innerHTML = data.tables;
      if (stamp) stamp.textContent = "Updated " + new Date().toLocaleTimeString();
    } catch (err) {
      if (stamp) stamp.textContent = "Refresh failed: " + err.message;
    } finally {
      root.classList.remove("stale");
    }
  }

  /* A click on a point of a series that names its requests (`meta`: tenant, status) opens the
     request log filtered to that series and the point's bin. */
  function openRequests(event) {
    const requestsUrl = root.dataset.requestsUrl;
    const point = ((event && event.points) || []).find((p) => p.data && p.data.meta);
    const meta = point && point.data.meta;
    if (!requestsUrl || !meta || !meta.status) return;
    const since = new Date(String(point.x).replace(" ", "T") + "Z");
    if (isNaN(since.getTime())) return;
    const until = new Date(since.getTime() + parseInt(root.dataset.binSeconds, 10) * 1000);
    const params = new URLSearchParams();
    params.set("since", since.toISOString().replace(".000Z", "Z"));
    params.set("until", until.toISOString().replace(".000Z", "Z"));
    if (meta.tenant) params.set("tenant", meta.tenant);
    params.set("status", meta.status);
    const model = new URLSearchParams(window.location.search).get("model");
    if (model) params.set("model", model);
    window.location.assign(requestsUrl + "?" + params.toString());
  }

  function schedule() {
    if (timer) clearInterval(timer);
    const seconds = every ? parseInt(every.value, 10) : 0;
    if (seconds > 0) timer = setInterval(load, seconds * 1000);
    try { localStorage.setItem("dashboard-refresh", String(seconds)); } catch (e) { /* private */ }
  }

  if (every) {
    try {
      const saved = localStorage.getItem("dashboard-refresh");
      if (saved !== null) every.value = saved;
    } catch (e) { /* private mode */ }
    every.addEventListener("change", schedule);
  }
  window.addEventListener("resize", () => {
    document.querySelectorAll(".chart[data-rendered]").forEach((el) => Plotly.Plots.resize(el));
  });
  load();
  schedule();
})();
