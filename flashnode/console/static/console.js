// The flashnode console. Everything the agent sends is set as text (textContent, never HTML):
// task output and the coordinator's words are hostile. It asks for data only while the page is
// visible; state every 2 s, charts and the coordinator's view every 30 s.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let csrf = "";
let level = "";
let span = "hour";
let timers = [];

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function replace(node, ...children) { node.replaceChildren(...children.filter((c) => c !== null)); }

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(Math.floor(s), 0);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
}

function pct(v) { return typeof v === "number" ? v.toFixed(v < 10 ? 1 : 0) + "%" : "-"; }

function bytes(n) {
  if (typeof n !== "number") return "-";
  for (const [u, f] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) if (n >= f) return (n / f).toFixed(1) + " " + u;
  return n + " B";
}

function when(t) {
  if (typeof t !== "number") return "-";
  const d = new Date(t * 1000);
  return d.toLocaleString([], { dateStyle: "short", timeStyle: "long" });  // with the zone
}

async function api(path, body) {
  const init = { credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.headers["X-Flashnode-CSRF"] = csrf;
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) { showLogin(); throw new Error("not logged in"); }
  const data = await r.json().catch(() => ({ error: "the agent answered " + r.status }));
  if (!r.ok) throw new Error(data.error || ("the agent answered " + r.status));
  return data;
}

function showLogin() {
  for (const t of timers) clearInterval(t);
  timers = [];
  $("app").hidden = true;
  $("login").hidden = false;
  $("btn-logout").hidden = true;
  replace($("state-badge"), "not logged in");
}

function say(id, text, isError) {
  const p = $(id);
  p.textContent = text;
  p.className = isError ? "error" : "";
}

// --- state --------------------------------------------------------------------------------

async function refreshState() {
  const s = await api("/api/state");
  const a = s.agent;
  const badge = $("state-badge");
  if (!a) {
    badge.textContent = "starting";
    badge.className = "badge";
    return;
  }
  const held = (s.why && s.why.holds.length) || a.draining;
  const down = !a.registered || /unreachable/.test(a.state);
  badge.textContent = down ? "not connected" : held ? "held" : (s.running.length ? "working" : "idle");
  badge.className = "badge " + (down ? "down" : held ? "held" : "working");
  $("node-id").textContent = a.node_id || "";
  $("state").textContent = a.state;
  renderWhy(s.why || { holds: [] }, a);
  renderNode(a, s);
  renderSlots(s.running || []);
  renderTotals(s.totals);
  renderSettings(s.settings);
}

function renderWhy(why, a) {
  const items = [];
  for (const h of why.holds) {
    const li = el("li", { "data-rule": h.rule }, el("strong", {}, h.rule), ": ", h.reason,
      h.suspends ? " (running tasks are suspended)" : "");
    if (h.fix) li.append(el("span", { class: "fix" }, "fix: ", h.fix));
    items.push(li);
  }
  if (why.stop_reason) items.push(el("li", {}, "running tasks are stopped: ", why.stop_reason));
  if (why.rejoined) {
    items.push(el("li", { "data-rule": "rejoined" },
      "re-attached " + why.rejoined + " task(s) after a restart"));
  }
  if (why.reload_refused) {
    items.push(el("li", { "data-rule": "reload" }, el("strong", {}, "reload refused"), " at ",
      when(why.reload_refused.at), " (the running configuration is kept): ", why.reload_refused.reason,
      el("span", { class: "fix" }, "fix: ", why.reload_fix)));
  }
  for (const p of why.coordinator || []) {
    items.push(el("li", { "data-rule": "coordinator" }, el("strong", {}, p.conversation + " failing"),
      " since ", when(p.since), ": ", p.error, el("span", { class: "fix" }, "fix: ", p.fix)));
  }
  if (why.last_exit) {
    const x = why.last_exit;
    items.push(el("li", { "data-rule": "last-exit" },
      el("strong", {}, x.before_start ? "the agent before this start exited " + x.code : "an agent beside this one exited " + x.code),
      " at ", when(x.at), ": ", x.error, x.fix ? el("span", { class: "fix" }, "fix: ", x.fix) : null));
  }
  if (!a.registered && !(why.coordinator || []).length) items.push(el("li", {}, "not registered with the coordinator yet: ", a.state));
  if (a.draining) items.push(el("li", {}, "draining: the agent is stopping"));
  replace($("why-list"), ...items);
  $("why").hidden = items.length === 0;
}

function fact(dl, name, value) { dl.append(el("dt", {}, name), el("dd", {}, value)); }

function renderNode(a, s) {
  const dl = $("node-facts");
  replace(dl);
  fact(dl, "node", a.node_id || "-");
  fact(dl, "coordinator", a.coordinator || "-");
  fact(dl, "connection", a.registered ? "registered; last heartbeat " + duration(a.last_heartbeat_age_s) + " ago" : "not registered");
  fact(dl, "runner", a.runner + ", " + a.slots + " slot(s)");
  fact(dl, "pools", (a.pools || []).join(", ") || "-");
  fact(dl, "version", "flashnode " + s.version);
}

function renderSlots(running) {
  const rows = running.map((r) => {
    const u = r.usage || {};
    let cps = typeof r.checkpoints === "number" ? String(r.checkpoints) : "-";
    if (r.checkpoint_step !== null && r.checkpoint_step !== undefined) cps += " (step " + r.checkpoint_step + ")";
    let phase = r.phase;
    if (r.suspended_s !== null && r.suspended_s !== undefined) {
      phase += ", paused " + duration(r.suspended_s) + (r.suspend_reason ? ": " + r.suspend_reason : "");
    }
    if (r.facts) phase += " (" + r.facts + ")";
    const out = [r.output && r.output.stdout, r.output && r.output.stderr].filter((x) => x).join("\n");
    return el("tr", { "data-lease": r.lease_id },
      el("td", {}, el("div", { class: "mono" }, r.job_id + "/" + r.task_id), el("div", { class: "muted mono" }, r.lease_id)),
      el("td", {}, phase), el("td", {}, duration(r.elapsed_s)), el("td", {}, duration(r.lease_left_s)),
      el("td", {}, pct(u.cpu_percent)), el("td", {}, bytes(u.memory_bytes)), el("td", {}, pct(u.gpu_percent)),
      el("td", {}, cps), el("td", { class: "output" }, el("pre", {}, out || "-")));
  });
  replace($("slots").tBodies[0], ...rows);
  $("slots-empty").hidden = rows.length > 0;
}

function renderTotals(t) {
  const row = (name, x) => el("tr", {}, el("th", {}, name), el("td", {}, x.tasks),
    el("td", {}, x.cpu_hours.toFixed(2)), el("td", {}, x.gpu_hours.toFixed(2)),
    el("td", {}, Object.entries(x.outcomes).map(([k, v]) => k + " " + v).join(", ") || "-"));
  replace($("totals-body"), row("today", t.today), row("all time", t.all_time));
}

let settingsShown = "";
function renderSettings(st) {
  $("config-file").textContent = st.config_file ? "(" + st.config_file + ")" : "(no config file: nothing to change)";
  $("pools-now").textContent = (st.pools || []).join(", ") || "-";
  const key = JSON.stringify([st.run_windows, st.task_cpu_percent]);
  if (key !== settingsShown && document.activeElement !== $("run-windows") && document.activeElement !== $("cpu-cap")) {
    settingsShown = key;
    $("run-windows").value = (st.run_windows || []).join("\n");
    $("cpu-cap").value = st.task_cpu_percent === null ? "" : st.task_cpu_percent;
  }
}

// --- charts -------------------------------------------------------------------------------

async function refreshCharts() {
  const c = await api("/api/charts?span=" + span);
  drawUsage(c);
  drawTasks(c);
}

function xOf(t, c, w) { return 30 + ((t - c.since) / (c.now - c.since)) * (w - 40); }

function axes(svg, c, w, h, top) {
  svg.append(el("svg:line", { class: "grid", x1: 30, x2: w - 10, y1: h - 20, y2: h - 20 }));
  svg.append(el("svg:text", { class: "axis", x: 2, y: 12 }, top));
  svg.append(el("svg:text", { class: "axis", x: 30, y: h - 6 }, c.span === "day" ? "24 h ago" : "1 h ago"));
  svg.append(el("svg:text", { class: "axis", x: w - 40, y: h - 6 }, "now"));
}

function drawUsage(c) {
  const svg = $("usage-chart");
  const w = 600, h = 160;
  replace(svg);
  axes(svg, c, w, h, "100%");
  svg.append(el("svg:line", { class: "grid", x1: 30, x2: w - 10, y1: 10, y2: 10 }));
  const y = (v) => h - 20 - (v / 100) * (h - 30);
  [["cpu", 1], ["mem", 2], ["gpu", 3]].forEach(([name, i]) => {
    const pts = c.usage.filter((p) => typeof p[i] === "number").map((p) => xOf(p[0], c, w).toFixed(1) + "," + y(p[i]).toFixed(1));
    if (pts.length === 1) pts.push((Number(pts[0].split(",")[0]) + 2).toFixed(1) + "," + pts[0].split(",")[1]);
    if (pts.length) svg.append(el("svg:polyline", { class: name, points: pts.join(" ") }));
  });
}

function drawTasks(c) {
  const svg = $("tasks-chart");
  const w = 600, h = 100;
  replace(svg);
  const most = Math.max(1, ...c.tasks.map((b) => b[1]));
  axes(svg, c, w, h, String(most));
  const bw = Math.max(((w - 40) * c.bin_seconds) / (c.now - c.since) - 2, 1);
  for (const [t, n] of c.tasks) {
    if (!n) continue;
    const bh = (n / most) * (h - 30);
    svg.append(el("svg:rect", { class: "bar", x: Math.max(xOf(t, c, w), 30).toFixed(1), y: (h - 20 - bh).toFixed(1), width: bw.toFixed(1), height: bh.toFixed(1) },
      el("svg:title", {}, n + " task(s) from " + when(t))));
  }
  $("tasks-caption").textContent = "tasks done per " + (c.bin_seconds >= 3600 ? "hour" : c.bin_seconds / 60 + " minutes") + ", " + c.tasks.reduce((s, b) => s + b[1], 0) + " in all";
}

// --- history and the coordinator's view -------------------------------------------------------

async function refreshHistory() {
  const outcome = $("outcome-filter").value;
  const rows = await api("/api/history?limit=100" + (outcome ? "&outcome=" + encodeURIComponent(outcome) : ""));
  const body = $("history-table").tBodies[0];
  replace(body, ...rows.map((r) => {
    const tr = el("tr", { "data-lease": r.lease_id, "data-outcome": r.outcome },
      el("td", {}, when(r.ended_at)), el("td", { class: "mono" }, r.job_id + "/" + r.task_id),
      el("td", {}, r.outcome), el("td", {}, r.wall_seconds === null ? "-" : r.wall_seconds.toFixed(1) + "s"),
      el("td", {}, pct(r.cpu_percent)), el("td", {}, pct(r.gpu_percent)), el("td", {}, r.reason.split("\n")[0].slice(0, 120)));
    tr.addEventListener("click", () => toggleDetail(tr, r));
    return tr;
  }));
}

function toggleDetail(tr, r) {
  const next = tr.nextElementSibling;
  if (next && next.classList.contains("detail")) { next.remove(); return; }
  const out = r.output ? [r.output.stdout, r.output.stderr].filter((x) => x).join("\n") : "";
  const td = el("td", { colspan: 7 },
    el("div", {}, "lease ", el("span", { class: "mono" }, r.lease_id), r.facts ? " · " + r.facts : "",
      typeof r.checkpoints === "number" ? " · checkpoints " + r.checkpoints : ""),
    el("div", {}, "reason:"), el("pre", {}, r.reason || "-"),
    el("div", {}, "output:"), el("pre", {}, out || "not kept on this node"));
  tr.after(el("tr", { class: "detail" }, td));
}

async function refreshCoordinator() {
  const v = await api("/api/coordinator");
  const dl = $("coordinator-facts");
  replace(dl);
  if (v.error) { fact(dl, "unavailable", v.error); return; }
  fact(dl, "online", v.online ? "yes" : "no");
  fact(dl, "accepted tasks", v.accepted_tasks ?? "-");
  fact(dl, "failed attempts", v.failed_attempts ?? "-");
  fact(dl, "abandoned leases", v.abandoned_leases ?? "-");
  fact(dl, "reliability", typeof v.reliability === "number" ? (v.reliability * 100).toFixed(0) + "%" : "-");
  fact(dl, "placement tier", v.placement_tier || "-");
}

// --- actions ------------------------------------------------------------------------------

async function act(path, body, messageId) {
  try {
    const r = await api(path, body);
    say(messageId, r.message || "done", false);
  } catch (e) {
    say(messageId, e.message, true);
  }
  await run(refreshState);
}

function bind() {
  $("btn-pause").addEventListener("click", () => act("/api/pause", { mode: "drain" }, "message"));
  $("btn-pause-now").addEventListener("click", () => {
    if (confirm("Stop the running tasks now? Their leases lapse (not counted as their failure).")) act("/api/pause", { mode: "now" }, "message");
  });
  $("btn-pause-for").addEventListener("click", () => act("/api/pause", { mode: "drain", for: $("pause-for").value }, "message"));
  $("btn-resume").addEventListener("click", () => act("/api/resume", {}, "message"));
  $("settings-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const cap = $("cpu-cap").value.trim();
    settingsShown = "";
    act("/api/settings", {
      run_windows: $("run-windows").value.split("\n").map((x) => x.trim()).filter((x) => x),
      task_cpu_percent: cap === "" ? null : Number(cap),
    }, "settings-message");
  });
  $("btn-join").addEventListener("click", () => act("/api/pools", { join: $("pool-id").value.trim() }, "settings-message"));
  $("btn-leave").addEventListener("click", () => act("/api/pools", { leave: $("pool-id").value.trim() }, "settings-message"));
  $("outcome-filter").addEventListener("change", () => run(refreshHistory));
  $("btn-logout").addEventListener("click", async () => { await api("/api/logout", {}).catch(() => null); showLogin(); });
  for (const b of document.querySelectorAll("[data-span]")) {
    b.addEventListener("click", () => {
      span = b.dataset.span;
      for (const o of document.querySelectorAll("[data-span]")) o.classList.toggle("on", o === b);
      run(refreshCharts);
    });
  }
}

async function run(fn) {
  try { await fn(); } catch (e) { if (e.message !== "not logged in") say("message", e.message, true); }
}

function every(ms, fn) {
  run(fn);
  timers.push(setInterval(() => { if (document.visibilityState === "visible") run(fn); }, ms));
}

async function start() {
  bind();
  let session;
  try { session = await api("/api/session"); } catch (e) { return; }
  csrf = session.csrf;
  level = session.level;
  document.body.classList.toggle("view-only", level !== "owner");
  $("level").textContent = level === "owner" ? "" : "view only";
  $("app").hidden = false;
  $("btn-logout").hidden = false;
  every(2000, refreshState);
  every(30000, refreshCharts);
  every(10000, refreshHistory);
  every(30000, refreshCoordinator);
}

document.addEventListener("DOMContentLoaded", start);
