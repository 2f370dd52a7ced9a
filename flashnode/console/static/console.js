// The flashnode console. Everything the agent sends is set as text (textContent, never HTML):
// task output, job names and the coordinator's words are hostile. It asks for data only while
// the page is visible; state every 2 s, history every 10 s, charts and the coordinator's view
// every 30 s (every 2 s while the agent is asking the coordinator). Times are shown in 24-hour form with their zone. At most two requests are under
// way at once, over all of its tabs (the agent answers at most four at once per user, and
// closes the rest unanswered); each has a time limit, and once the agent has not answered for
// longer than the rule `flashnode status` follows for status.json (three refresh periods, at
// least 30 s) the page says so until it answers again.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let csrf = "";
let level = "";
let span = "hour";
let timers = [];
let lastState = null;
let lastHistory = [];
let lastCharts = null;
const jobs = {};  // job id -> {name, state} as the coordinator says (or {} while unknown)
const askAt = {};  // job id -> when to ask for it next (the agent looks it up meanwhile)
const tries = {};
const open = new Set();  // the history rows the owner opened (by lease id): kept open
let settingsDirty = false;  // the owner typed in the settings: no refresh overwrites it
const STATE_MS = 2000;  // the state's refresh period
const NO_ANSWER_MS = Math.max(3 * STATE_MS, 30000);  // owner/status.py's staleness rule
const ASK_MS = 10000, CHANGE_MS = 30000;  // how long a look and a change may take to answer
let answeredAt = null;  // when the agent last sent its state (ms)
let askingSince = Date.now();  // since when the page asks for it (it asks only while visible)
let refreshError = false;  // #message holds a refresh's error (cleared once one succeeds)
let coordinatorAgain = null;  // the coordinator's view asked again soon: the agent asks it
let oldAskedAgain = false;  // a view not current was asked again already (once is enough)

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function replace(node, ...children) { node.replaceChildren(...children.filter((c) => c !== null && c !== undefined)); }

// --- words for numbers ----------------------------------------------------------------------

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(Math.floor(s), 0);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + String(s % 60).padStart(2, "0") + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

// Hours given, read well for short work: seconds, minutes, then hours.
function hours(h) {
  if (typeof h !== "number") return "-";
  const s = h * 3600;
  if (s === 0) return "0 min";
  if (s < 60) return Math.max(Math.round(s), 1) + " s";
  if (s < 3600) return Math.round(s / 60) + " min";
  return (h < 10 ? h.toFixed(1) : Math.round(h)) + " h";
}

function pct(v) { return typeof v === "number" ? v.toFixed(v < 10 ? 1 : 0) + "%" : "-"; }

function bytes(n) {
  if (typeof n !== "number") return "-";
  for (const [u, f] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) if (n >= f) return (n / f).toFixed(1) + " " + u;
  return n + " B";
}

const two = (n) => String(n).padStart(2, "0");
let zoneName = null;
function zone() {
  if (zoneName === null) {
    try {
      const part = new Intl.DateTimeFormat([], { timeZoneName: "short" }).formatToParts(new Date())
        .find((p) => p.type === "timeZoneName");
      zoneName = part ? part.value : "";
    } catch (e) { zoneName = ""; }
    if (!zoneName) {
      const off = -new Date().getTimezoneOffset();
      zoneName = "UTC" + (off >= 0 ? "+" : "-") + two(Math.floor(Math.abs(off) / 60)) + ":" + two(Math.abs(off) % 60);
    }
  }
  return zoneName;
}

// 24-hour, with the zone: "18:04:09 UTC" today, "2026-12-05 18:04 UTC" before.
function when(t) {
  if (typeof t !== "number") return "-";
  const d = new Date(t * 1000);
  const now = new Date();
  const clock = two(d.getHours()) + ":" + two(d.getMinutes());
  if (d.toDateString() === now.toDateString()) return clock + ":" + two(d.getSeconds()) + " " + zone();
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " + clock + " " + zone();
}

function clockAt(t, withDay) {
  const d = new Date(t * 1000);
  const clock = two(d.getHours()) + ":" + two(d.getMinutes());
  return withDay ? d.toLocaleDateString([], { weekday: "short" }) + " " + clock : clock;
}

// --- talking to the agent -------------------------------------------------------------------

// Two lanes for requests: a request waits for a free one. Shared by every tab of this console
// where the browser has Web Locks (a secure context: the loopback address is one), else this
// page's own.
const LANES = 2;
let nextLane = 0;
const local = { busy: 0, waiting: [] };

async function inLane(fn) {
  if (navigator.locks) {
    for (let i = 0; i < LANES; i++) {  // a free lane first, then wait in turn for one
      const got = await navigator.locks.request("flashnode-api-" + i, { ifAvailable: true },
        async (lock) => (lock ? { value: await fn() } : null));
      if (got) return got.value;
    }
    return navigator.locks.request("flashnode-api-" + (nextLane++ % LANES), fn);
  }
  if (local.busy >= LANES) await new Promise((go) => local.waiting.push(go));
  else local.busy++;
  try { return await fn(); } finally {
    const next = local.waiting.shift();
    if (next) next(); else local.busy--;
  }
}

async function api(path, body) {
  const init = { credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.headers["X-Flashnode-CSRF"] = csrf;
    init.body = JSON.stringify(body);
  }
  const limit = body === undefined ? ASK_MS : CHANGE_MS;
  return inLane(async () => {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), limit);
    init.signal = abort.signal;
    try {
      const r = await fetch(path, init);
      if (r.status === 401) { showLogin(); throw new Error("not logged in"); }
      const data = await r.json().catch((e) => {
        if (abort.signal.aborted) throw e;
        return { error: "the agent answered " + r.status };
      });
      if (!r.ok) throw new Error(data.error || ("the agent answered " + r.status));
      return data;
    } catch (e) {
      if (abort.signal.aborted) throw new Error("no answer from the agent within " + duration(limit / 1000));
      throw e;
    } finally {
      clearTimeout(timer);
    }
  });
}

function showLogin() {
  for (const t of timers) clearInterval(t);
  timers = [];
  clearTimeout(coordinatorAgain);
  $("app").hidden = true;
  $("login").hidden = false;
  $("btn-logout").hidden = true;
  replace($("state-badge"), "not logged in");
}

function say(id, text, isError) {
  const p = $(id);
  p.textContent = text;
  p.className = isError ? "error" : "";
  if (id === "message") refreshError = false;
}

// The agent has not answered for longer than the rule allows: the badge and the top box say
// so (what the page shows is its last answer), until an answer comes.
function checkAnswer() {
  if (document.visibilityState !== "visible" || $("app").hidden) return;
  const now = Date.now();
  if (now - Math.max(answeredAt || 0, askingSince) <= NO_ANSWER_MS) return;
  const badge = $("state-badge");
  badge.textContent = "no answer";
  badge.className = "badge down";
  $("stale-text").textContent = (answeredAt === null
    ? "No answer from the agent since this page opened at " + when(askingSince / 1000) + " (" + duration((now - askingSince) / 1000) + " ago)"
    : "No answer from the agent since " + when(answeredAt / 1000) + " (" + duration((now - answeredAt) / 1000) + " ago)")
    + ": what is shown may no longer hold. Is it stopped or stuck? See the journal (journalctl -u flashnode).";
  $("stale").hidden = false;
}

// Job names: asked for once a job id shows up (the coordinator may not say: then the id alone).
async function learnJobs(ids) {
  const now = Date.now();
  const wanted = [...new Set(ids)].filter((j) => j && !(j in jobs) && now >= (askAt[j] || 0)).slice(0, 64);
  if (!wanted.length) return;
  for (const j of wanted) {
    tries[j] = (tries[j] || 0) + 1;
    askAt[j] = now + Math.min(2000 * tries[j], 60000);
  }
  const found = await api("/api/jobs?ids=" + wanted.map(encodeURIComponent).join(","));
  let learned = false;
  for (const [j, v] of Object.entries(found)) {
    if (v && (v.name || v.state)) { jobs[j] = v; learned = true; }
  }
  if (learned) {
    if (lastState) renderSlots(lastState.running || []);
    renderHistory();
  }
}

function jobName(id) { return (jobs[id] && jobs[id].name) || null; }

function outcome(name) { return el("span", { class: "outcome " + String(name).replace(/[^a-z]/g, "") }, name); }

// --- state ----------------------------------------------------------------------------------

async function refreshState() {
  const s = await api("/api/state");
  lastState = s;
  answeredAt = Date.now();
  if (refreshError) say("message", "", false);
  const a = s.agent;
  const badge = $("state-badge");
  renderSettings(s.settings);
  renderTotals(s.totals);
  if (!a) {
    badge.textContent = "not running";
    badge.className = "badge down";
    $("summary").textContent = "No agent runs on this machine's state dir: start it (sudo systemctl start flashnode).";
    $("stale").hidden = true;
    replace($("why-list"));
    $("why").hidden = true;
    renderSlots([]);
    return;
  }
  const stale = s.stale && s.stale.stale;
  const held = (s.why && s.why.holds.length) || a.draining;
  const down = !a.registered || (s.why && s.why.coordinator && s.why.coordinator.length);
  const running = s.running || [];
  let label, cls;
  if (stale) { label = "stale"; cls = "down"; }
  else if (down) { label = "not connected"; cls = "down"; }
  else if (held) { label = "held"; cls = "held"; }
  else { label = running.length ? "working" : "idle"; cls = "working"; }
  badge.textContent = label;
  badge.className = "badge " + cls;
  $("node-id").textContent = a.node_id || "";
  renderStale(s.stale, s.why);
  renderSummary(a, s.why || { holds: [] }, running);
  renderWhy(s.why || { holds: [] }, a);
  renderNode(a, s);
  renderSlots(running);
  learnJobs(running.map((r) => r.job_id)).catch(() => null);
  $("app").dataset.stateAt = String(s.now);  // the moment the page last showed
}

function renderStale(st, why) {
  const box = $("stale");
  if (!st || !st.stale) { box.hidden = true; return; }
  const failing = ((why && why.coordinator) || []).map((p) => p.conversation + " failing: " + p.error);
  let text = st.age_s === null
    ? "The agent's status carries no time."
    : "The agent last wrote its status " + duration(st.age_s) + " ago (at " + when(st.since) + "); it writes it at least every " + duration(st.limit_s / 3) + ".";
  text += failing.length ? " What fails: " + failing.join("; ") + "."
    : " Its loop may be stuck: see the journal (journalctl -u flashnode).";
  $("stale-text").textContent = text;
  box.hidden = false;
}

function count(n, one, many) { return n + " " + (n === 1 ? one : many); }

function renderSummary(a, why, running) {
  const tasks = count(running.length, "task", "tasks");
  let text;
  if (a.draining) text = "Stopping: no new work; " + tasks + " finishing.";
  else if (!a.registered) text = "Not registered with the coordinator yet.";
  else if (why.coordinator && why.coordinator.length) text = "The coordinator does not answer; the agent keeps trying.";
  else if (!running.length) text = "Waiting for work.";
  if (running.length && !a.draining) text = (text ? text + " " : "") + "Running " + tasks + " of " + count(a.slots, "slot", "slots") + ".";
  if (why.holds && why.holds.length) text += " Not claiming: " + why.holds.map((h) => h.rule).join(", ") + ".";
  $("summary").textContent = text;
  // The buttons that apply now: Resume while paused, the pauses while not.
  const paused = Boolean(why.paused);
  for (const id of ["btn-pause", "btn-pause-now", "btn-pause-for", "pause-for-label"]) $(id).hidden = paused;
  $("btn-resume").hidden = !paused;
  $("why-title").textContent = running.length ? "Why this node takes no new work" : "Why this node is not working";
}

// Text in which `a command` is shown as code (still text: never markup).
function words(text) {
  const parts = String(text || "").split("`");
  return parts.map((p, i) => (i % 2 ? el("code", {}, p) : p));
}

function renderWhy(why, a) {
  const items = [];
  for (const h of why.holds) {
    const li = el("li", { "data-rule": h.rule }, el("strong", {}, h.rule), ": ", ...words(h.reason),
      h.suspends ? " (running tasks are paused)" : "");
    if (h.fix) li.append(el("span", { class: "fix" }, "fix: ", ...words(h.fix)));
    items.push(li);
  }
  if (why.stop_reason) items.push(el("li", {}, "running tasks are stopped: ", why.stop_reason));
  if (why.reload_refused) {
    items.push(el("li", { "data-rule": "reload" }, el("strong", {}, "reload refused"), " at ",
      when(why.reload_refused.at), " (the running configuration is kept): ", why.reload_refused.reason,
      el("span", { class: "fix" }, "fix: ", ...words(why.reload_fix))));
  }
  for (const p of why.coordinator || []) {
    items.push(el("li", { "data-rule": "coordinator" }, el("strong", {}, p.conversation + " failing"),
      " since ", when(p.since), ": ", p.error, el("span", { class: "fix" }, "fix: ", ...words(p.fix))));
  }
  if (why.last_exit) {
    const x = why.last_exit;
    items.push(el("li", { "data-rule": "last-exit" },
      el("strong", {}, x.before_start ? "the agent before this start exited " + x.code : "an agent beside this one exited " + x.code),
      " at ", when(x.at), ": ", x.error, x.fix ? el("span", { class: "fix" }, "fix: ", ...words(x.fix)) : null));
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
  fact(dl, "runner", a.runner + ", " + count(a.slots, "slot", "slots"));
  fact(dl, "pools", (a.pools || []).join(", ") || "-");
  // Not a reason it takes no work: what this start found (status.json says no more).
  const rejoined = s.why && s.why.rejoined;
  if (rejoined) fact(dl, "this start", "re-attached " + count(rejoined, "task", "tasks") + " after a restart");
  fact(dl, "version", "flashnode " + s.version);
}

// An attempt's facts (the agent's describe_facts: "env built in 2.0 s; data …; paused 1x 1 min
// 34 s (last: …)") split in what was prepared for it and its pauses, the last of them.
function splitFacts(facts) {
  const text = String(facts || "");
  const at = text.startsWith("paused ") ? 0 : text.indexOf("; paused ");
  if (at < 0) return { prepared: text, paused: "" };
  return { prepared: text.slice(0, at), paused: text.slice(at ? at + 2 : 0) };
}

// An output box: bounded in height with its own scroll (focusable, for the keyboard); `key`
// names it across redraws (lease and stream).
function stream(name, text, key) {
  if (!text) return null;
  const pre = el("pre", { class: "output", tabindex: 0, role: "region", "aria-label": name }, text);
  if (key) pre.dataset.key = key;
  return el("div", { class: "stream" }, el("div", { class: "stream-name" }, name), pre);
}

// What stands for an attempt's output when none is shown: the view-only login gets none of what
// a task printed (the agent sends output_hidden), else `none` (nothing printed yet, or not kept).
function outputNote(r, none) {
  if (r.output_hidden) return el("p", { class: "muted" }, "output: owner only");
  const out = r.output || {};
  return !out.stdout && !out.stderr ? el("p", { class: "muted" }, none) : null;
}

// Boxes drawn anew show their newest line, unless the owner scrolled up in the one they
// replace: that stays where it was (and keeps the focus).
function keepScroll(container, draw) {
  const before = {};
  for (const pre of container.querySelectorAll("pre.output[data-key]")) {
    before[pre.dataset.key] = { top: pre.scrollTop, end: pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 2,
      focused: document.activeElement === pre };
  }
  draw();
  for (const pre of container.querySelectorAll("pre.output[data-key]")) {
    const was = before[pre.dataset.key];
    pre.scrollTop = was && !was.end ? was.top : pre.scrollHeight;
    if (was && was.focused) pre.focus({ preventScroll: true });
  }
}

function renderSlots(running) {
  const cards = running.map((r) => {
    const u = r.usage || {};
    const name = jobName(r.job_id);
    let phase = r.phase;
    if (typeof r.suspended_s === "number") {
      phase = "paused " + duration(r.suspended_s) + (r.suspend_reason ? ": " + r.suspend_reason : "");
    }
    const dl = el("dl", {});
    fact(dl, "running for", duration(r.elapsed_s));
    if (typeof r.lease_left_s === "number") fact(dl, "lease left", duration(r.lease_left_s));
    const steps = [];
    if (typeof r.metrics_step === "number") steps.push("step " + r.metrics_step + " logged");
    if (typeof r.checkpoint_step === "number") steps.push("checkpoint at step " + r.checkpoint_step);
    else if (typeof r.checkpoints === "number" && r.checkpoints) steps.push(r.checkpoints + " checkpoint(s)");
    if (typeof r.resumed_from_step === "number") steps.push("resumed from step " + r.resumed_from_step);
    fact(dl, "progress", steps.join(" · ") || "no step logged yet");
    fact(dl, "use now", "CPU " + pct(u.cpu_percent) + " · memory " + bytes(u.memory_bytes) + " · GPU " + pct(u.gpu_percent));
    const { prepared, paused } = splitFacts(r.facts);
    if (prepared) fact(dl, "prepared", prepared);
    if (paused) fact(dl, "paused", paused);
    const out = r.output || {};
    return el("article", { class: "card", "data-lease": r.lease_id },
      el("h3", {}, name || r.job_id),
      el("div", { class: "sub" }, (r.pool ? "pool " + r.pool + " · " : "") + (name ? "job " + r.job_id + " · " : "") + "task " + r.task_id),
      el("span", { class: "phase outcome " + (typeof r.suspended_s === "number" ? "lapsed" : "running") }, phase),
      dl,
      stream("stdout, newest last", out.stdout, r.lease_id + ":stdout"),
      stream("stderr, newest last", out.stderr, r.lease_id + ":stderr"),
      outputNote(r, "no output yet"),
      el("div", { class: "sub mono" }, "lease " + r.lease_id));
  });
  keepScroll($("slot-list"), () => replace($("slot-list"), ...cards));
  $("slots-empty").hidden = cards.length > 0;
}

function renderTotals(t) {
  const box = (label, x) => el("div", {},
    el("h3", {}, label),
    el("div", {}, count(x.tasks, "task", "tasks") + " done · CPU " + hours(x.cpu_hours) + (x.gpu_hours ? " · GPU " + hours(x.gpu_hours) : "")),
    el("div", { class: "chips" }, ...Object.entries(x.outcomes).map(([k, v]) => el("span", { class: "outcome " + k.replace(/[^a-z]/g, "") }, k + " " + v))));
  replace($("totals-body"), box("today", t.today), box("all time", t.all_time));
}

let settingsShown = "";
function renderSettings(st) {
  $("config-file").textContent = st.config_file ? "in " + st.config_file : "no config file: nothing to change";
  $("pools-now").textContent = (st.pools || []).join(", ") || "-";
  if (settingsDirty) return;  // what the owner typed stays until it is saved
  const key = JSON.stringify([st.run_windows, st.task_cpu_percent]);
  if (key !== settingsShown) {
    settingsShown = key;
    $("run-windows").value = (st.run_windows || []).join("\n");
    $("cpu-cap").value = st.task_cpu_percent === null ? "" : st.task_cpu_percent;
  }
}

// --- charts ---------------------------------------------------------------------------------

async function refreshCharts() {
  lastCharts = await api("/api/charts?span=" + span);
  drawCharts();
}

function drawCharts() {
  if (!lastCharts) return;
  drawUsage(lastCharts);
  drawTasks(lastCharts);
}

const LEFT = 38, RIGHT = 10;
function widthOf(svg) { return Math.max(Math.round(svg.getBoundingClientRect().width), 200); }
function xOf(t, c, w) { return LEFT + ((t - c.since) / Math.max(c.now - c.since, 1)) * (w - LEFT - RIGHT); }

// The time axis: as many labels as fit with a gap between them (measured as drawn), down to
// the first and "now"; the chart's caption names their zone.
function timeAxis(svg, c, w, h) {
  svg.append(el("svg:line", { class: "grid", x1: LEFT, x2: w - RIGHT, y1: h - 22, y2: h - 22 }));
  const withDay = c.now - c.since > 86400 * 1.5;
  for (let ticks = Math.max(1, Math.min(6, Math.floor((w - LEFT) / 90))); ticks >= 1; ticks--) {
    const labels = [];
    for (let i = 0; i <= ticks; i++) {
      const t = c.since + ((c.now - c.since) * i) / ticks;
      const x = xOf(t, c, w);
      const anchor = i === 0 ? "start" : i === ticks ? "end" : "middle";
      const label = el("svg:text", { class: "axis", x: x.toFixed(1), y: h - 6, "text-anchor": anchor }, i === ticks ? "now" : clockAt(t, withDay));
      svg.append(label);
      labels.push(label);
    }
    if (ticks === 1 || apart(labels)) return;
    for (const label of labels) label.remove();
  }
}

function apart(labels) {
  const boxes = labels.map((label) => label.getBBox());
  return boxes.every((b, i) => i === 0 || boxes[i - 1].x + boxes[i - 1].width + 8 <= b.x);
}

function drawUsage(c) {
  const svg = $("usage-chart");
  const w = widthOf(svg), h = 180;
  svg.setAttribute("viewBox", "0 0 " + w + " " + h);
  svg.setAttribute("height", h);
  replace(svg);
  const y = (v) => h - 22 - (v / 100) * (h - 34);
  for (const v of [0, 50, 100]) {
    if (v) svg.append(el("svg:line", { class: "grid", x1: LEFT, x2: w - RIGHT, y1: y(v), y2: y(v) }));
    svg.append(el("svg:text", { class: "axis", x: LEFT - 4, y: y(v) + 4, "text-anchor": "end" }, v + "%"));
  }
  timeAxis(svg, c, w, h);
  $("usage-zone").textContent = "; times in " + zone();
  const gap = (c.step_seconds || 60) * 2.5;  // a longer silence (the agent was off) breaks the line
  [["cpu", 1], ["mem", 2], ["gpu", 3]].forEach(([name, i]) => {
    let run = [], prev = null;
    const flush = () => {
      if (run.length === 1) run.push([run[0][0] + 2, run[0][1]]);
      if (run.length) svg.append(el("svg:polyline", { class: name, points: run.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ") }));
      run = [];
    };
    for (const p of c.usage) {
      if (typeof p[i] !== "number") { flush(); prev = null; continue; }
      if (prev !== null && p[0] - prev > gap) flush();
      run.push([xOf(p[0], c, w), y(p[i])]);
      prev = p[0];
    }
    flush();
  });
}

function drawTasks(c) {
  const svg = $("tasks-chart");
  const w = widthOf(svg), h = 110;
  svg.setAttribute("viewBox", "0 0 " + w + " " + h);
  svg.setAttribute("height", h);
  replace(svg);
  const most = Math.max(1, ...c.tasks.map((b) => b[1]));
  svg.append(el("svg:text", { class: "axis", x: LEFT - 4, y: 16, "text-anchor": "end" }, String(most)));
  svg.append(el("svg:text", { class: "axis", x: LEFT - 4, y: h - 22, "text-anchor": "end" }, "0"));
  timeAxis(svg, c, w, h);
  const bw = Math.max(((w - LEFT - RIGHT) * c.bin_seconds) / Math.max(c.now - c.since, 1) - 1, 1);
  for (const [t, n] of c.tasks) {
    if (!n) continue;
    const bh = (n / most) * (h - 36);
    svg.append(el("svg:rect", { class: "bar", x: Math.max(xOf(t, c, w), LEFT).toFixed(1), y: (h - 22 - bh).toFixed(1), width: bw.toFixed(1), height: bh.toFixed(1) },
      el("svg:title", {}, n + " task(s) from " + when(t))));
  }
  const per = c.bin_seconds >= 86400 ? "day" : c.bin_seconds >= 3600 ? (c.bin_seconds === 3600 ? "hour" : c.bin_seconds / 3600 + " hours") : c.bin_seconds / 60 + " minutes";
  $("tasks-caption").textContent = "tasks done per " + per + ", " + c.tasks.reduce((s, b) => s + b[1], 0) + " in all; times in " + zone();
}

// --- history and the coordinator's view -----------------------------------------------------

async function refreshHistory() {
  const filter = $("outcome-filter").value;
  lastHistory = await api("/api/history?limit=100" + (filter ? "&outcome=" + encodeURIComponent(filter) : ""));
  renderHistory();
  learnJobs(lastHistory.map((r) => r.job_id)).catch(() => null);
}

function renderHistory() {
  const body = $("history-table").tBodies[0];
  const rows = [];
  for (const r of lastHistory) {
    const name = jobName(r.job_id);
    const td = (label, ...c) => el("td", { "data-label": label }, ...c);
    const tr = el("tr", { class: "row", "data-lease": r.lease_id, "data-outcome": r.outcome },
      td("ended", when(r.ended_at)),
      td("job", el("button", { type: "button", class: "link", "aria-expanded": open.has(r.lease_id) ? "true" : "false" },
        (name ? name + " · " : "") + r.job_id + "/" + r.task_id)),
      td("outcome", outcome(r.outcome)),
      td("took", r.wall_seconds === null ? "-" : duration(r.wall_seconds)),
      td("CPU", pct(r.cpu_percent)), td("GPU", pct(r.gpu_percent)),
      el("td", { class: "reason", "data-label": "reason" }, (r.reason || "").split("\n")[0].slice(0, 160) || "-"));
    const toggle = () => { if (open.has(r.lease_id)) open.delete(r.lease_id); else open.add(r.lease_id); renderHistory(); };
    tr.addEventListener("click", toggle);  // the row's button, by keyboard, clicks it too
    rows.push(tr);
    if (open.has(r.lease_id)) rows.push(detail(r));
  }
  keepScroll(body, () => replace(body, ...rows));
  $("history-empty").hidden = rows.length > 0;
}

function detail(r) {
  const out = r.output || {};
  const facts = [];
  if (r.pool) facts.push("pool " + r.pool);
  if (typeof r.metrics_step === "number") facts.push("last step logged " + r.metrics_step);
  if (typeof r.checkpoint_step === "number") facts.push("checkpoint at step " + r.checkpoint_step);
  else if (typeof r.checkpoints === "number") facts.push("checkpoints " + r.checkpoints);
  const split = splitFacts(r.facts);
  if (split.prepared) facts.push(split.prepared);
  if (split.paused) facts.push(split.paused);
  const td = el("td", { colspan: 7 },
    el("div", {}, "lease ", el("span", { class: "mono" }, r.lease_id), facts.length ? " · " + facts.join(" · ") : ""),
    el("div", {}, "reason:"), el("pre", {}, r.reason || "-"),
    stream("stdout", out.stdout, r.lease_id + ":stdout"), stream("stderr", out.stderr, r.lease_id + ":stderr"),
    outputNote(r, "output: not kept on this node"));
  return el("tr", { class: "detail", "data-detail": r.lease_id }, td);
}

// The coordinator's view: asked again in about 2 s while the agent asks the coordinator (before
// its first answer, `pending`, or for a newer one, `asking`), and once after an answer that is
// not current (the request that found it old set the agent asking, but says `asking` only from
// the next); one such ask waits at a time.
async function refreshCoordinator() {
  const v = await api("/api/coordinator");
  clearTimeout(coordinatorAgain);
  coordinatorAgain = null;
  const old = v.current === false && !v.asking;
  const again = v.pending || v.asking || (old && !oldAskedAgain);
  oldAskedAgain = old && again;
  if (again) {
    coordinatorAgain = setTimeout(() => {
      coordinatorAgain = null;
      if (document.visibilityState === "visible" && !$("app").hidden) run(refreshCoordinator);
    }, 2000);
  }
  renderCoordinator(v);
}

// Never a view as if it were now's when asking failed: the error, and the last good view only
// as "last known, as of" its time; a view asked longer ago than it counts as current says so.
function renderCoordinator(v) {
  const dl = $("coordinator-facts");
  const asOf = $("coordinator-as-of");
  const problem = $("coordinator-error");
  replace(dl);
  const failed = v.failed === true;
  problem.textContent = failed ? v.error + (typeof v.failed_at === "number" ? " (since " + when(v.failed_at) + ")" : "") : "";
  problem.hidden = !failed;
  const shown = failed ? v.last_known || null : v;
  let note = "";
  if (shown && typeof shown.fetched_at === "number") {
    note = (failed ? "last known, as of " : "as of ") + when(shown.fetched_at);
    if (!failed && v.current === false) note += ", not current" + (v.asking ? ": asking the coordinator again" : "");
  }
  asOf.textContent = note;
  asOf.hidden = !note;
  asOf.classList.toggle("not-current", failed || v.current === false);
  if (!failed && v.error) fact(dl, "unavailable", v.error);
  if (!shown || (!failed && v.error)) {
    $("lowered").hidden = true;
    $("scores").hidden = true;
    return;
  }
  if (shown.listed === false) {
    fact(dl, "listed", "no: the coordinator listed no such node");
    $("lowered").hidden = true;
    $("scores").hidden = true;
    return;
  }
  renderScores(dl, shown);
}

function renderScores(dl, v) {
  const explained = v.explained || {};
  fact(dl, "online", v.online ? "yes" : "no");
  fact(dl, "accepted tasks", v.accepted_tasks ?? "-");
  fact(dl, "failed attempts", v.failed_attempts ?? "-");
  fact(dl, "abandoned leases", v.abandoned_leases ?? "-");
  fact(dl, "reliability", typeof v.reliability === "number" ? (v.reliability * 100).toFixed(0) + "%" : "not yet");
  fact(dl, "placement tier", v.placement_tier || "-");
  const words = $("scores-explained");
  replace(words, ...["reliability", "placement_tier"].filter((k) => explained[k]).map((k) =>
    el("p", {}, el("strong", {}, k.replace("_", " ")), ": ", explained[k])));
  $("scores").hidden = !words.childElementCount;
  const lowered = v.lowered_by || [];
  replace($("lowered-list"), ...lowered.map((x) => el("li", {},
    outcome(x.outcome), " ", (jobName(x.job_id) ? jobName(x.job_id) + " · " : "") + x.job_id + "/" + x.task_id,
    " at ", when(x.ended_at), ": ", el("strong", {}, x.cause), x.reason ? " (" + x.reason + ")" : "")));
  $("lowered").hidden = lowered.length === 0;
  learnJobs(lowered.map((x) => x.job_id)).catch(() => null);
}

// --- actions --------------------------------------------------------------------------------

async function act(path, body, messageId) {
  let ok = false;
  try {
    const r = await api(path, body);
    say(messageId, r.message || "done", false);
    ok = true;
  } catch (e) {
    say(messageId, e.message, true);
  }
  await run(refreshState);
  return ok;
}

function bind() {
  $("btn-pause").addEventListener("click", () => act("/api/pause", { mode: "drain" }, "message"));
  $("btn-pause-now").addEventListener("click", () => {
    if (confirm("Stop the running tasks now? Their leases lapse (not counted as their failure).")) act("/api/pause", { mode: "now" }, "message");
  });
  $("btn-pause-for").addEventListener("click", () => act("/api/pause", { mode: "drain", for: $("pause-for").value }, "message"));
  $("btn-resume").addEventListener("click", () => act("/api/resume", {}, "message"));
  for (const id of ["run-windows", "cpu-cap"]) $(id).addEventListener("input", () => { settingsDirty = true; });
  $("settings-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const cap = $("cpu-cap").value.trim();
    const saved = await act("/api/settings", {
      run_windows: $("run-windows").value.split("\n").map((x) => x.trim()).filter((x) => x),
      task_cpu_percent: cap === "" ? null : Number(cap),
    }, "settings-message");
    if (saved) { settingsDirty = false; settingsShown = ""; await run(refreshState); }
  });
  $("btn-join").addEventListener("click", () => act("/api/pools", { join: $("pool-id").value.trim() }, "settings-message"));
  $("btn-leave").addEventListener("click", () => act("/api/pools", { leave: $("pool-id").value.trim() }, "settings-message"));
  $("outcome-filter").addEventListener("change", () => run(refreshHistory));
  $("btn-logout").addEventListener("click", async () => { await api("/api/logout", {}).catch(() => null); showLogin(); });
  for (const b of document.querySelectorAll("[data-span]")) {
    b.addEventListener("click", () => {
      span = b.dataset.span;
      for (const o of document.querySelectorAll("[data-span]")) {
        o.classList.toggle("on", o === b);
        o.setAttribute("aria-pressed", o === b ? "true" : "false");
      }
      run(refreshCharts);
    });
  }
  let pending = null;
  window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(drawCharts, 150); });
}

async function run(fn) {
  try { await fn(); } catch (e) {
    if (e.message !== "not logged in") { say("message", e.message, true); refreshError = true; }
  }
}

// A refresh every `ms` while the page is visible, never two of one kind under way (a slow
// agent does not pile them up); returns the refresh, to run at once.
function every(ms, fn) {
  let busy = false;
  const tick = async () => {
    if (busy) return;
    busy = true;
    try { await run(fn); } finally { busy = false; }
  };
  tick();
  timers.push(setInterval(() => { if (document.visibilityState === "visible") tick(); }, ms));
  return tick;
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
  askingSince = Date.now();
  const state = every(STATE_MS, refreshState);
  every(30000, refreshCharts);
  every(10000, refreshHistory);
  every(30000, refreshCoordinator);
  timers.push(setInterval(checkAnswer, 1000));
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState !== "visible" || $("app").hidden) return;
    askingSince = Date.now();  // it did not ask while hidden: no answer was missed
    state();
  });
}

document.addEventListener("DOMContentLoaded", start);
