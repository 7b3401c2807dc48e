// The ftlayer status page: polls /api/status once a second and shows what it gets.
// Plain JavaScript and a <canvas>, no library and nothing fetched from elsewhere, so the
// page works offline. Every shown figure carries its raw value in data-value.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 900; // what the server keeps, too (ftlayer.web.http)
const CAUSES = ["explicit", "timeout", "recovery", "source-expired"];
const RATE_WINDOW = 5; // samples (seconds) a rate is averaged over

let fields = [];
let samples = [];
let lastSample = null;

// ---- formatting ---------------------------------------------------------------------

function fmtInt(n) {
  return n == null ? "-" : Number(n).toLocaleString("en-US");
}

function fmtSeconds(s) {
  if (s == null) return "-";
  if (s < 0.01) return (s * 1000).toFixed(2) + " ms";
  if (s < 1) return (s * 1000).toFixed(1) + " ms";
  return s.toFixed(2) + " s";
}

function fmtBytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
}

function fmtDuration(s) {
  const total = Math.floor(s);
  const h = Math.floor(total / 3600);
  const m = Math.floor((total % 3600) / 60);
  const sec = total % 60;
  const pad = (x) => String(x).padStart(2, "0");
  return (h ? h + "h " : "") + (h || m ? pad(m) + "m " : "") + pad(sec) + "s";
}

function fmtClock(unixSeconds) {
  if (unixSeconds == null) return "-";
  return new Date(unixSeconds * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

// ---- DOM helpers ----------------------------------------------------------------------

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value != null) node.setAttribute(name, value);
  }
  if (text != null) node.textContent = text;
  return node;
}

function setField(name, value, text) {
  for (const node of document.querySelectorAll(`[data-field="${name}"]`)) {
    if (node.closest("table")) continue; // table cells are rebuilt with their rows
    node.textContent = text;
    node.dataset.value = value == null ? "" : String(value);
  }
}

function cell(field, value, text, cls) {
  return el("td", { "data-field": field, "data-value": value == null ? "" : String(value),
    class: cls }, text);
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// ---- the sections -----------------------------------------------------------------

function showCounters(status) {
  document.getElementById("version").textContent = status.version;
  document.getElementById("uptime").textContent = fmtDuration(status.uptime_s);
  document.getElementById("timeout").textContent = status.timeout_s + " s";
  for (const name of ["persisted", "completed", "pending", "replayed", "replay_queue",
    "retry_waiting", "dead_letters", "dead_lettered", "stored_records", "connections",
    "ingested", "ingest_duplicates"]) {
    setField(name, status[name], fmtInt(status[name]));
  }
  const failed = CAUSES.reduce((sum, c) => sum + (status.failed[c] || 0), 0);
  setField("failed_total", failed, fmtInt(failed));
  for (const cause of CAUSES) {
    setField("failed." + cause, status.failed[cause], fmtInt(status.failed[cause]));
  }
  const latency = status.complete_latency;
  setField("complete_latency.p50_s", latency.p50_s, fmtSeconds(latency.p50_s));
  setField("complete_latency.p99_s", latency.p99_s, fmtSeconds(latency.p99_s));
  setField("complete_latency.count", latency.count, fmtInt(latency.count));
  setField("lmdb_size_bytes", status.lmdb_size_bytes, fmtBytes(status.lmdb_size_bytes));
}

// The other shards' pages. A shard knows its place (STATUS shard, shards) but not the
// others' addresses, so the page takes them from its own URL: ?shards=URL0,URL1,...,
// every shard's page in shard order (as ft.address and `ftlayer status --server` list
// the shards), and each link carries the list on.
let shownShards = null;

function shardPages() {
  const given = new URLSearchParams(window.location.search).get("shards");
  if (!given) return [];
  return given.split(",").map((u) => u.trim()).filter((u) => /^https?:\/\//.test(u));
}

function showShards(status) {
  const pages = shardPages();
  const key = `${status.shard}/${status.shards}/${pages.join(",")}`;
  if (key === shownShards) return;
  shownShards = key;
  const nav = document.getElementById("shards");
  nav.dataset.shard = String(status.shard);
  nav.dataset.shards = String(status.shards);
  nav.hidden = status.shards <= 1;
  const parts = [el("span", { class: "place" }, `shard ${status.shard} of ${status.shards}`)];
  if (status.shards <= 1) {
    nav.replaceChildren(...parts);
    return;
  }
  if (pages.length !== status.shards) {
    parts.push(el("span", { class: "hint" }, ` · to link the other shards, open this page `
      + `with ?shards= and every shard's page (${status.shards} URLs, in shard order)`));
  } else {
    pages.forEach((page, i) => {
      if (i === status.shard) {
        parts.push(el("span", { class: "here", "data-shard": String(i) }, `shard ${i}`));
        return;
      }
      const url = new URL(page);
      url.searchParams.set("shards", pages.join(","));
      parts.push(el("a", { href: url.toString(), "data-shard": String(i) }, `shard ${i}`));
    });
  }
  nav.replaceChildren(...parts);
}

function showSources(status) {
  const ids = new Set([...Object.keys(status.by_source), ...Object.keys(status.pending_by_source),
    ...Object.keys(status.sources)]);
  const rows = [...ids].sort((a, b) => Number(a) - Number(b)).map((id) => {
    const figures = status.by_source[id] || { persisted: 0, completed: 0, failed: {},
      replayed: 0, dead_lettered: 0, replay_queue: 0, complete_latency: {} };
    const registration = status.sources[id];
    const failed = CAUSES.reduce((sum, c) => sum + (figures.failed[c] || 0), 0);
    const cursor = status.replay_cursors[id] ?? status.replay_cursor_at_start;
    const pending = status.pending_by_source[id] || 0;
    const latency = figures.complete_latency;
    const row = el("tr", { "data-source": id });
    row.append(
      // Its name (ft.sourceName, a receiver's --source) where it has one, and its id.
      el("td", { class: "text", "data-field": "name", "data-value": registration?.name ?? "" },
        registration?.name ? `${registration.name} (${id})` : id),
      el("td", { class: "text" }, registration ? registration.partitioner : "-"),
      cell("persisted", figures.persisted, fmtInt(figures.persisted)),
      cell("completed", figures.completed, fmtInt(figures.completed)),
      cell("failed", failed, fmtInt(failed)),
      cell("replayed", figures.replayed, fmtInt(figures.replayed)),
      cell("dead_lettered", figures.dead_lettered, fmtInt(figures.dead_lettered)),
      cell("pending", pending, fmtInt(pending)),
      cell("replay_queue", figures.replay_queue, fmtInt(figures.replay_queue)),
      cell("replay_cursor", cursor, fmtInt(cursor)),
      cell("p50_s", latency.p50_s, fmtSeconds(latency.p50_s)),
      cell("p99_s", latency.p99_s, fmtSeconds(latency.p99_s)),
    );
    row.cells[4].title = CAUSES.map((c) => `${c} ${fmtInt(figures.failed[c] || 0)}`).join(", ");
    return row;
  });
  replaceRows(document.querySelector("#sources tbody"), rows);
}

const CHECKPOINT_COLUMNS = [
  ["id", "id", fmtInt],
  ["state", "state", (v) => v],
  ["mode", "mode", (v) => v],
  ["pending", "pending_roots", fmtInt],
  ["size", "size_bytes", fmtBytes],
  ["copy", "copy_s", fmtSeconds],
  ["write", "write_s", fmtSeconds],
  ["alignment wait", "alignment_wait_s", fmtSeconds],
  ["total", "duration_s", fmtSeconds],
];

function showCheckpoints(status) {
  const holder = document.getElementById("checkpoints");
  const queries = Object.keys(status.checkpoints).sort();
  if (!queries.length) {
    holder.replaceChildren(el("p", { class: "empty" }, "no checkpoint yet"));
    return;
  }
  holder.replaceChildren(...queries.map((query) => {
    const found = status.checkpoints[query];
    const shown = [...found.recent.slice(-10), ...found.open];
    const longest = Math.max(1e-9, ...shown.map((c) => c.duration_s || 0));
    const box = el("div", { class: "query", "data-query": query });
    box.append(el("h3", null, `${query}: ${fmtInt(found.completed)} completed` +
      (found.last_complete_id == null ? "" : `, the last one #${found.last_complete_id}`)));
    const table = el("table");
    const head = el("tr");
    for (const [title, key] of CHECKPOINT_COLUMNS) {
      head.append(el("th", { class: key === "state" || key === "mode" ? "text" : null }, title));
    }
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    for (const checkpoint of shown) {
      const row = el("tr", { "data-id": String(checkpoint.id) });
      for (const [, key, format] of CHECKPOINT_COLUMNS) {
        const value = checkpoint[key];
        const td = cell(key, value, value == null ? "-" : format(value),
          key === "state" ? "text state-" + value : key === "mode" ? "text" : null);
        if (key === "duration_s" && value != null) {
          const bar = el("span", { class: "bar" });
          bar.style.width = Math.round(60 * value / longest) + "px";
          td.append(bar);
        }
        row.append(td);
      }
      table.tBodies[0].append(row);
    }
    box.append(table);
    return box;
  }));
}

function showDeadLetters(letters) {
  const rows = letters.rows.map((d) => {
    const row = el("tr", { "data-seq": String(d.seq) });
    row.append(
      cell("seq", d.seq, fmtInt(d.seq)),
      cell("source_id", d.source_id, String(d.source_id)),
      cell("topic", d.topic, d.topic, "text"),
      cell("partition", d.partition, String(d.partition)),
      cell("offset", d.offset, fmtInt(d.offset)),
      cell("attempts", d.attempts, fmtInt(d.attempts)),
      cell("cause", d.cause, d.cause || "-", "text"),
      cell("step", d.step, d.step || "-", "text"),
      cell("error", d.error, d.error || "-", "error"),
      cell("dead_at", d.dead_at, fmtClock(d.dead_at)),
    );
    row.cells[8].title = d.error || "";
    return row;
  });
  replaceRows(document.querySelector("#dead-letters tbody"), rows);
  const shown = document.getElementById("dead-shown");
  shown.textContent = letters.total > letters.rows.length
    ? `the oldest ${fmtInt(letters.rows.length)} of ${fmtInt(letters.total)}`
    : `${fmtInt(letters.total)} stored`;
  shown.dataset.value = String(letters.total);
}

// ---- the chart ----------------------------------------------------------------------

function niceMax(v) {
  // The axis top: four ticks of 1, 2, 2.5 or 5 times a power of ten.
  if (!(v > 0)) return 4;
  const step = v / 4;
  const p = Math.pow(10, Math.floor(Math.log10(step)));
  for (const m of [1, 2, 2.5, 5, 10]) {
    if (m * p >= step) return 4 * Math.max(m * p, 1);
  }
  return 40 * p;
}

function series() {
  const at = (name) => fields.indexOf(name);
  const [t, persisted, completed, failed, pending] =
    ["t", "persisted", "completed", "failed", "pending"].map(at);
  // Per second over the last RATE_WINDOW samples: micro-batches come every few seconds,
  // and per-sample rates would jump between 0 and a batch's burst.
  const rates = [];
  for (let i = 1; i < samples.length; i += 1) {
    const a = samples[Math.max(0, i - RATE_WINDOW)];
    const b = samples[i];
    const dt = b[t] - a[t];
    if (dt <= 0) continue;
    const rate = (k) => Math.max(0, (b[k] - a[k]) / dt); // 0 across a restart
    rates.push({ t: b[t], persisted: rate(persisted), completed: rate(completed),
      failed: rate(failed) });
  }
  return { rates, pending: samples.map((s) => ({ t: s[t], pending: s[pending] })) };
}

function drawChart() {
  const canvas = document.getElementById("chart");
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  canvas.dataset.samples = String(samples.length);
  const pad = { l: 70, r: 70, t: 14, b: 30 };
  const plotW = w - pad.l - pad.r;
  const plotH = h - pad.t - pad.b;
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue("--" + name).trim();
  const { rates, pending } = series();
  ctx.font = "12px system-ui, sans-serif";
  if (pending.length < 2) {
    ctx.fillStyle = color("muted");
    ctx.fillText("collecting samples ...", pad.l + 10, pad.t + 20);
    return;
  }
  const tMax = pending[pending.length - 1].t;
  const tMin = Math.max(pending[0].t, tMax - HISTORY_S);
  const x = (t) => pad.l + plotW * (t - tMin) / Math.max(1, tMax - tMin);
  const rateMax = niceMax(Math.max(...rates.map((r) => Math.max(r.persisted, r.completed,
    r.failed))));
  const pendingMax = niceMax(Math.max(...pending.map((p) => p.pending)));
  const yRate = (v) => pad.t + plotH * (1 - v / rateMax);
  const yPending = (v) => pad.t + plotH * (1 - v / pendingMax);

  ctx.strokeStyle = color("line");
  ctx.fillStyle = color("muted");
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const y = pad.t + plotH * i / 4;
    ctx.beginPath();
    ctx.moveTo(pad.l, y);
    ctx.lineTo(pad.l + plotW, y);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(fmtInt(Math.round(rateMax * (1 - i / 4))), pad.l - 8, y + 4);
    ctx.textAlign = "left";
    ctx.fillText(fmtInt(Math.round(pendingMax * (1 - i / 4))), pad.l + plotW + 8, y + 4);
  }
  const span = tMax - tMin;
  const step = [10, 30, 60, 120, 300].find((s) => span / s <= 8) || 600;
  ctx.textAlign = "center";
  for (let t = Math.ceil(tMin / step) * step; t <= tMax; t += step) {
    ctx.fillText(fmtClock(t), x(t), h - 10);
  }
  ctx.save();
  ctx.translate(14, pad.t + plotH / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText("records/s (5 s mean)", 0, 0);
  ctx.restore();

  const line = (points, key, y, name, dashed, width) => {
    ctx.strokeStyle = color(name);
    ctx.lineWidth = width;
    ctx.setLineDash(dashed ? [6, 4] : []);
    ctx.beginPath();
    points.filter((p) => p.t >= tMin).forEach((p, i) => {
      if (i === 0) ctx.moveTo(x(p.t), y(p[key]));
      else ctx.lineTo(x(p.t), y(p[key]));
    });
    ctx.stroke();
    ctx.setLineDash([]);
  };
  // Persisted under completed, wider: at a steady pace the two lines coincide.
  line(pending, "pending", yPending, "pending", true, 2);
  line(rates, "persisted", yRate, "persisted", false, 5);
  line(rates, "completed", yRate, "completed", false, 2);
  line(rates, "failed", yRate, "failed", false, 2);
}

// ---- polling ------------------------------------------------------------------------

function takeHistory(history) {
  fields = history.fields;
  if (history.rows.length) {
    samples.push(...history.rows);
    lastSample = history.rows[history.rows.length - 1][0];
    samples = samples.filter((s) => s[0] > lastSample - HISTORY_S);
  }
}

async function poll() {
  const live = document.getElementById("live");
  try {
    // From the origin, which has no user:token@ part: a URL relative to a page opened
    // with user:token@ in its URL would carry it, and fetch() refuses such a URL. The
    // browser still sends the credentials it loaded the page with (same origin).
    const url = new URL("/api/status", window.location.origin);
    if (lastSample != null) url.searchParams.set("since", String(lastSample));
    const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    takeHistory(data.history);
    showCounters(data.status);
    showShards(data.status);
    showSources(data.status);
    showCheckpoints(data.status);
    showDeadLetters(data.dead_letters);
    drawChart();
    live.className = "live ok";
    live.textContent = "live · " + fmtClock(data.now);
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (error) {
    live.className = "live stale";
    live.textContent = "no answer (" + error.message + "): retrying";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

window.addEventListener("resize", drawChart);
poll();
