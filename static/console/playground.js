/* Playground: chat through the gateway (/v1/chat/completions) with streaming (server-sent
   events read from fetch's body stream). The key never leaves this page's memory. */
(function () {
  "use strict";
  const settings = document.getElementById("playground-settings");
  if (!settings) return;
  const $ = (id) => document.getElementById(id);
  const chat = $("pg-chat"), input = $("pg-input"), form = $("pg-form"), stats = $("pg-stats");
  const history = [];
  let lastBody = null;  // the last request's body, for "What the engine received"

  function csrf() {
    const m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return m ? decodeURIComponent(m[1]) : "";
  }

  function bubble(kind, text) {
    const empty = $("pg-empty");
    if (empty) empty.remove();
    const el = document.createElement("div");
    el.className = "msg " + kind;
    el.textContent = text;
    chat.appendChild(el);
    chat.scrollTop = chat.scrollHeight;
    return el;
  }

  // A test model's answers are noise by design: say so while it is the chosen one.
  const model = $("pg-model"), modelNote = $("pg-model-note");
  function showModelNote() {
    const chosen = model.selectedOptions[0];
    const noise = chosen ? chosen.dataset.noise : "";
    modelNote.textContent = noise || "";
    modelNote.hidden = !noise;
  }
  model.addEventListener("change", showModelNote);
  showModelNote();

  // "Paste a key first" stands only until a key is there (pasted, typed or created).
  const keyInput = $("pg-key");
  function keyArrived() {
    if (keyInput.value.trim()) chat.querySelectorAll("[data-needs-key]").forEach((el) => el.remove());
  }
  keyInput.addEventListener("input", keyArrived);

  const makeKey = $("pg-make-key");
  if (makeKey) {
    makeKey.addEventListener("click", async () => {
      makeKey.disabled = true;
      try {
        const r = await fetch(settings.dataset.keyUrl, { method: "POST", credentials: "same-origin",
                                                         headers: { "X-CSRFToken": csrf() } });
        if (!r.ok) throw new Error(r.status + " " + r.statusText);
        const data = await r.json();
        keyInput.value = data.secret;
        keyArrived();
        $("pg-key-note").textContent = "Key " + data.prefix + "… valid until " +
          new Date(data.expires_at).toLocaleTimeString() + ".";
      } catch (err) {
        $("pg-key-note").textContent = "Could not create a key: " + err.message;
      } finally {
        makeKey.disabled = false;
      }
    });
  }

  // The guardrail bench (server side, the gateway's own code) on the last request's body:
  // nothing of it was stored by the gateway, so it is worked out again from this page's copy.
  $("pg-engine-view").addEventListener("click", async () => {
    if (!lastBody) return;
    const target = $("pg-engine-view-result");
    const form = new URLSearchParams({ direction: "request", text: lastBody });
    try {
      const r = await fetch(settings.dataset.engineViewUrl, {
        method: "POST", credentials: "same-origin", body: form,
        headers: { "X-CSRFToken": csrf(), "HX-Request": "true" },
      });
      target.innerHTML = await r.text();
    } catch (err) {
      target.textContent = "Could not show it: " + err.message;
    }
  });

  $("pg-clear").addEventListener("click", () => {
    history.length = 0;
    chat.innerHTML = '<p class="muted" id="pg-empty">Send a message to start.</p>';
    stats.textContent = "";
  });

  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
  });

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = input.value.trim();
    const key = keyInput.value.trim();
    if (!text) return;
    if (!key) {
      if (!chat.querySelector("[data-needs-key]")) {
        bubble("error", "Paste an API key (or create a short-lived one) first.").dataset.needsKey = "1";
      }
      return;
    }
    input.value = "";
    bubble("user", text);
    history.push({ role: "user", content: text });
    const messages = [];
    const system = $("pg-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history);
    const out = bubble("assistant", "");
    out.dataset.streaming = "1";
    const started = performance.now();
    let first = null, reply = "", usage = null;
    $("pg-send").disabled = true;
    lastBody = JSON.stringify({
      model: $("pg-model").value, messages, stream: true,
      stream_options: { include_usage: true },
      max_tokens: parseInt($("pg-max").value, 10) || 64,
      temperature: parseFloat($("pg-temp").value) || 0,
    });
    $("pg-engine-view").disabled = false;
    try {
      const response = await fetch(settings.dataset.endpoint, {
        method: "POST",
        headers: { "Content-Type": "application/json", Authorization: "Bearer " + key },
        body: lastBody,
      });
      if (!response.ok) {
        let detail = response.status + " " + response.statusText;
        try { const body = await response.json(); detail = (body.error && body.error.message) || detail; } catch (x) { /* not JSON */ }
        throw new Error(detail);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, cut).trim();
          buffer = buffer.slice(cut + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "stream error");
          if (chunk.usage) usage = chunk.usage;
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            if (first === null) first = performance.now();
            reply += delta.content;
            out.textContent = reply;
            chat.scrollTop = chat.scrollHeight;
          }
        }
      }
      history.push({ role: "assistant", content: reply });
      const total = performance.now() - started;
      stats.textContent = "First token " + (first ? Math.round(first - started) + " ms" : "—") +
        " · total " + Math.round(total) + " ms" +
        (usage ? " · " + usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion tokens" : "");
      out.dataset.streaming = "0";
      out.dataset.done = "1";
    } catch (err) {
      out.remove();
      history.pop();
      bubble("error", "Request failed: " + err.message);
    } finally {
      $("pg-send").disabled = false;
    }
  });
})();
