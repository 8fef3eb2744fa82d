// splitserve web console: plain JS and SVG, no build step, nothing fetched from the network but /console/api.
"use strict";

const KEY_STORE = "splitserve.console.key";
const state = { who: null, page: null, timer: null, usageWindow: "24h", trace: null, whatif: null,
  whatifRunning: false };
const ADMIN_PAGES = ["cluster", "explorer", "whatif"];

// ------------------------------------------------------------------------------------------- helpers

function el(tag, attrs, ...kids) {
  const svg = ["svg", "path", "polyline", "line", "rect", "circle", "g", "text"].includes(tag);
  const n = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) n.addEventListener(ev, fn);
    else if (k === "style" && typeof v === "object") Object.assign(n.style, v);
    else n.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    n.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return n;
}

const $ = (id) => document.getElementById(id);
const num = (v, d = 0) => (v === null || v === undefined || Number.isNaN(v) ? "-" :
  Number(v).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: d }));
const ms = (v) => (v === null || v === undefined ? "-" : v < 10 ? `${num(v, 2)} ms` : v < 10000 ? `${num(v, 1)} ms` : `${num(v / 1000, 1)} s`);
const bytes = (b) => (b === null || b === undefined ? "-" : b >= 1 << 30 ? `${num(b / (1 << 30), 2)} GiB` :
  b >= 1 << 20 ? `${num(b / (1 << 20), 1)} MiB` : b >= 1024 ? `${num(b / 1024, 1)} KiB` : `${b} B`);

function spark(values, { w = 90, h = 22, color = "#2563eb" } = {}) {
  const pts = (values || []).map((v, i) => [i, v]).filter(([, v]) => v !== null && v !== undefined);
  const s = el("svg", { class: "spark", width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  if (pts.length < 2) return s;
  const n = values.length - 1 || 1;
  const ys = pts.map(([, v]) => v);
  const lo = Math.min(0, ...ys), hi = Math.max(...ys);
  const span = hi - lo || 1;
  const xy = pts.map(([i, v]) => `${(i / n) * (w - 2) + 1},${h - 2 - ((v - lo) / span) * (h - 4)}`);
  s.append(el("polyline", { points: xy.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
  const [lx, ly] = xy[xy.length - 1].split(",");
  s.append(el("circle", { cx: lx, cy: ly, r: 2, fill: color }));
  return s;
}

function meter(value, limit) {
  if (!limit) return el("span", { class: "hint" }, "no limit");
  const f = value / limit;
  return el("span", { class: `meter${f >= 1 ? " over" : f >= 0.8 ? " hot" : ""}`, title: `${num(100 * f, 1)}%` },
    el("span", { style: { width: `${Math.min(100, 100 * f)}%` } }));
}

function table(node, head, rows) {
  node.replaceChildren(
    el("thead", {}, el("tr", {}, head.map(([label, cls]) => el("th", { class: cls || null }, label)))),
    el("tbody", {}, rows));
}

function td(v, cls) { return el("td", { class: cls || null }, v); }

function banner(msg) {
  const b = $("banner");
  b.hidden = !msg;
  b.textContent = msg || "";
}

// ------------------------------------------------------------------------------------------- api + auth

async function api(path, opts = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = Object.assign({ Accept: "application/json" }, opts.headers || {});
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch(`/console/api${path}`, Object.assign({}, opts, { headers }));
  let body = null;
  try { body = await res.json(); } catch (e) { body = null; }
  if (res.status === 401) { showLogin(body && body.error ? body.error.message : null); throw new Error("sign in"); }
  if (!res.ok) {
    const err = new Error(body && body.error ? body.error.message : `HTTP ${res.status}`);
    err.status = res.status;
    throw err;
  }
  return body;
}

function showLogin(message) {
  $("login").hidden = false;
  $("login-error").textContent = message && sessionStorage.getItem(KEY_STORE) ? message : "";
  $("key-input").focus();
}

async function whoami() {
  state.who = await api("/whoami");
  $("login").hidden = true;
  $("who").textContent = state.who.admin ? (state.who.auth ? "admin" : "open (no keys configured)")
    : `tenant ${state.who.tenant}`;
  $("logout").hidden = !state.who.auth;
  for (const a of document.querySelectorAll("nav a")) {
    const adminOnly = ADMIN_PAGES.includes(a.dataset.page);
    a.hidden = adminOnly && !state.who.admin;
  }
}

// ------------------------------------------------------------------------------------------- cluster

async function renderCluster() {
  const c = await api("/cluster");
  const hist = c.history.workers || {};
  const t = c.history.t || [];
  $("spark-span").textContent = t.length > 1 ? `${Math.round(t[t.length - 1] - t[0])} s` : "few seconds";
  const live = c.workers.filter((w) => w.state === "ready");
  const rates = Object.values(c.rates || {});
  const sum = (k) => rates.reduce((a, r) => a + (r[k] || 0), 0);
  $("cluster-cards").replaceChildren(
    ...[["live workers", `${live.length} / ${c.workers.length}`],
      ["decoders", live.filter((w) => w.role === "decode").length],
      ["prefillers", live.filter((w) => w.role === "prefill").length],
      ["requests/s", num(sum("requests_per_s"), 2)],
      ["tokens/s", num(sum("tokens_per_s"), 1)],
      ["prefix-cache hit ratio", c.prefix_cache_hit_ratio === null ? "-" : num(c.prefix_cache_hit_ratio, 2)]]
      .map(([k, v]) => el("div", { class: "card" }, el("div", { class: "v" }, v), el("div", { class: "k" }, k))));
  const withSpark = (w, k, d = 0, color) => td(el("div", { class: "cell" },
    spark((hist[w.worker] || {})[k], { color }), el("span", {}, num(w[k], d))), "num");
  const workers = c.workers.filter((w) => w.role === "prefill" || w.role === "decode");
  table($("workers"), [["worker"], ["role"], ["pool"], ["state"], ["active seqs", "num"], ["queued", "num"],
    ["queued prefill tok", "num"], ["free KV blocks", "num"], ["cached KV blocks", "num"],
    ["prefill tok/s", "num"], ["step ms", "num"], ["engine"], ["age s", "num"]],
  workers.map((w) => el("tr", { class: "worker-row", "data-worker": w.worker },
    td(w.worker), td(w.role), td(w.pool || "-"), td(el("span", { class: `badge ${w.state}` }, w.state)),
    withSpark(w, "active", 0, "#2563eb"), td(num(w.queued), "num"),
    withSpark(w, "queued_prefill_tokens", 0, "#d97706"),
    td(el("div", { class: "cell" }, spark((hist[w.worker] || {}).free_blocks, { color: "#16a34a" }),
      el("span", {}, `${num(w.free_blocks)}${w.total_blocks ? " / " + num(w.total_blocks) : ""}`)), "num"),
    withSpark(w, "cached_blocks", 0, "#7c3aed"), withSpark(w, "prefill_tokens_per_s", 0, "#0891b2"),
    td(w.step_ms ? num(w.step_ms, 1) : "-", "num"), td(w.engine || "-"), td(num(w.age_s, 1), "num"))));
  const control = c.workers.filter((w) => !(w.role === "prefill" || w.role === "decode"));
  table($("control"), [["service"], ["role"], ["state"], ["in flight", "num"], ["indexed blocks", "num"],
    ["pid", "num"], ["age s", "num"]],
  control.map((w) => el("tr", { class: "worker-row", "data-worker": w.worker },
    td(w.worker), td(w.role), td(el("span", { class: `badge ${w.state}` }, w.state)),
    withSpark(w, "active", 0, "#475569"),
    td(w.role === "cache_index" ? num(w.cached_blocks) : "-", "num"), td(w.pid || "-", "num"),
    td(num(w.age_s, 1), "num"))));
}

// ------------------------------------------------------------------------------------------- tenants

async function renderTenants() {
  const q = await api("/tenants");
  banner(q.error);
  const overCommitted = (q.contract_problems || []).map((p) => `contracts over capacity: ${p}`).join("; ");
  $("queue-head").textContent = q.router_id
    ? `router ${q.router_id}: ${q.capacity} free decode slots, ${q.running} running; rates over the last 10 s`
      + (overCommitted ? ` — ${overCommitted}` : "")
    : state.who.admin ? "" : `your tenant: ${state.who.tenant}`;
  const totalServed = q.tenants.reduce((a, r) => a + (r.served_tokens || 0), 0) || 1;
  table($("tenants"), [["tenant"], ["weight", "num"], ["queued", "num"], ["by class"], ["running", "num"],
    ["in flight", "num"], ["oldest wait", "num"], ["refused/s", "num"], ["requests/s", "num"],
    ["tokens/min vs quota"], ["fair-share served", "num"], ["contract"], ["queued · tokens/min (10 min)"]],
  q.tenants.map((r) => {
    const lim = r.limits || {};
    const classes = Object.entries(r.queued_by_class || {}).filter(([, v]) => v)
      .map(([k, v]) => el("span", { class: "badge" }, `${k}:${v}`));
    const tpm = r.tokens_last_minute || 0;
    return el("tr", { class: "tenant-row", "data-tenant": r.tenant },
      td(r.tenant), td(num(r.weight ?? lim.weight ?? 1, 1), "num"), td(num(r.queued || 0), "num"),
      td(classes.length ? classes : "-"), td(num(r.running || 0), "num"),
      td(`${num(r.inflight || 0)}${lim.max_inflight ? " / " + num(lim.max_inflight) : ""}`, "num"),
      td(r.oldest_wait_ms ? ms(r.oldest_wait_ms) : "-", "num"), td(num(r.refused_per_s || 0, 1), "num"),
      td(num((r.rates || {}).requests_per_s || 0, 2), "num"),
      td(el("div", { class: "inline", style: { margin: 0, gap: "8px" } }, meter(tpm, lim.tokens_per_minute),
        el("span", {}, `${num(tpm)}${lim.tokens_per_minute ? " / " + num(lim.tokens_per_minute) : ""}`))),
      td(`${num(r.served_tokens || 0)} (${num((100 * (r.served_tokens || 0)) / totalServed, 0)}%)`, "num"),
      td(contractCell(r, lim)),
      td(el("div", { class: "inline", style: { margin: 0, gap: "4px" } },
        spark((r.history || {}).queued, { color: "#d97706" }),
        spark((r.history || {}).tokens_last_minute, { color: "#2563eb" }))));
  }));
  await renderUsage();
}

// A tenant's contract: how its next request would be funded now, its running requests over every router against
// its guaranteed / burst decode slots, its prefill rates, its priority class.
function contractCell(r, lim) {
  const c = lim.contract;
  if (!c && r.funding == null) return "-";
  const slots = (c && c.decode_slots) || {};
  const rate = (c && c.prefill_tokens_per_s) || {};
  const parts = [];
  if (r.cluster_running != null) {
    parts.push(`run ${num(r.cluster_running)}${slots.guaranteed ? ` · g ${num(slots.guaranteed)}` : ""}`
      + `${slots.burst ? ` · cap ${num(slots.burst)}` : ""}`);
  }
  if (rate.guaranteed || rate.burst) {
    parts.push(`prefill ${rate.guaranteed ? "g " + num(rate.guaranteed) : ""}${rate.burst ? " cap " + num(rate.burst) : ""}/s`);
  }
  parts.push(`class ${lim.priority ?? r.priority ?? 0}`);
  return el("div", { class: "inline", style: { margin: 0, gap: "6px" } },
    r.funding ? el("span", { class: `badge ${r.funding}` }, r.funding) : "", el("span", {}, parts.join(" · ")));
}

async function renderUsage() {
  const u = await api(`/usage?since=${encodeURIComponent(state.usageWindow)}`);
  // one row per tenant, model and LoRA adapter (a tenant of one model: one row, as before)
  const rows = u.by_model || Object.values(u.tenants);
  table($("usage"), [["tenant"], ["model"], ["adapter"], ["requests", "num"], ["ok", "num"], ["errors", "num"],
    ["cancelled", "num"], ["expired", "num"], ["prompt tokens", "num"], ["completion tokens", "num"],
    ["cached tokens", "num"], ["errors by code"]],
  rows.length ? rows.map((r) => el("tr", { class: "usage-row", "data-tenant": r.tenant, "data-model": r.model || "" },
    td(r.tenant), td(r.model || "-"), td(r.adapter || "-"), td(num(r.requests), "num"), td(num(r.ok), "num"),
    td(num(r.errors), "num"),
    td(num(r.cancelled), "num"), td(num(r.expired), "num"), td(num(r.prompt_tokens), "num"),
    td(num(r.completion_tokens), "num"), td(num(r.cached_tokens), "num"),
    td(Object.entries(r.by_error || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "-")))
    : [el("tr", {}, el("td", { colspan: 12, class: "hint" }, "no finished requests in this window"))]);
}

// ------------------------------------------------------------------------------------------- requests

function requestRows(rows) {
  if (!rows.length) return [el("tr", {}, el("td", { colspan: 5, class: "hint" }, "none"))];
  return rows.map((r) => el("tr", {
    class: `request-row${state.trace === (r.request_id || r.trace_id) ? " selected" : ""}`,
    "data-request": r.request_id || r.trace_id,
    on: { click: () => { location.hash = `#requests/${r.request_id || r.trace_id}`; } },
  }, td(r.request_id || el("span", { class: "hint" }, `trace ${r.trace_id.slice(0, 12)}`)),
  td((r.tenants || []).join(", ") || "-"), td(r.root), td(ms(r.duration_ms), "num"),
  td(r.error ? el("span", { class: "badge err" }, "error") : "")));
}

async function renderRequests() {
  const r = await api("/requests?n=15");
  const head = [["request"], ["tenant"], ["root span"], ["duration", "num"], [""]];
  table($("slowest"), head, requestRows(r.slowest));
  table($("failed"), head, requestRows(r.failed));
  if (state.trace) await renderTrace(state.trace);
}

const SVC_COLOR = { client: "--svc-client", router: "--svc-router", prefill: "--svc-prefill",
  decode: "--svc-decode", frontend: "--svc-frontend" };

function facts(pairs) {
  return el("dl", { class: "facts" }, pairs.filter(([, v]) => v !== undefined && v !== null && v !== "")
    .map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function candidatesTable(cands, chosen) {
  const t = el("table", { class: "grid candidates" });
  table(t, [["worker"], ["cached blocks", "num"], ["cached tok", "num"], ["uncached tok", "num"], ["cost", "num"],
    ["load", "num"]],
  (cands || []).map((c) => el("tr", { class: c.worker === chosen ? "chosen" : null },
    td(c.worker), td(num(c.cached_blocks), "num"), td(num(c.cached_tokens), "num"),
    td(num(c.uncached_tokens), "num"), td(num(c.cost, 3), "num"), td(num(c.load), "num"))));
  return t;
}

function decisionPanel(d, title) {
  const th = d.thresholds || {};
  return el("div", { class: "card panel decision" }, el("h4", {}, title || "Routing decision"),
    facts([["strategy", d.strategy], ["route", el("b", {}, d.route)], ["rule", d.reason],
      ["decoder", `${d.decoder} (${d.decoder_reason})`],
      ["prefiller", d.prefiller ? `${d.prefiller} (${d.prefiller_reason})` : "-"],
      ["prompt tokens", num(d.prompt_tokens)], ["cached on decoder", num(d.cached_tokens)],
      ["uncached", num(d.uncached_tokens)],
      ["threshold", th.min_uncached_tokens !== undefined ? `direct below ${num(th.min_uncached_tokens)} uncached tokens` : null],
      ["rule said", th.rule_said],
      ["stall estimate", th.stall_ms !== undefined ? `${ms(th.stall_ms)} (max ${ms(th.max_stall_ms)}; ` +
        (th.decoder_active_seqs ? `the decoder streams ${th.decoder_active_seqs})` : "applies only while the decoder streams)") : null],
      ["context pool", (d.detail || {}).context_pool]]),
    el("div", { class: "kv" }, "decode candidates"), candidatesTable(d.candidates, d.decoder),
    (d.prefill_candidates || []).length
      ? [el("div", { class: "kv" }, "prefill candidates"), candidatesTable(d.prefill_candidates, d.prefiller)] : null);
}

async function renderTrace(ref) {
  const box = $("trace");
  let t;
  try {
    t = await api(`/trace/${encodeURIComponent(ref)}`);
  } catch (e) {
    box.replaceChildren(el("p", { class: "error", id: "trace-error" }, e.message));
    return;
  }
  const total = Math.max(t.duration_ms, 0.001);
  const rows = t.rows.map((r) => {
    const color = r.error ? "var(--bad)" : `var(${r.name.startsWith("kv.") ? "--svc-kv" : SVC_COLOR[r.service] || "--svc-frontend"})`;
    const attrs = t.spans.find((s) => s.span_id === r.span_id);
    const key = Object.entries(r.key_attributes || {}).filter(([k]) => !k.startsWith("decision."))
      .map(([k, v]) => `${k}=${typeof v === "string" && v.length > 40 ? v.slice(0, 39) + "…" : v}`).join("  ");
    const row = el("div", { class: `wf-row span-row${r.error ? " error" : ""}`, "data-span": r.name,
      title: r.status_message || "" },
    el("div", { class: "svc" }, `${r.service}/${r.worker_id}`),
    el("div", { class: "name", style: { paddingLeft: `${r.depth * 12}px` } }, r.name,
      key ? el("span", { class: "kv" }, `  ${key}`) : null),
    el("div", { class: "track" }, el("div", { class: "bar", style: {
      left: `${(100 * r.start_ms) / total}%`, width: `${Math.max(0.3, (100 * r.duration_ms) / total)}%`,
      background: color } })),
    el("div", { class: "dur" }, ms(r.duration_ms)));
    row.addEventListener("click", () => {
      const open = row.nextSibling && row.nextSibling.classList && row.nextSibling.classList.contains("wf-attrs");
      if (open) { row.nextSibling.remove(); return; }
      // JSON-valued attributes (decision_json, candidate lists) are shown as the objects they are.
      const parsed = {};
      for (const [k, v] of Object.entries(attrs.attributes || {})) {
        let val = v;
        if (typeof v === "string" && /^[[{]/.test(v)) { try { val = JSON.parse(v); } catch (e) { val = v; } }
        parsed[k] = val;
      }
      const detail = { start_ms: Number(r.start_ms.toFixed(3)), status: attrs.status, status_message: attrs.status_message,
        attributes: parsed, events: attrs.events };
      row.after(el("div", { class: "wf-attrs" }, JSON.stringify(detail, null, 2)));
    });
    return row;
  });
  const kv = (t.kv || []).map((k) => el("div", { class: "card panel kv-transfer" }, el("h4", {}, "KV transfer"),
    facts([["from", k.worker_id], ["bytes", bytes(k["kv.bytes"])], ["transport", k["kv.transport"]],
      ["layer by layer", String(k["kv.layerwise"])],
      ["bandwidth", k["kv.bandwidth_mbps"] !== undefined ? `${num(k["kv.bandwidth_mbps"], 1)} MB/s` : null],
      ["exposed after prefill", k["kv.exposed_ms"] !== undefined ? ms(k["kv.exposed_ms"]) : null]])));
  const errs = (t.errors || []).length ? el("div", { class: "card panel errors" }, el("h4", { class: "error" }, "Errors"),
    t.errors.map((e) => el("p", { class: "error" }, `${e.service}/${e.worker_id} ${e.name}: ${e.code ? "[" + e.code + "] " : ""}${e.message || ""}`)))
    : null;
  box.replaceChildren(el("div", { class: "wf", id: "waterfall" },
    el("div", { class: "wf-head" }, el("b", {}, `request ${t.request_id || "-"}`),
      el("span", { class: "hint" }, `  trace ${t.trace_id} · ${ms(t.duration_ms)} · ${t.rows.length} spans · click a span for its attributes`)),
    rows),
  el("div", { class: "panels" }, t.decision ? decisionPanel(t.decision) : null, kv, errs));
}

// ------------------------------------------------------------------------------------------- explorer

async function explain(ev) {
  ev.preventDefault();
  const out = $("explain");
  out.replaceChildren(el("p", { class: "hint" }, "asking the router…"));
  let r;
  try {
    r = await api("/explain", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: $("explain-prompt").value, chat: $("explain-chat").checked,
        session_id: $("explain-session").value || null, tenant: $("explain-tenant").value || "default",
        model: $("explain-model").value || null }) });
  } catch (e) {
    out.replaceChildren(el("p", { class: "error" }, e.message));
    return;
  }
  const wt = el("table", { class: "grid", id: "explain-workers" });
  table(wt, [["worker"], ["role"], ["pool"], ["active", "num"], ["queued prefill tok", "num"], ["free / total blocks", "num"],
    ["prefill tok/s", "num"], ["step ms", "num"], ["holds of this prompt", "num"]],
  r.workers.map((w) => el("tr", {}, td(w.worker_id), td(w.role), td(w.pool), td(num(w.active_seqs), "num"),
    td(num(w.queued_prefill_tokens), "num"), td(`${num(w.free_blocks)} / ${num(w.total_blocks)}`, "num"),
    td(w.prefill_tokens_per_s ? num(w.prefill_tokens_per_s) : "-", "num"), td(w.step_ms ? num(w.step_ms, 1) : "-", "num"),
    td(`${num(w.cached_blocks)} blocks (${num(w.cached_blocks * r.block_size)} tok)`, "num"))));
  const cards = r.results.map((s) => {
    const head = el("h4", {}, s.strategy, " ", s.live ? el("span", { class: "badge live" }, "live") : null);
    if (!s.decision) return el("div", { class: "card strategy", "data-strategy": s.strategy }, head,
      el("p", { class: "error" }, s.error || "no decision"));
    const p = decisionPanel(s.decision, "");
    p.querySelector("h4").replaceWith(head);
    p.setAttribute("data-strategy", s.strategy);
    p.classList.add("strategy");
    if (s.note) p.append(el("p", { class: "hint" }, s.note));
    return p;
  });
  out.replaceChildren(el("p", { class: "hint" },
    `router ${r.router_id} · ${num(r.prompt_tokens)} prompt tokens · ${r.block_size}-token blocks · live strategy ${r.live_strategy} · nothing was dispatched`),
  wt, el("div", { class: "strategies" }, cards));
}

// ------------------------------------------------------------------------------------------- what-if

// The form's choices (traces, example changes, limits), asked for once per visit of the page: a run is never
// repeated or refreshed by a timer (each one is seconds to a minute of simulation on the front door's host).
async function renderWhatIf() {
  const d = await api("/whatif/traces");
  const first = state.whatif === null;
  state.whatif = d;
  $("whatif-timeout").textContent = d.timeout_s >= 60 && d.timeout_s % 60 === 0 ? `${num(d.timeout_s / 60)} min`
    : `${num(d.timeout_s)} s`;
  const note = $("whatif-note");
  const problems = [];
  if (!d.tenants_file) problems.push("this front door runs without --tenants: the what-if needs its tenants file.");
  if (!d.traces.length) problems.push("no trace files in the front door's traces folder (--whatif-traces DIR).");
  note.hidden = !problems.length;
  note.textContent = problems.join(" ");
  const traceSel = $("whatif-trace");
  const picked = traceSel.value;
  traceSel.replaceChildren(...d.traces.map((t) => el("option", { value: t.name },
    `${t.alias ? t.alias + " · " : ""}${t.name}${t.bytes !== null ? " (" + bytes(t.bytes) + ")" : ""}`)));
  // Keep the operator's pick; else the Mooncake trace the examples were written for, else the first.
  const names = d.traces.map((t) => t.name);
  traceSel.value = names.includes(picked) ? picked
    : (d.traces.find((t) => t.alias === "mooncake") || d.traces[0] || { name: "" }).name;
  const exSel = $("whatif-example");
  const exPicked = exSel.value;
  exSel.replaceChildren(...d.examples.map((e) => el("option", { value: e.name }, e.name)));
  if (exPicked && d.examples.some((e) => e.name === exPicked)) exSel.value = exPicked;
  if (first && !$("whatif-change").value) $("whatif-change").value = (d.examples[0] || { text: "" }).text;
  $("whatif-run").disabled = !d.tenants_file || !d.traces.length || state.whatifRunning === true;
}

function whatIfExample() {
  const e = ((state.whatif || {}).examples || []).find((x) => x.name === $("whatif-example").value);
  if (e) $("whatif-change").value = e.text;
}

const pools = (r) => `${r.prefill}P:${r.decode}D${r.long_decode ? ` + ${r.long_decode} long` : ""}`;
const slo = (s) => (s && (s.ttft_p99_ms !== null || s.itl_p99_ms !== null)
  ? `${s.ttft_p99_ms !== null ? ms(s.ttft_p99_ms) : "-"} / ${s.itl_p99_ms !== null ? ms(s.itl_p99_ms) : "-"}` : "-");

function whatIfVerdict(w) {
  const accepted = w.accepted === true;
  const rb = w.runs.before, ra = w.runs.after;
  const c = w.change || {};
  const what = (c.add_tenant || []).map((a) => `add ${a.name} (${num(a.requests)} requests)`)
    .concat((c.set_tenant || []).map((s) => `set ${s.name} (${(s.fields || []).join(", ")})`))
    .concat(c.pools ? [`pools ${pools(rb)} → ${pools(ra)}`] : []);
  const head = el("h4", {}, el("span", { class: `badge ${accepted ? "ok" : "err"}` }, accepted ? "ACCEPTED" : "REFUSED"),
    " ", accepted ? "every tenant that held its SLO before still holds after"
      : `${w.breaks.length} promise${w.breaks.length === 1 ? "" : "s"} would break`);
  const breaks = (w.breaks || []).map((b) => el("li", { class: "whatif-break", "data-tenant": b.tenant || "" },
    b.tenant ? el("b", {}, b.tenant) : el("b", {}, "contracts"), ": ", (b.reasons || []).join("; ")));
  const run = (label, r) => [label, `${pools(r)} (${num(r.gpus)} GPUs): ${num(r.requests)} requests, `
    + `${num(r.finished)} finished, ${num(r.refused)} refused, ${num(r.failed)} failed; utilisation prefill `
    + `${num(100 * ((r.utilisation || {}).prefill || 0))}% decode ${num(100 * ((r.utilisation || {}).decode || 0))}%`];
  return el("div", { class: `card panel verdict ${accepted ? "accepted" : "refused"}`, id: "whatif-verdict",
    "data-verdict": accepted ? "accepted" : "refused" }, head,
  breaks.length ? el("ul", {}, breaks) : null,
  facts([["change", what.join("; ") || "-"], run("before", rb), run("after", ra),
    ["trace", `${w.trace} · seed ${w.seed} · simulated in ${num(w.wall_s, 1)} s`]]),
  (w.already_failing || []).map((t) => el("p", { class: "hint" },
    `${t} already missed its SLO before the change (not held against it)`)));
}

function whatIfTable(w) {
  const t = el("table", { class: "grid", id: "whatif-tenants" });
  const rows = [];
  for (const row of w.tenants) {
    for (const label of ["before", "after"]) {
      const r = row[label];
      if (!r) continue;
      // After the change, a break says why the tenant refuses it (as the CLI prints); else the run's own misses.
      const miss = label === "after" && (row.breaks || []).length ? row.breaks : r.misses || [];
      rows.push(el("tr", { class: `whatif-row${label === "after" ? " after" : ""}`, "data-tenant": row.tenant,
        "data-run": label },
      td(label === "before" || !row.before ? [row.tenant, row.status !== "same"
        ? el("span", { class: "badge" }, row.status) : null] : ""),
      td(label), td(num(r.requests), "num"), td(num(r.finished), "num"),
      td(r.refused ? `${num(r.refused)} (${Object.entries(r.refused_by || {}).map(([k, v]) => `${k} ${v}`).join(", ")})`
        : "0", "num"),
      td(num(r.throughput_rps, 3), "num"), td(ms(r.ttft_p50_ms), "num"), td(ms(r.ttft_p99_ms), "num"),
      td(ms(r.itl_p99_ms), "num"), td(slo(row[`slo_${label}`]), "num"),
      td(miss.length ? el("span", { class: "error" }, `NO: ${miss.join("; ")}`) : el("span", { class: "ok" }, "yes"))));
    }
  }
  table(t, [["tenant"], ["run"], ["requests", "num"], ["finished", "num"], ["refused", "num"], ["req/s", "num"],
    ["TTFT p50", "num"], ["TTFT p99", "num"], ["ITL p99", "num"], ["target TTFT / ITL p99", "num"], ["holds?"]], rows);
  return t;
}

async function runWhatIf(ev) {
  ev.preventDefault();
  if (state.whatifRunning) return;
  const out = $("whatif-result");
  const btn = $("whatif-run");
  const status = $("whatif-status");
  const intOr = (v) => (v === "" ? null : Number(v));
  state.whatifRunning = true;
  btn.disabled = true;
  status.replaceChildren(el("span", { class: "spinner" }), " running… (up to a minute)");
  try {
    const w = await api("/whatif", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ change: $("whatif-change").value, trace: $("whatif-trace").value,
        prefill: intOr($("whatif-prefill").value), decode: intOr($("whatif-decode").value) }) });
    out.replaceChildren(whatIfVerdict(w), whatIfTable(w),
      el("p", { class: "hint" }, "latencies from the simulator; targets from the tenants file ('-': none)"));
    status.textContent = "";
  } catch (e) {
    if (e.message !== "sign in") {
      out.replaceChildren(el("pre", { class: "error", id: "whatif-error" }, e.message));
    }
    status.textContent = "";
  } finally {
    state.whatifRunning = false;
    btn.disabled = false;
  }
}

// ------------------------------------------------------------------------------------------- routing

const PAGES = { cluster: [renderCluster, 2000], tenants: [renderTenants, 3000], requests: [renderRequests, 0],
  explorer: [null, 0], whatif: [renderWhatIf, 0] };

async function refresh() {
  const [fn] = PAGES[state.page] || [];
  if (!fn) return;
  try {
    await fn();
    if (state.page !== "tenants") banner(null);
  } catch (e) {
    if (e.message !== "sign in") banner(e.message);
  }
}

async function show() {
  clearInterval(state.timer);
  let [page, ...rest] = location.hash.replace(/^#/, "").split("/");
  if (!state.who) return;
  if (!PAGES[page]) page = state.who.admin ? "cluster" : "tenants";
  if (!state.who.admin && ADMIN_PAGES.includes(page)) page = "tenants";
  state.page = page;
  state.trace = page === "requests" && rest.length ? decodeURIComponent(rest.join("/")) : null;
  if (state.trace) $("trace-id").value = state.trace;
  for (const s of document.querySelectorAll(".page")) s.hidden = s.id !== `page-${page}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  await refresh();
  const every = PAGES[page][1];
  if (every) state.timer = setInterval(refresh, every);
}

async function start() {
  try {
    await whoami();
  } catch (e) {
    return;  // the sign-in form is showing
  }
  await show();
}

window.addEventListener("hashchange", show);
$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
  $("key-input").value = "";
  await start();
});
$("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY_STORE); location.reload(); });
$("usage-window").addEventListener("change", async (ev) => {
  state.usageWindow = ev.target.value;
  try { await renderUsage(); } catch (e) { banner(e.message); }
});
$("requests-refresh").addEventListener("click", refresh);
$("trace-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const id = $("trace-id").value.trim();
  if (id) location.hash = `#requests/${id}`;
});
$("explain-form").addEventListener("submit", explain);
$("whatif-form").addEventListener("submit", runWhatIf);
$("whatif-example").addEventListener("change", whatIfExample);
start();
