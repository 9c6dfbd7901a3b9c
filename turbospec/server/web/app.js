// turbospec's web page: chat over /v1/chat/completions (streamed) and the lab's reports (/lab/...).
// Plain browser JavaScript, no build step, no network fetches beyond this server. Text from the model and from
// reports is only ever set with textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { props: null, messages: [], busy: false, controller: null, reports: [] };

// ---- settings, kept in localStorage -------------------------------------------------------------------------
for (const id of ["temperature", "max-tokens", "system", "api-key"]) {
  const saved = localStorage.getItem("turbospec." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("turbospec." + id, $(id).value));
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function getJSON(path) {
  const r = await fetch(path, { headers: headers(false) });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || `${path}: HTTP ${r.status}`);
  return body;
}

function el(tag, attrs = {}, text = null) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}

// ---- tabs ---------------------------------------------------------------------------------------------------
function route() {
  const reports = location.hash === "#reports";
  $("chat-view").hidden = reports;
  $("reports-view").hidden = !reports;
  $("tab-chat").classList.toggle("active", !reports);
  $("tab-reports").classList.toggle("active", reports);
  if (reports) loadReports();
}
window.addEventListener("hashchange", route);

async function loadProps() {
  try {
    const p = state.props = await getJSON("/props");
    let info = `${p.model} · ctx ${p.n_ctx} · KV ${p.cache_type_k}/${p.cache_type_v}`;
    if (p.spec_types.length) info += ` · draft ${p.spec_types.join("+")}`;
    $("model-info").textContent = info;
  } catch (e) {
    $("model-info").textContent = e.message;
  }
}

// ---- chat ---------------------------------------------------------------------------------------------------
function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  state.messages.forEach((m, i) => {
    const div = el("div", { class: "msg " + m.role, "data-index": i });
    div.append(el("div", { class: "text" }, m.content));
    if (m.role === "assistant") {
      div.append(el("div", { class: "stats" }, m.stats || ""));
      if (i === state.messages.length - 1 && !state.busy) {
        const actions = el("div", { class: "actions" });
        const regen = el("button", { type: "button", class: "regenerate" }, "Regenerate");
        regen.addEventListener("click", regenerate);
        actions.append(regen);
        div.append(actions);
      }
    }
    box.append(div);
  });
  box.lastElementChild && box.lastElementChild.scrollIntoView({ block: "end" });
}

// the conversation survives a reload (as llama-server's page keeps its conversations), in this browser only
function saveChat() {
  try { localStorage.setItem("turbospec.chat", JSON.stringify(state.messages)); } catch (e) { /* full: skip */ }
}
function loadChat() {
  try {
    const saved = JSON.parse(localStorage.getItem("turbospec.chat") || "[]");
    if (Array.isArray(saved)) {
      state.messages = saved.filter((m) => m && (m.role === "user" || m.role === "assistant")
        && typeof m.content === "string");
    }
  } catch (e) { state.messages = []; }
  renderMessages();
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

function statsLine(s) {
  const parts = [];
  if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} t/s`);
  if (s.ttft !== null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (s.tokens !== null) parts.push(`${s.tokens} tokens`);  // the server's count: unknown when stopped early
  if (s.promptTokens !== null) parts.push(`prompt ${s.promptTokens}${s.cached ? ` (${s.cached} cached)` : ""}`);
  if (s.drafted) parts.push(`acceptance ${(100 * s.accepted / s.drafted).toFixed(0)}% (${s.accepted}/${s.drafted})`);
  if (state.props) parts.push(`KV ${state.props.cache_type_k}/${state.props.cache_type_v}`);
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

async function generate() {
  const reply = { role: "assistant", content: "", stats: "waiting…" };
  const history = state.messages.map(({ role, content }) => ({ role, content }));
  const system = $("system").value.trim();
  if (system) history.unshift({ role: "system", content: system });
  state.messages.push(reply);
  $("chat-error").hidden = true;
  setBusy(true);
  renderMessages();
  const textNode = $("messages").lastElementChild.querySelector(".text");
  const statsNode = $("messages").lastElementChild.querySelector(".stats");
  const s = { tps: null, ttft: null, tokens: null, promptTokens: null, cached: 0, drafted: 0, accepted: 0,
              finish: null };
  const t0 = performance.now();
  const controller = state.controller = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), signal: controller.signal,
      body: JSON.stringify({
        messages: history, stream: true, stream_options: { include_usage: true },
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(msg.error.message);
          const choice = msg.choices && msg.choices[0];
          if (choice && choice.delta && choice.delta.content) {
            if (s.ttft === null) s.ttft = performance.now() - t0;
            reply.content += choice.delta.content;
            textNode.textContent = reply.content;
          }
          if (choice && choice.finish_reason) s.finish = choice.finish_reason;
          if (msg.timings) {
            s.tps = msg.timings.predicted_per_second;
            s.tokens = msg.timings.predicted_n;
            s.promptTokens = msg.timings.prompt_n + msg.timings.cache_n;
            s.cached = msg.timings.cache_n;
            s.drafted = msg.timings.draft_n;
            s.accepted = msg.timings.draft_n_accepted;
          }
          if (msg.usage) s.tokens = msg.usage.completion_tokens;
        }
      }
      statsNode.textContent = statsLine(s);
    }
  } catch (e) {
    if (e.name === "AbortError") {
      s.finish = "stopped";
    } else {
      $("chat-error").textContent = e.message;
      $("chat-error").hidden = false;
      s.finish = "error";
    }
  } finally {
    reply.stats = statsLine(s);
    state.controller = null;
    setBusy(false);
    renderMessages();
    saveChat();
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.busy) return;
  state.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  generate();
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.busy) return;
  state.messages = [];
  renderMessages();
  saveChat();
});

function regenerate() {
  if (state.busy) return;
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
    state.messages.pop();
  }
  generate();
}

// ---- reports ------------------------------------------------------------------------------------------------
async function loadReports() {
  let list;
  try {
    list = (await getJSON("/lab/reports")).reports;
  } catch (e) {
    $("report").replaceChildren(el("p", { class: "error" }, e.message));
    return;
  }
  state.reports = list;
  const ul = $("report-list");
  ul.replaceChildren();
  $("reports-empty").hidden = list.length > 0;
  for (const r of list) {
    const li = el("li", { "data-id": r.id });
    li.append(el("span", { class: "kind" }, r.kind), document.createTextNode(r.title));
    li.append(el("div", { class: "muted" }, [r.created, r.commit].filter(Boolean).join(" · ")));
    li.addEventListener("click", () => showReport(r.id));
    ul.append(li);
  }
  const runs = list.filter((r) => r.source === "history");
  $("compare-box").hidden = runs.length < 2;
  for (const [id, pick] of [["compare-a", 1], ["compare-b", 0]]) {
    const sel = $(id);
    sel.replaceChildren(...runs.map((r) => el("option", { value: r.id }, r.title)));
    if (runs[pick]) sel.value = runs[pick].id;
  }
}

const COLUMNS = [
  "engine", "label", "config", "kv_type", "mode", "max_ctx", "ctk", "ctv", "pair", "kv", "depth", "category",
  "n_prompt", "n_gen", "code_tps", "prose_tps", "peak_mib", "loss_pct", "prefill_tps", "decode_tps",
  "decode_tps_sd", "ttft_ms", "acc_rate", "mean_acc_len", "decode_loss_vs_d0_pct", "peak_rss_mib", "ppl",
  "kld_mean", "kld_p99", "same_top1_pct", "rms_dp_pct", "chunks", "tokens_scored",
];

function table(rows, cols) {
  cols = cols.filter((c) => rows.some((r) => r[c] !== undefined && r[c] !== null && r[c] !== ""));
  const t = el("table");
  const head = el("tr");
  for (const c of cols) head.append(el("th", { class: "text" }, c));
  t.append(head);
  for (const r of rows) {
    const tr = el("tr");
    for (const c of cols) {
      const v = r[c];
      const text = typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4))
        : v === undefined || v === null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
      tr.append(el("td", { class: typeof v === "number" ? "" : "text" }, text));
    }
    t.append(tr);
  }
  return t;
}

function reportRows(report) {
  if (Array.isArray(report.rows)) return report.rows;
  for (const v of Object.values(report)) {
    if (Array.isArray(v) && v.length && typeof v[0] === "object") return v;
  }
  return [];
}

async function plotImage(id, name) {
  const r = await fetch(`/lab/plots/${encodeURIComponent(id)}/${encodeURIComponent(name)}.svg`,
    { headers: headers(false) });
  if (!r.ok) throw new Error(`plot ${name}: HTTP ${r.status}`);
  const img = el("img", { alt: name, "data-plot": name });
  const url = URL.createObjectURL(await r.blob());
  const free = () => URL.revokeObjectURL(url);  // once drawn the image keeps its pixels: free the blob
  img.addEventListener("load", free, { once: true });
  img.addEventListener("error", free, { once: true });
  img.src = url;
  return img;
}

// the view the user asked for last: a report or a comparison whose answer comes after a newer request is dropped
let shown = 0;

async function showReport(id) {
  const ticket = ++shown;
  for (const li of $("report-list").children) li.classList.toggle("active", li.dataset.id === id);
  const art = $("report");
  art.replaceChildren(el("p", { class: "muted" }, "loading…"));
  let data;
  try {
    data = await getJSON(`/lab/reports/${encodeURIComponent(id)}`);
  } catch (e) {
    if (ticket === shown) art.replaceChildren(el("p", { class: "error" }, e.message));
    return;
  }
  if (ticket !== shown) return;
  const meta = state.reports.find((r) => r.id === id);
  art.replaceChildren(el("h2", {}, `${data.kind}: ${meta ? meta.title : id}`));
  const plots = el("div", { class: "plots" });
  art.append(plots);
  const rows = reportRows(data.report);
  if (rows.length) {
    const present = COLUMNS.filter((c) => rows.some((r) => c in r));
    const cols = present.length ? present : Object.keys(rows[0]).slice(0, 12);
    art.append(el("h3", {}, "Results"), table(rows, cols));
  }
  const env = data.report.env;
  if (env && typeof env === "object") {
    art.append(el("h3", {}, "Environment"),
      table(Object.entries(env).map(([k, v]) => ({ key: k, value: v })), ["key", "value"]));
  }
  if (!data.plots.length) plots.append(el("p", { class: "muted" }, "No plots for this report (nothing to draw)."));
  // every plot requested at once, shown in the report's order
  await Promise.all(data.plots.map(async (name) => {
    const box = el("div", { class: "plot" });
    box.append(el("h3", {}, name.replaceAll("_", " ")));
    plots.append(box);
    try {
      box.append(await plotImage(id, name));
    } catch (e) {
      box.append(el("p", { class: "error" }, e.message));
    }
  }));
}

$("compare").addEventListener("click", async () => {
  const a = $("compare-a").value, b = $("compare-b").value;
  const art = $("report");
  const ticket = ++shown;
  art.replaceChildren(el("p", { class: "muted" }, "comparing…"));
  try {
    const data = await getJSON(`/lab/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
    if (ticket !== shown) return;
    const title = (id) => (state.reports.find((r) => r.id === id) || { title: id }).title;
    art.replaceChildren(el("h2", {}, "Compare runs"), el("p", { class: "muted" }, `A = ${title(a)}`),
      el("p", { class: "muted" }, `B = ${title(b)}`));
    const num = (v) => (typeof v === "number" ? Number(v.toPrecision(4)) : v);
    const range = (lo, hi) => (typeof lo === "number" && typeof hi === "number" ? `${num(lo)}–${num(hi)}` : "");
    const rows = data.rows.map((r) => ({
      engine: r.engine, config: r.config, depth: r.depth, category: r.category, metric: r.metric || "(row)",
      "A median": num(r.a_median), "A range": range(r.a_min, r.a_max), "B median": num(r.b_median),
      "B range": range(r.b_min, r.b_max),
      change: typeof r.change_pct === "number" ? `${r.change_pct >= 0 ? "+" : ""}${r.change_pct.toFixed(1)}%` : "",
      verdict: r.verdict,
    }));
    const t = table(rows, ["engine", "config", "depth", "category", "metric", "A median", "A range", "B median",
      "B range", "change", "verdict"]);
    for (const td of t.querySelectorAll("td")) {
      const v = td.textContent;
      if (v === "slower" || v === "faster") td.classList.add("verdict-" + v);
    }
    art.append(t);
  } catch (e) {
    if (ticket === shown) art.replaceChildren(el("p", { class: "error" }, e.message));
  }
});

$("api-key").addEventListener("change", () => {  // a key typed after the page loaded: fetch what it guards
  loadProps();
  if (location.hash === "#reports") loadReports();
});
loadProps();
loadChat();
route();
