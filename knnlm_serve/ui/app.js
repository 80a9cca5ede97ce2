// The kNN page (docs/serving.md#the-knn-page): the server's own API, called from the browser.
// Keys and the admin token live in this tab's inputs only: never stored, never sent elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const KNOBS = ["knn_lambda", "knn_k", "knn_temperature", "knn_skip_threshold", "knn_pointers"];
const TIMEOUT_MS = 180000;

class ApiError extends Error {}

function headers(admin) {
  const h = { "Content-Type": "application/json" };
  if ($("api-key").value) h["Authorization"] = `Bearer ${$("api-key").value}`;
  if (admin && $("admin-token").value) h["X-Admin-Token"] = $("admin-token").value;
  return h;
}

function errorText(body, status) {
  const e = body && body.error;
  if (!e) return `HTTP ${status}`;
  const message = typeof e === "string" ? e : e.message;
  return e.param ? `${message} (field: ${e.param})` : message;
}

async function api(method, path, body, admin = false) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
  try {
    const response = await fetch(path, {
      method, headers: headers(admin), body: body === undefined ? undefined : JSON.stringify(body), signal: controller.signal,
    });
    const data = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(errorText(data, response.status));
    return data;
  } catch (e) {
    throw e instanceof ApiError ? e : new ApiError(`the request failed: ${e.message}`);
  } finally {
    clearTimeout(timer);
  }
}

// What the user typed, as JSON: a number where it reads as one; other text is sent as it is, for
// the server to refuse by the field's name.
function typed(raw) {
  if (raw === "") return undefined;
  const n = Number(raw);
  return Number.isNaN(n) ? raw : n;
}

function knobs() {
  const xargs = {};
  for (const id of KNOBS) {
    const v = typed($(id).value.trim());
    if (v !== undefined) xargs[id] = v;
  }
  if ($("datastore").value) xargs.knn_datastore = $("datastore").value;
  return xargs;
}

function showError(where, message) {
  $(where).textContent = message;
  $(where).hidden = !message;
}

// One streamed completion or chat; `onText` gets each piece, the result is the whole text and the
// first event's knn_context. Errors (before or inside the stream) are thrown with the API's message.
async function stream(chat, prompt, xargs, maxTokens, onText) {
  const body = { model: window.servedModel, max_tokens: maxTokens, temperature: 0, stream: true, vllm_xargs: xargs };
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
  let text = "", context = null;
  try {
    const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers(false), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new ApiError(errorText(await response.json().catch(() => null), response.status));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      const events = pending.split("\n\n");
      pending = events.pop();
      for (const event of events) {
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const data = JSON.parse(event.slice(6));
        if (data.error) throw new ApiError(errorText(data, data.error.code));
        if (data.knn_context) context = data.knn_context;
        const choice = (data.choices || [])[0];
        const piece = choice ? (chat ? (choice.delta && choice.delta.content) || "" : choice.text || "") : "";
        text += piece;
        onText(text);
      }
    }
  } catch (e) {
    throw e instanceof ApiError ? e : new ApiError(`the stream failed: ${e.message}`);
  } finally {
    clearTimeout(timer);
  }
  return { text, context };
}

function shade(share) {
  return `rgba(31, 111, 235, ${(0.08 + 0.72 * share).toFixed(3)})`;
}

// The kNN-on output as tokens, each shaded by λ·p_kNN / p and opening its neighbours on a click.
function renderExplained(explained) {
  const out = $("out-on");
  out.textContent = "";
  explained.tokens.forEach((t, i) => {
    const span = document.createElement("span");
    const share = t.p > 0 && t.p_knn !== null ? Math.min(1, (t.lambda * t.p_knn) / t.p) : 0;
    span.className = "tok";
    span.textContent = t.token;
    span.dataset.index = i;
    span.dataset.share = share.toFixed(4);
    span.style.background = share > 0 ? shade(share) : "transparent";
    span.title = `from the datastore: ${(100 * share).toFixed(1)} %`;
    span.addEventListener("click", () => showToken(explained, i, span));
    out.appendChild(span);
  });
}

function showToken(explained, i, span) {
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
  span.classList.add("selected");
  const t = explained.tokens[i];
  $("token").hidden = false;
  $("token-text").textContent = JSON.stringify(t.token);
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
  $("token-mix").textContent = `p ${pct(t.p)} = λ ${t.lambda.toFixed(2)} · p_kNN ${pct(t.p_knn)} + (1 − λ) · p_LM ${pct(t.p_lm)}; search: ${t.status}`;
  const rows = $("neighbours");
  rows.textContent = "";
  for (const n of t.neighbours) {
    const tr = document.createElement("tr");
    const doc = document.createElement("td");
    if (n.forgotten) doc.textContent = "(forgotten)";
    else {
      const link = document.createElement("a");
      link.href = "#";
      link.className = "document";
      link.textContent = n.id !== null && n.id !== undefined ? n.id : `#${n.document}`;
      link.addEventListener("click", (e) => { e.preventDefault(); openDocument(explained.datastore.name, n.document); });
      doc.appendChild(link);
    }
    tr.appendChild(doc);
    const snippet = document.createElement("td");
    snippet.className = "snippet";
    if (n.snippet) {
      const [before, rest] = n.snippet.split("[[");
      const [next, after] = (rest || "").split("]]");
      const mark = document.createElement("mark");
      mark.textContent = next;
      snippet.append(before, mark, after || "");
    }
    for (const cell of [n.source || "", snippet, n.distance.toFixed(3), n.weight.toFixed(3)]) {
      const td = cell instanceof Node ? cell : document.createElement("td");
      if (!(cell instanceof Node)) td.textContent = cell;
      tr.appendChild(td);
    }
    rows.appendChild(tr);
  }
}

async function openDocument(datastore, document_) {
  try {
    const doc = await api("GET", `/v1/knn/documents/${encodeURIComponent(datastore)}/${document_}`);
    $("document").hidden = false;
    $("document-title").textContent = `${doc.id !== null ? doc.id : "#" + doc.document} (${doc.source}, ${doc.tokens} tokens)`;
    $("document-text").textContent = doc.text;
  } catch (e) {
    showError("error", e.message);
  }
}

function showPassages(context) {
  $("passages").hidden = !context;
  const list = $("passage-list");
  list.textContent = "";
  if (!context) return;
  for (const p of context.passages) {
    const li = document.createElement("li");
    li.className = "passage";
    const where = document.createElement("div");
    where.className = "where";
    where.textContent = `${p.id !== null ? p.id : "#" + p.document} (${p.source}), tokens ${p.span[0]}–${p.span[1]}, relevance ${p.relevance}`;
    const text = document.createElement("blockquote");
    text.className = "passage-text";
    text.textContent = p.text || "";
    li.append(where, text);
    list.appendChild(li);
  }
  if (!context.passages.length) list.textContent = `no passage passed the datastore's relevance gate (${context.gated} gated)`;
}

async function run() {
  showError("error", "");
  $("token").hidden = true;
  $("document").hidden = true;
  $("run").disabled = true;
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  const prompt = $("prompt").value;
  const maxTokens = typed($("max_tokens").value.trim());
  const xargs = knobs();
  const context = typed($("knn_context").value.trim());
  try {
    $("out-off").textContent = "";
    $("out-on").textContent = "";
    const [, on] = await Promise.all([  // side by side: the server batches the two
      stream(chat, prompt, { knn: false }, maxTokens, (t) => ($("out-off").textContent = t)),
      stream(chat, prompt, { ...xargs, knn: true, ...(context ? { knn_context: context } : {}) }, maxTokens,
        (t) => ($("out-on").textContent = t)),
    ]);
    showPassages(on.context);
    if (!chat && on.text) {
      // Scored against the prompt as typed: with passages, their prompt differs, and so may the shares.
      const explained = await api("POST", "/v1/knn/explain", {
        prompt, completion: on.text, snippet_tokens: 12, vllm_xargs: { ...xargs, knn_explain: 5 },
      });
      renderExplained(explained);
    }
  } catch (e) {
    showError("error", e.message);
  } finally {
    $("run").disabled = false;
  }
}

async function refresh() {
  showError("admin-error", "");
  try {
    const listing = await api("GET", "/v1/knn/datastores", undefined, true);
    const rows = $("datastore-rows");
    rows.textContent = "";
    const names = [];
    for (const d of listing.datastores) {
      if (d.status && d.status !== "serving") continue;
      names.push(d.name);
      const defaults = d.defaults || {};
      const cells = [d.name, d.version, d.entries.toLocaleString(), d.documents ?? "–", d.healthy === false ? `unhealthy: ${d.error}` : "ok",
        defaults.lambda_ ?? "adaptive", defaults.k ?? "–", defaults.temperature ?? "–", (defaults.source || {}).lambda || "–"];
      const tr = document.createElement("tr");
      tr.dataset.name = d.name;
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = c;
        tr.appendChild(td);
      }
      rows.appendChild(tr);
    }
    const select = $("datastore");
    const chosen = select.value;
    select.textContent = "";
    select.append(new Option(`(the default${listing.default ? ": " + listing.default : ""})`, ""));
    for (const name of names) select.append(new Option(name, name));
    select.value = names.includes(chosen) ? chosen : "";
  } catch (e) {
    showError("admin-error", `${e.message} — with an admin token or an API key, the datastores are listed`);
  }
}

async function follow(job) {
  for (;;) {
    $("job").textContent = `${job.kind} ${job.id}: ${job.state}${job.progress ? " — " + job.progress : ""}${job.error ? " — " + job.error : ""}`;
    if (job.state !== "running") return job;
    await new Promise((r) => setTimeout(r, 1000));
    job = await api("GET", `/v1/knn/jobs/${job.id}`, undefined, true);
  }
}

async function admin(action) {
  showError("admin-error", "");
  try {
    if (action === "add") {
      const text = { text: $("add-text").value, ...($("add-id").value ? { id: $("add-id").value } : {}) };
      const job = await api("POST", `/v1/knn/datastores/${encodeURIComponent($("add-datastore").value)}/documents`, { texts: [text] }, true);
      await follow(job);
    } else {
      const name = encodeURIComponent($("forget-datastore").value), doc = encodeURIComponent($("forget-document").value);
      await follow(await api("DELETE", `/v1/knn/datastores/${name}/documents/${doc}`, undefined, true));
    }
    await refresh();
  } catch (e) {
    showError("admin-error", e.message);
  }
}

// Vector stores: the key's own, through the OpenAI API routes (docs/vector-stores.md).
async function refreshStores() {
  showError("store-error", "");
  try {
    const stores = (await api("GET", "/v1/vector_stores?limit=100")).data;
    const filesOf = [];
    for (const store of stores) filesOf.push((await api("GET", `/v1/vector_stores/${store.id}/files?limit=100`)).data);
    // Everything fetched: the table and the store choice change at once, never seen half-built.
    const rows = $("store-rows");
    rows.textContent = "";
    const select = $("upload-store");
    const chosen = select.value;
    select.textContent = "";
    for (const [i, store] of stores.entries()) {
      const files = filesOf[i];
      const tr = document.createElement("tr");
      tr.dataset.id = store.id;
      const listed = files.map((f) => `${f.id}: ${f.status}${f.last_error ? " (" + f.last_error.message + ")" : ""}`).join("\n");
      for (const c of [store.id, store.name || "", listed || "(no file)", store.status]) {
        const td = document.createElement("td");
        td.textContent = c;
        td.style.whiteSpace = "pre-line";
        tr.appendChild(td);
      }
      rows.appendChild(tr);
      select.append(new Option(`${store.name || store.id} (${store.id})`, store.id));
    }
    if (stores.some((s) => s.id === chosen)) select.value = chosen;
  } catch (e) {
    showError("store-error", e.message);
  }
}

async function createStore() {
  showError("store-error", "");
  try {
    const store = await api("POST", "/v1/vector_stores", { name: $("store-name").value || undefined });
    await refreshStores();
    $("upload-store").value = store.id;
  } catch (e) {
    showError("store-error", e.message);
  }
}

// Upload the chosen file, attach it to the chosen store, and follow its status as OpenAI's client does.
async function upload() {
  showError("store-error", "");
  const file = $("upload-file").files[0], store = $("upload-store").value;
  if (!file || !store) return showError("store-error", "choose a store and a file");
  try {
    const form = new FormData();
    form.append("purpose", "assistants");
    form.append("file", file);
    const h = headers(false);
    delete h["Content-Type"];  // the browser sets the multipart boundary
    const response = await fetch("/v1/files", { method: "POST", headers: h, body: form });
    const made = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(errorText(made, response.status));
    let attached = await api("POST", `/v1/vector_stores/${store}/files`, { file_id: made.id });
    while (attached.status === "in_progress") {
      $("upload-status").textContent = `${file.name} (${made.id}): in progress`;
      await new Promise((r) => setTimeout(r, 500));
      attached = await api("GET", `/v1/vector_stores/${store}/files/${made.id}`);
    }
    await refreshStores();  // the table shows the file's status by the time the status line does
    $("upload-status").textContent = `${file.name} (${made.id}): ${attached.status}${attached.last_error ? " — " + attached.last_error.message : ""}`;
    refresh();
  } catch (e) {
    showError("store-error", e.message);
  }
}

function tab(name) {
  for (const other of ["compare", "datastores", "stores"]) {
    $(other).hidden = other !== name;
    $(`show-${other}`).classList.toggle("active", other === name);
  }
  if (name === "datastores") refresh();
  if (name === "stores") refreshStores();
}

async function start() {
  $("run").addEventListener("click", run);
  $("refresh").addEventListener("click", refresh);
  $("add").addEventListener("click", () => admin("add"));
  $("forget").addEventListener("click", () => admin("forget"));
  $("show-compare").addEventListener("click", () => tab("compare"));
  $("show-datastores").addEventListener("click", () => tab("datastores"));
  $("show-stores").addEventListener("click", () => tab("stores"));
  $("create-store").addEventListener("click", createStore);
  $("refresh-stores").addEventListener("click", refreshStores);
  $("upload").addEventListener("click", upload);
  try {
    window.servedModel = (await api("GET", "/v1/models")).data[0].id;
  } catch (e) {
    window.servedModel = undefined; // with keys: known once one is typed (the server takes its one model then)
  }
  $("api-key").addEventListener("change", async () => {
    try { window.servedModel = (await api("GET", "/v1/models")).data[0].id; } catch (e) { showError("error", e.message); }
    refresh();
  });
  $("admin-token").addEventListener("change", refresh);
  refresh();
}

start();
