/* A folder uploaded as an artifact version, in resumable chunks, through the management API
   (docs/artifacts.md). A <form data-artifact-upload> holds: a folder picker (input[type=file]),
   a "name" input (the artifact's name), optionally a "base_model" select (a tenant's adapter is
   registered from the version once it is made), and data attributes: data-api (the API root),
   data-kind ("model" or "adapter"), data-tenant (the tenant's slug, for adapters), data-chunk
   (bytes per chunk), data-zip (the portal's adapter form: with no folder chosen, a chosen .zip
   is posted as the form itself). Each file is hashed in the browser (js-sha256, static/vendor, read in
   slices), announced, then sent chunk by chunk; a chunk the console refuses with 409 resumes
   from the byte it names, and an upload interrupted (a closed tab, a lost connection) resumes
   where it stopped when the same folder is chosen again (its import id is kept in
   localStorage). Progress and every error are shown in the form's [data-status]. */
(function () {
  "use strict";
  const SLICE = 8 * 1024 * 1024;

  function csrfToken(form) {
    const input = form.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  async function call(form, method, url, body, headers) {
    const options = {method: method, credentials: "same-origin",
                     headers: Object.assign({"X-CSRFToken": csrfToken(form)}, headers || {})};
    if (body !== undefined) options.body = body;
    const reply = await fetch(url, options);
    let data = {};
    try { data = await reply.json(); } catch (error) { data = {}; }
    return {status: reply.status, data: data};
  }

  function json(form, method, url, payload) {
    return call(form, method, url, JSON.stringify(payload), {"Content-Type": "application/json"});
  }

  function message(data) {
    if (typeof data === "string") return data;
    return Object.entries(data || {}).map(function (entry) {
      const value = Array.isArray(entry[1]) ? entry[1].join(" ") :
        (typeof entry[1] === "object" ? message(entry[1]) : String(entry[1]));
      return entry[0] === "detail" ? value : entry[0] + ": " + value;
    }).join("; ");
  }

  function relativePath(file) {
    const parts = (file.webkitRelativePath || file.name).split("/");
    return parts.length > 1 ? parts.slice(1).join("/") : parts[0];  // without the folder's name
  }

  async function digest(file, progress) {
    const hash = sha256.create();
    for (let offset = 0; offset < file.size; offset += SLICE) {
      hash.update(await file.slice(offset, offset + SLICE).arrayBuffer());
      progress(Math.min(offset + SLICE, file.size));
    }
    return hash.hex();
  }

  function formatBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  async function artifactFor(form, api, name) {
    const kind = form.dataset.kind, tenant = form.dataset.tenant || null;
    if (form.dataset.artifact) return {id: form.dataset.artifact};
    const query = "?name=" + encodeURIComponent(name) + "&kind=" + kind +
      (tenant ? "&tenant__slug=" + encodeURIComponent(tenant) : "");
    const found = await call(form, "GET", api + "artifacts/" + query);
    const rows = (found.data && found.data.results) || [];
    const same = rows.find(function (row) { return row.name === name && row.tenant === tenant; });
    if (same) return same;
    const made = await json(form, "POST", api + "artifacts/", {name: name, kind: kind, tenant: tenant});
    if (made.status !== 201) throw new Error(message(made.data));
    return made.data;
  }

  async function run(form, show) {
    const api = form.dataset.api, chunk = Number(form.dataset.chunk) || 16 * 1024 * 1024;
    const picker = form.querySelector("input[name=folder]") || form.querySelector("input[type=file]");
    const files = Array.from(picker.files || []);
    const nameInput = form.elements.namedItem("name");
    const name = nameInput ? nameInput.value.trim() : "";
    if (!files.length) throw new Error("Choose the folder to upload.");
    if (!form.dataset.artifact && !name) throw new Error("name: give the artifact a name.");
    const total = files.reduce(function (sum, f) { return sum + f.size; }, 0);
    let hashed = 0;
    const announced = [];
    const byDigest = {};
    for (const file of files) {
      const before = hashed;
      const sha = await digest(file, function (done) {
        show("Checking the files: " + formatBytes(before + done) + " of " + formatBytes(total), (before + done) / total);
      });
      hashed += file.size;
      announced.push({path: relativePath(file), size: file.size, sha256: sha});
      byDigest[sha] = file;
    }
    const artifact = await artifactFor(form, api, name);
    const key = "artifact-upload:" + artifact.id + ":" + JSON.stringify(announced);
    let record = null;
    const kept = window.localStorage.getItem(key);
    if (kept) {
      const again = await call(form, "GET", api + "artifact-imports/" + kept + "/");
      // Only an upload still waiting for bytes resumes (an abandoned one has failed).
      if (again.status === 200 && again.data.state === "waiting") record = again.data;
    }
    if (!record) {
      const started = await json(form, "POST", api + "artifacts/" + artifact.id + "/uploads/", {files: announced});
      if (started.status !== 201) throw new Error(message(started.data));
      record = started.data;
      window.localStorage.setItem(key, String(record.id));
    }
    let done = record.bytes_done;
    for (const item of record.files) {
      let offset = item.received;
      const file = byDigest[item.sha256];
      while (offset < item.size) {
        const end = Math.min(offset + chunk, item.size);
        const reply = await call(form, "PUT", api + "artifact-imports/" + record.id + "/blobs/" + item.sha256 + "/",
          file.slice(offset, end), {"Content-Type": "application/octet-stream",
                                    "Content-Range": "bytes " + offset + "-" + (end - 1) + "/" + item.size});
        if (reply.status === 409 && reply.data.received !== undefined && reply.data.received !== offset) {
          offset = reply.data.received;  // resume where the console stands
          continue;
        }
        if (reply.status === 400 && reply.data.upload) {
          // Abandoned (a day without bytes): the next try starts a new upload.
          window.localStorage.removeItem(key);
          throw new Error(message(reply.data));
        }
        if (reply.status !== 200) throw new Error(item.path + ": " + message(reply.data));
        offset = end;
        done = reply.data.bytes_done;
        show("Uploading " + item.path + ": " + formatBytes(done) + " of " + formatBytes(record.bytes_total), done / record.bytes_total);
      }
    }
    const finished = await call(form, "POST", api + "artifact-imports/" + record.id + "/complete/");
    if (finished.status !== 200) {
      if (finished.status === 400 && finished.data.upload) window.localStorage.removeItem(key);
      throw new Error(message(finished.data));
    }
    window.localStorage.removeItem(key);
    const base = form.elements.namedItem("base_model");
    if (base && base.value) {
      // The API names a base model; a select whose values are ids gives it in data-name.
      const chosen = base.selectedOptions && base.selectedOptions[0];
      const baseName = (chosen && chosen.dataset.name) || base.value;
      const versions = (await call(form, "GET", api + "artifacts/" + artifact.id + "/")).data.versions || [];
      const version = versions.find(function (v) { return v.number === finished.data.version; });
      const adapter = await json(form, "POST", api + "adapters/", {tenant: form.dataset.tenant, base_model: baseName,
        name: name, artifact_version: version && version.id});
      if (adapter.status !== 201) throw new Error("Uploaded as version " + finished.data.version + ", but the adapter was not registered: " + message(adapter.data));
    }
    show("Done: version " + finished.data.version + " (" + formatBytes(record.bytes_total) + ").", 1);
  }

  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (!form.matches || !form.matches("form[data-artifact-upload]")) return;
    if (form.dataset.zip !== undefined) {
      // One form, two ways in: a folder goes up in chunks here; a .zip is posted whole.
      const folder = form.querySelector("input[name=folder]");
      const archive = form.querySelector("input[name=archive]");
      const chosen = folder && folder.files && folder.files.length;
      if (!chosen && archive && archive.files && archive.files.length) return;
      if (!chosen) {
        event.preventDefault();
        const said = form.querySelector("[data-status]");
        said.textContent = "Choose the adapter's folder, or a .zip of it.";
        said.classList.add("error");
        return;
      }
    }
    event.preventDefault();
    const status = form.querySelector("[data-status]");
    const bar = form.querySelector("progress");
    const button = form.querySelector("button[type=submit]");
    function show(text, fraction) {
      status.textContent = text;
      status.classList.remove("error");
      if (bar) bar.value = fraction;
    }
    button.disabled = true;
    run(form, show).then(function () {
      if (form.dataset.reload !== undefined) window.setTimeout(function () { window.location.reload(); }, 800);
    }).catch(function (error) {
      status.textContent = error.message;
      status.classList.add("error");
    }).finally(function () { button.disabled = false; });
  });
})();
