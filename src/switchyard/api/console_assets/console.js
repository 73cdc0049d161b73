// Switchyard console: renders each page from the admin API, nothing else.
// Every value from the API goes into the page as text (textContent), never as markup:
// request ids, reasons and tenant names come from clients.
"use strict";

const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const PAGE = document.body.dataset.page;
const ARG = document.body.dataset.arg;
const content = document.getElementById("content");

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") Object.assign(el.style, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function svg(tag, attrs, ...kids) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

async function api(method, path, body) {
  const headers = {};
  if (body !== undefined) headers["content-type"] = "application/json";
  if (method !== "GET") headers["x-csrf-token"] = CSRF;
  const r = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await r.json().catch(() => ({}));
  if (r.status === 401) { location.href = "/console/login"; throw new Error("logged out"); }
  if (!r.ok) {
    const err = new Error((data.error && data.error.message) || `HTTP ${r.status}`);
    err.status = r.status;
    throw err;
  }
  return data;
}

const show = (...nodes) => content.replaceChildren(...nodes);
const fail = (e) => show(h("p", { class: "error", id: "error" }, e.message));
const qs = (params) => {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v != null) p.set(k, v);
  const s = p.toString();
  return s ? "?" + s : "";
};
const time = (unix) => (unix == null ? "" : new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 19));
const ms = (x) => (x == null ? "" : `${Number(x).toFixed(1)} ms`);
const usd = (x) => (x == null ? "" : `$${Number(x).toFixed(x !== 0 && Math.abs(x) < 0.01 ? 6 : 2)}`);
const num = (x, d = 0) => (x == null ? "—" : Number(x).toLocaleString("en-US", { maximumFractionDigits: d }));
const pct = (x) => (x == null ? "—" : `${(x * 100).toFixed(2)} %`);
const link = (href, text, cls) => h("a", { href, class: cls }, text);
const reqLink = (id) => link(`/console/requests/${encodeURIComponent(id)}`, id, "request-link");
const taskLink = (id, tenant) =>
  link(`/console/tasks/${encodeURIComponent(id)}${qs({ tenant })}`, id, "task-link");

function table(cols, rows, id) {
  return h("table", { id },
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", { class: c.num ? "num" : null }, c.title)))),
    h("tbody", {}, rows.map((r) => h("tr", {},
      cols.map((c) => h("td", { class: c.num ? "num" : null }, c.get(r)))))));
}

const tile = (k, v, id) => h("div", { class: "tile", id }, h("div", { class: "v" }, v), h("div", { class: "k" }, k));

function field(name, label, attrs) {
  return h("label", {}, label, h("input", { name, id: `f-${name}`, ...(attrs || {}) }));
}

function formValues(form) {
  const out = {};
  for (const [k, v] of new FormData(form).entries()) out[k] = String(v).trim();
  return out;
}

// -- requests ----------------------------------------------------------------------
async function requestsPage() {
  const params = new URLSearchParams(location.search);
  const form = h("form", { class: "filters", id: "filters" },
    field("tenant", "Tenant", { value: params.get("tenant") || "" }),
    field("model", "Model", { value: params.get("model") || "" }),
    h("label", {}, "Status", h("select", { name: "status", id: "f-status" },
      ["", "ok", "error", "refused", "cancelled"].map((s) =>
        h("option", { value: s, selected: params.get("status") === s }, s || "any")))),
    h("label", {}, "Since", h("select", { name: "since", id: "f-since" },
      [["", "any time"], ["900", "15 min"], ["3600", "1 hour"], ["86400", "24 hours"], ["604800", "7 days"]]
        .map(([v, t]) => h("option", { value: v, selected: params.get("since") === v }, t)))),
    h("button", { type: "submit", id: "apply" }, "Filter"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    location.search = qs(formValues(form));
  });
  const search = h("form", { class: "filters", id: "search" },
    field("request_id", "Request id (or your x-request-id)", { size: 40 }),
    h("button", { type: "submit", id: "go" }, "Open"));
  search.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = formValues(search).request_id;
    if (id) location.href = `/console/requests/${encodeURIComponent(id)}`;
  });
  const holder = h("div", {});
  show(form, search, holder);
  const since = params.get("since");
  const base = {
    tenant: params.get("tenant"), model: params.get("model"), status: params.get("status"),
    since: since ? String(Date.now() / 1000 - Number(since)) : "", limit: 50,
  };
  let before = "";
  const rows = [];
  const more = h("button", { id: "older", type: "button" }, "Older");
  async function load() {
    const data = await api("GET", "/admin/usage" + qs({ ...base, before }));
    rows.push(...data.data);
    if (data.data.length) before = String(data.data[data.data.length - 1].received_at);
    more.disabled = data.data.length < base.limit;
    holder.replaceChildren(table([
      { title: "Received (UTC)", get: (r) => time(r.received_at) },
      { title: "Request", get: (r) => reqLink(r.request_id) },
      { title: "Tenant", get: (r) => r.tenant_id || "" },
      { title: "Model", get: (r) => r.model || "" },
      { title: "Status", get: (r) => r.error_code ? `${r.status} (${r.error_code})` : r.status },
      { title: "Cache", get: (r) => r.cache || "" },
      { title: "Tokens", num: true, get: (r) => num(r.input_tokens + r.output_tokens) },
      { title: "Cost", num: true, get: (r) => usd(r.cost_usd) },
      { title: "Duration", num: true, get: (r) => ms(r.duration_ms) },
      { title: "Task", get: (r) => (r.task_id ? taskLink(r.task_id, r.tenant_id) : "") },
    ], rows, "requests-table"), rows.length ? more : h("p", { class: "hint" }, "No requests match."));
  }
  more.addEventListener("click", () => load().catch(fail));
  await load();
}

function bars(items, total, id) {
  // items: {label, start, end, cls, title}; positions as a share of `total` ms.
  const span = total > 0 ? total : 1;
  return h("div", { id }, items.map((it) => h("div", { class: `bar-row ${it.cls || ""}`, "data-id": it.id },
    h("span", { class: "label", title: it.title || "" }, it.label),
    h("div", { class: "track" }, h("div", {
      class: "bar",
      style: { left: `${(100 * Math.max(0, it.start)) / span}%`,
        width: `${(100 * Math.max(0, it.end - it.start)) / span}%` },
    })),
    h("span", { class: "num" }, ms(it.end - it.start)))));
}

async function requestPage(id) {
  let rec;
  try {
    rec = await api("GET", `/admin/requests/${encodeURIComponent(id)}`);
  } catch (e) {
    if (e.status === 404) {
      show(h("p", { id: "no-trace" }, "No trace is kept for this request id. Plain successes are ",
        "kept only as a sample (observe.traces_sample_ok); its usage row is in the requests list."));
      return;
    }
    throw e;
  }
  const t = rec.timings || {};
  const summary = table([{ title: "Field", get: (r) => r[0] }, { title: "Value", get: (r) => r[1] }], [
    ["Status", rec.error_code ? `${rec.status} (${rec.error_code})` : rec.status],
    ["Model", rec.model + (rec.requested_model && rec.requested_model !== rec.model ? ` (asked for ${rec.requested_model})` : "")],
    ["Served by", rec.upstream || (rec.cache ? `cache (${rec.cache})` : "—")],
    ["Revision", rec.revision || "—"],
    ["Tenant / key", `${rec.tenant_id || "—"} / ${rec.key_id || "—"}`],
    ["Tokens in / out", `${num(rec.input_tokens)} / ${num(rec.output_tokens)}`],
    ["Cost", usd(rec.cost_usd)],
    ["Attempts", num(rec.attempts)],
    ["Fallback from", rec.fallback_from || "—"],
    ["Task", rec.task_id ? taskLink(rec.task_id, rec.tenant_id) : "—"],
    ["Received (UTC)", time(rec.received_at)],
  ], "summary");
  const total = t.duration_ms || 0;
  const split = bars([
    { label: "queue", start: 0, end: t.queue_ms || 0 },
    { label: "to upstream first byte", start: 0, end: t.upstream_first_byte_ms || 0 },
    { label: "upstream", start: Math.max(0, total - (t.upstream_ms || 0)), end: total },
    { label: "to client first byte", start: 0, end: t.client_first_byte_ms || 0 },
    { label: "whole request", start: 0, end: total },
  ].filter((b) => b.end > 0), total, "timings");
  const t0 = rec.received_at;
  const decisions = h("div", { id: "decisions" }, (rec.decisions || []).map((d, i) => {
    const start = (d.started_at - t0) * 1000;
    return h("div", { class: "decision", "data-stage": d.stage },
      h("div", {}, h("span", { class: "stage" }, `${i + 1}. ${d.stage}`),
        h("span", { class: "outcome" }, d.outcome),
        h("span", { class: "hint" }, ` at +${start.toFixed(2)} ms, ${d.duration_ms} ms`)),
      h("div", { class: "reason" }, d.reason || ""),
      Object.keys(d.evidence || {}).length
        ? h("details", {}, h("summary", {}, "evidence"), h("pre", {}, JSON.stringify(d.evidence, null, 2)))
        : null);
  }));
  show(h("h2", {}, "Summary"), summary, h("h2", {}, "Time split (Server-Timing)"), split,
    h("h2", {}, `Decisions (${(rec.decisions || []).length})`), decisions);
}

// -- tasks ---------------------------------------------------------------------------
async function tasksPage() {
  const data = await api("GET", "/admin/tasks?limit=100");
  show(data.data.length ? table([
    { title: "Task", get: (r) => taskLink(r.task_id, r.tenant_id) },
    { title: "Tenant", get: (r) => r.tenant_id || "" },
    { title: "Requests", num: true, get: (r) => num(r.requests) },
    { title: "Errors", num: true, get: (r) => num(r.errors) },
    { title: "Tokens", num: true, get: (r) => num(r.tokens) },
    { title: "Cost", num: true, get: (r) => usd(r.cost_usd) },
    { title: "Started (UTC)", get: (r) => time(r.started_at) },
    { title: "Last (UTC)", get: (r) => time(r.last_at) },
  ], data.data, "tasks-table") : h("p", { class: "hint" }, "No tasks recorded yet (requests with x-switchyard-task-id)."));
}

async function taskPage(id) {
  const tenant = new URLSearchParams(location.search).get("tenant");
  const data = await api("GET", `/admin/tasks/${encodeURIComponent(id)}${qs({ tenant })}`);
  const a = data.task;
  const tiles = h("div", { class: "tiles", id: "task-tiles" },
    tile("end to end", ms(a.e2e_ms)), tile("critical path", ms(a.critical_path_ms), "critical-ms"),
    tile("steps", `${a.steps_executed}${a.steps_planned ? " / " + a.steps_planned : ""}`),
    tile("cost", usd(a.cost_usd)), tile("tokens", num(a.input_tokens + a.output_tokens)),
    tile("retries", num(a.retries)), tile("fallbacks", num(a.fallbacks)),
    tile("cache hits", num(a.cache_hits)));
  const byId = Object.fromEntries(data.requests.map((r) => [r.request_id, r]));
  const waterfall = bars(a.steps.map((s) => ({
    id: s.request_id,
    label: `${s.on_critical_path ? "★ " : ""}${s.request_id} · ${s.kind === "tool" ? "tool " : ""}${s.model || ""} · ${s.status}`,
    title: `parents: ${s.parents.join(", ") || "none"}${s.inferred ? " (inferred from timing)" : ""}`,
    start: s.start_ms, end: s.end_ms,
    cls: [s.on_critical_path ? "critical" : "", s.kind === "tool" ? "tool" : ""].join(" ").trim(),
  })), a.e2e_ms, "waterfall");
  for (const row of waterfall.children) {
    const rid = row.dataset.id;
    row.querySelector(".label").addEventListener("click", () => {
      location.href = `/console/requests/${encodeURIComponent(rid)}`;
    });
    row.style.cursor = byId[rid] ? "pointer" : "default";
  }
  const gov = a.governance || {};
  const split = a.tool_calls ? h("p", { class: "hint", id: "time-by-kind" },
    "critical path: " + Object.entries(a.time_by_kind || {}).map(
      ([k, v]) => `${k.replace(/_ms$/, "").replace(/_/g, " ")} ${ms(v)}`).join(", ")) : "";
  show(tiles, h("h2", {}, "Steps (★ and red: the critical path; hatched: tool calls)"), waterfall, split,
    h("h2", {}, "Budget and governance"), h("pre", { id: "governance" }, JSON.stringify({
      budget: gov.budget, used: gov.used, refused: gov.refused, goodput: gov.goodput,
      stopped: gov.stopped,
    }, null, 2)));
}

// -- live ----------------------------------------------------------------------------
async function livePage() {
  const stamp = h("p", { class: "hint", id: "live-updated" }, "");
  const holder = h("div", {});
  show(stamp, holder);
  async function tick() {
    const d = await api("GET", "/admin/live?window_s=60");
    const errs = Object.entries(d.errors);
    holder.replaceChildren(
      h("div", { class: "tiles", id: "live-tiles" },
        tile("requests/s (60 s)", num(d.requests_per_s, 3), "live-rate"),
        tile("requests (60 s)", num(d.requests), "live-requests"),
        tile("p50 latency", ms(d.latency_ms.p50)), tile("p95 latency", ms(d.latency_ms.p95)),
        tile("p99 latency", ms(d.latency_ms.p99)), tile("p50 TTFT", ms(d.ttft_ms.p50)),
        tile("p99 TTFT", ms(d.ttft_ms.p99)), tile("error rate", pct(d.error_rate)),
        tile("cache hit rate", pct(d.cache_hit_rate)), tile("active requests", num(d.active_requests))),
      h("h2", {}, "Errors by kind"),
      errs.length ? table([{ title: "Kind", get: (r) => r[0] }, { title: "Count", num: true, get: (r) => num(r[1]) }], errs, "live-errors")
        : h("p", { class: "hint" }, "None in the window."),
      h("h2", {}, "Breakers"),
      table([{ title: "Deployment", get: (r) => r[0] }, { title: "State", get: (r) => r[1] }], Object.entries(d.breakers), "live-breakers"),
      h("h2", {}, "Queues"),
      table([{ title: "Deployment", get: (r) => r[0] }, { title: "In flight", num: true, get: (r) => num(r[1].in_flight) },
        { title: "Queued", num: true, get: (r) => num(r[1].queued) }], Object.entries(d.queues), "live-queues"),
      h("h2", {}, "Engines, resident models and adapters"),
      table([{ title: "Engine", get: (r) => r[0] }, { title: "State", get: (r) => r[1].state },
        { title: "In flight", num: true, get: (r) => num(r[1].in_flight) },
        { title: "Memory", num: true, get: (r) => (r[1].memory_mb == null ? "—" : `${num(r[1].memory_mb)} MB`) },
        { title: "Adapters", get: (r) => Object.entries(r[1].adapters).map(([n, s]) => `${n}: ${s}`).join(", ") }],
      Object.entries(d.engines), "live-engines"),
      h("h2", {}, "What the engines report of their own load"),
      table([{ title: "Deployment", get: (r) => r[0] }, { title: "Kind", get: (r) => r[1].kind },
        { title: "Running", num: true, get: (r) => num(r[1].running) },
        { title: "Waiting", num: true, get: (r) => num(r[1].waiting) },
        { title: "KV cache", num: true, get: (r) => (r[1].kv_cache_usage == null ? "—" : pct(r[1].kv_cache_usage)) },
        { title: "Slots", num: true, get: (r) => num(r[1].slots) },
        { title: "Read", get: (r) => (r[1].fresh ? `${num(r[1].age_s, 1)} s ago` : (r[1].error || "stale")) }],
      Object.entries(d.engine_load), "live-engine-load"));
    stamp.textContent = `updated ${new Date().toISOString().slice(11, 19)} UTC; refreshes every 2 s`;
  }
  await tick();
  setInterval(() => tick().catch((e) => { stamp.textContent = `refresh failed: ${e.message}`; }), 2000);
}

// -- tenants and keys ------------------------------------------------------------------
async function tenantsPage() {
  const [tenants, keys] = await Promise.all([api("GET", "/admin/tenants?limit=1000"), api("GET", "/admin/keys?limit=1000")]);
  const shown = h("div", { id: "new-key-holder" });
  const tForm = h("form", { class: "inline", id: "create-tenant" },
    field("id", "Tenant id", { required: true, maxlength: 128 }), field("rpm", "RPM", { size: 6 }),
    field("budget_usd", "Budget USD", { size: 8 }),
    h("button", { type: "submit", id: "create-tenant-btn" }, "Create tenant"));
  tForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const v = formValues(tForm);
    const body = { id: v.id };
    if (v.rpm) body.rpm = Number(v.rpm);
    if (v.budget_usd) body.budget_usd = Number(v.budget_usd);
    try { await api("POST", "/admin/tenants", body); await tenantsPage(); } catch (e) { shown.replaceChildren(h("p", { class: "error" }, e.message)); }
  });
  const kForm = h("form", { class: "inline", id: "create-key" },
    h("label", {}, "Tenant", h("select", { name: "tenant_id", id: "f-key-tenant" },
      tenants.data.map((t) => h("option", { value: t.id }, t.id)))),
    field("name", "Key name", { maxlength: 128 }),
    h("button", { type: "submit", id: "create-key-btn" }, "Create key"));
  kForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const v = formValues(kForm);
    try {
      const k = await api("POST", "/admin/keys", { tenant_id: v.tenant_id, name: v.name || null });
      await tenantsPage();
      document.getElementById("new-key-holder").replaceChildren(h("div", { class: "key-shown" },
        "New key (shown once, copy it now): ", h("code", { id: "new-key" }, k.key)));
    } catch (e) { shown.replaceChildren(h("p", { class: "error" }, e.message)); }
  });
  const tTable = table([
    { title: "Tenant", get: (t) => t.id },
    { title: "RPM", num: true, get: (t) => num(t.effective_limits.rpm) },
    { title: "TPM", num: true, get: (t) => num(t.effective_limits.tpm) },
    { title: "Concurrency", num: true, get: (t) => num(t.effective_limits.max_concurrency) },
    { title: "Budget", num: true, get: (t) => (t.effective_limits.budget_usd == null ? "—" : `${usd(t.effective_limits.budget_usd)} / ${t.effective_limits.budget_period || "month"}`) },
    { title: "Used", num: true, get: (t) => (t.budget_used_usd == null ? "—" : usd(t.budget_used_usd)) },
    { title: "Models", get: (t) => t.allowed_models.join(", ") },
  ], tenants.data, "tenants-table");
  const kTable = table([
    { title: "Key", get: (k) => k.id },
    { title: "Tenant", get: (k) => k.tenant_id },
    { title: "Name", get: (k) => k.name || "" },
    { title: "Prefix", get: (k) => k.prefix },
    { title: "Created (UTC)", get: (k) => time(k.created_at) },
    { title: "State", get: (k) => (k.revoked ? `revoked ${time(k.revoked_at)}` : "active") },
    { title: "", get: (k) => (k.revoked ? "" : h("button", {
      type: "button", class: "revoke", "data-key-id": k.id,
      onclick: async () => {
        if (!confirm(`Revoke key ${k.id}? Requests with it get 401 at once.`)) return;
        try { await api("DELETE", `/admin/keys/${encodeURIComponent(k.id)}`); await tenantsPage(); } catch (e) { fail(e); }
      },
    }, "Revoke")) },
  ], keys.data, "keys-table");
  show(shown, h("h2", {}, "Tenants"), tForm, tTable, h("h2", {}, "Keys"), kForm, kTable);
}

// -- cache ---------------------------------------------------------------------------
async function cachePage() {
  const stats = await api("GET", "/admin/cache/stats");
  const out = h("div", { id: "invalidate-result" });
  const go = h("button", { type: "button", id: "invalidate", disabled: true }, "Invalidate");
  const form = h("form", { class: "inline", id: "invalidate-form" },
    field("tenant", "Tenant"), field("model", "Model"), field("tag", "Tag"), field("partition", "Partition"),
    h("button", { type: "submit", id: "dry-run" }, "Preview (dry run)"), go);
  let previewed = null;
  const filters = () => {
    const v = formValues(form);
    return Object.fromEntries(Object.entries(v).filter(([, x]) => x));
  };
  form.addEventListener("input", () => { go.disabled = true; previewed = null; });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const r = await api("POST", "/admin/cache/invalidate", { ...filters(), dry_run: true });
      previewed = JSON.stringify(filters());
      out.replaceChildren(h("p", { id: "dry-run-count" }, `would remove ${r.matched} entries`));
      go.disabled = r.matched === 0;
    } catch (e) { out.replaceChildren(h("p", { class: "error" }, e.message)); }
  });
  go.addEventListener("click", async () => {
    if (previewed !== JSON.stringify(filters())) { go.disabled = true; return; }
    try {
      const r = await api("POST", "/admin/cache/invalidate", { ...filters(), dry_run: false });
      out.replaceChildren(h("p", { class: "ok", id: "removed-count" }, `removed ${r.removed} entries`));
      go.disabled = true;
    } catch (e) { out.replaceChildren(h("p", { class: "error" }, e.message)); }
  });
  show(h("h2", {}, "Stats"), h("pre", { id: "cache-stats" }, JSON.stringify(stats, null, 2)),
    h("h2", {}, "Invalidate (preview first)"), form, out);
}

// -- cost ----------------------------------------------------------------------------
function costPlot(curve) {
  const W = 640, H = 300, P = 48;
  const pts = curve.points;
  const ys = pts.flatMap((p) => [p.managed_usd_per_month, p.self_hosted_usd_per_month]).filter((y) => y != null);
  const maxX = pts[pts.length - 1].tokens_per_s || 1, maxY = Math.max(1e-9, ...ys);
  const x = (v) => P + ((W - 2 * P) * v) / maxX, y = (v) => H - P - ((H - 2 * P) * v) / maxY;
  const line = (key, color, id) => svg("polyline", {
    id, fill: "none", stroke: color, "stroke-width": 2,
    points: pts.filter((p) => p[key] != null).map((p) => `${x(p.tokens_per_s)},${y(p[key])}`).join(" "),
  });
  const today = curve.today_tokens_per_s;
  const near = pts.reduce((a, b) => (Math.abs(b.tokens_per_s - today) < Math.abs(a.tokens_per_s - today) ? b : a));
  return svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "cost-plot", role: "img" },
    svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#999" }),
    svg("line", { x1: P, y1: P, x2: P, y2: H - P, stroke: "#999" }),
    line("managed_usd_per_month", "#1f6feb", "managed-line"),
    line("self_hosted_usd_per_month", "#d1242f", "self-line"),
    svg("line", { x1: x(today), y1: P, x2: x(today), y2: H - P, stroke: "#1a7f37", "stroke-dasharray": "4 3" }),
    svg("circle", { id: "today", cx: x(today), cy: y(near.self_hosted_usd_per_month), r: 5, fill: "#1a7f37" }),
    svg("text", { x: x(today) + 6, y: P + 12 }, "today"),
    svg("text", { x: W / 2 - 60, y: H - 12 }, "traffic, tokens/s"),
    svg("text", { x: 4, y: P - 10 }, `USD/month (max ${maxY.toFixed(2)})`),
    svg("text", { x: W - P - 150, y: P + 12, fill: "#1f6feb" }, "managed API"),
    svg("text", { x: W - P - 150, y: P + 26, fill: "#d1242f" }, "self-hosted"),
    svg("text", { x: W - P - 40, y: H - P + 14 }, maxX.toFixed(2)));
}

async function costPage() {
  const since = new URLSearchParams(location.search).get("since") || "30d";
  const pick = h("form", { class: "filters", id: "cost-window" },
    h("label", {}, "Window", h("select", { name: "since", id: "f-cost-since" },
      ["1d", "7d", "30d", "90d"].map((v) => h("option", { value: v, selected: v === since }, v)))),
    h("button", { type: "submit" }, "Show"));
  pick.addEventListener("submit", (ev) => { ev.preventDefault(); location.search = qs(formValues(pick)); });
  const r = await api("GET", `/admin/cost${qs({ since })}`);
  const s = r.self_hosted, m = r.managed, be = r.break_even;
  show(pick,
    h("p", { id: "verdict" }, r.verdict),
    h("div", { class: "tiles", id: "cost-tiles" },
      tile("self-hosted, USD/month", usd(s.per_month_usd), "self-month"),
      tile("managed API, USD/month", usd(m.per_month_usd), "managed-month"),
      tile("utilization (measured)", pct(s.utilization), "utilization"),
      tile("break-even traffic", be.tokens_per_s == null ? "—" : `${num(be.tokens_per_s, 3)} tok/s`, "break-even"),
      tile("break-even utilization", pct(be.utilization)),
      tile("traffic now", `${num(r.traffic.tokens_per_s, 3)} tok/s`)),
    h("p", { class: "hint" }, `Window ${time(r.window.since)} to ${time(r.window.until)} UTC (${num(r.window.hours, 2)} h); `,
      "both sides are this window's averages, monthly = hourly × 730."),
    costPlot(r.curve),
    h("h2", {}, "By model (traffic served by local engines)"),
    table([
      { title: "Model", get: (x) => x.model },
      { title: "Requests", num: true, get: (x) => num(x.self_hosted_requests) },
      { title: "Input tokens", num: true, get: (x) => num(x.self_hosted_input_tokens) },
      { title: "Output tokens", num: true, get: (x) => num(x.self_hosted_output_tokens) },
      { title: "Managed API cost", num: true, get: (x) => usd(x.managed_usd) },
      { title: "All requests", num: true, get: (x) => num(x.requests) },
    ], r.models, "cost-models"),
    h("h2", {}, "By tenant"),
    table([
      { title: "Tenant", get: (x) => x.tenant },
      { title: "Requests", num: true, get: (x) => num(x.requests) },
      { title: "Input tokens", num: true, get: (x) => num(x.input_tokens) },
      { title: "Output tokens", num: true, get: (x) => num(x.output_tokens) },
      { title: "Managed API cost", num: true, get: (x) => usd(x.managed_usd) },
    ], r.tenants, "cost-tenants"),
    h("h2", {}, "Engines"),
    table([
      { title: "Engine", get: (x) => x.engine },
      { title: "Busy", num: true, get: (x) => `${num(x.busy_s, 1)} s` },
      { title: "Utilization", num: true, get: (x) => pct(x.utilization) },
    ], r.engines, "cost-engines"));
}

const PAGES = {
  requests: () => (ARG ? requestPage(ARG) : requestsPage()),
  tasks: () => (ARG ? taskPage(ARG) : tasksPage()),
  live: livePage, tenants: tenantsPage, cache: cachePage, cost: costPage,
};
(PAGES[PAGE] || (() => Promise.resolve()))().catch(fail);
