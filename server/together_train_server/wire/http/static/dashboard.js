// together-train dashboard: polls /api/dashboard/state and renders tables and SVG line charts.
// Plain JavaScript, no dependencies (users run resources offline).
"use strict";

const KEY_STORE = "together-train-api-key";  // sessionStorage: asked once per browser tab
const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(250, 1000 * (parseFloat(params.get("interval")) || 2));
document.getElementById("interval").textContent = INTERVAL_MS / 1000;

const CHARTS = [
  ["loss_per_token", "loss per token", ""],
  ["grad_norm", "grad norm (pre-clip)", ""],
  ["learning_rate", "learning rate", ""],
  ["tokens_per_s", "trained tokens / s", ""],
  ["sampled_tokens_per_s", "sampled tokens / s", ""],
];

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return v.toPrecision(3);
}

function fmtDur(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function fmtBytes(b) {
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1000 && i < u.length - 1) { b /= 1000; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}

function rows(tableId, items, render, cols) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.innerHTML = items.length ? items.map(render).join("")
    : `<tr><td class="empty" colspan="${cols}">none</td></tr>`;
}

// One line chart as SVG: x = optimizer step, y = the metric; axes with min/max ticks and labels.
function chart(session, key, title, points) {
  const W = 300, H = 160, L = 52, R = 10, T = 18, B = 30;
  const pts = points.filter(p => p[key] !== null && p[key] !== undefined && Number.isFinite(p[key]));
  let body = `<text class="title" x="${L}" y="12">${esc(title)}</text>`;
  if (pts.length) {
    const xs = pts.map(p => p.step), ys = pts.map(p => p[key]);
    let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      const y = y0 + f * (y1 - y0);
      body += `<line class="grid" x1="${L}" x2="${W - R}" y1="${sy(y)}" y2="${sy(y)}"/>`;
      body += `<text x="${L - 4}" y="${sy(y) + 3}" text-anchor="end">${fmtNum(y)}</text>`;
    }
    for (const x of [x0, x1]) {
      body += `<text x="${sx(x)}" y="${H - B + 12}" text-anchor="middle">${Math.round(x)}</text>`;
    }
    const d = pts.map((p, i) => (i ? "L" : "M") + sx(p.step).toFixed(1) + " " + sy(p[key]).toFixed(1)).join(" ");
    body += `<path class="line" d="${d}" data-points="${pts.length}"/>`;
    if (pts.length < 40) body += pts.map(p => `<circle class="dot" r="2" cx="${sx(p.step)}" cy="${sy(p[key])}"/>`).join("");
  } else {
    body += `<text x="${W / 2}" y="${H / 2}" text-anchor="middle">no data yet</text>`;
  }
  body += `<line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/>`;
  body += `<line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`;
  body += `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">optimizer step</text>`;
  return `<svg class="chart" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" role="img" ` +
    `aria-label="${esc(title)} of ${esc(session)}" data-session="${esc(session)}" data-chart="${key}">${body}</svg>`;
}

function render(st) {
  const r = st.resource;
  document.getElementById("resource").innerHTML =
    `<b>${esc(r.model_id)}</b> · ${esc(r.mode)} · ${esc(r.dtype)} · trainer ${esc(r.trainer_backend)} · ` +
    `sessions <b>${r.active_sessions}</b>/${r.max_sessions} · replicas ${r.num_replicas} (${esc(r.generator_engine)}) · ` +
    `up ${fmtDur(r.uptime_s)} · trained <b>${st.totals.tokens_trained}</b> tokens, sampled <b>${st.totals.tokens_sampled}</b>` +
    ` · prompt cache <b>${st.totals.prompt_cache_hit_tokens}</b>/${st.totals.prompt_tokens} tokens` +
    (st.totals.prompt_tokens ? ` (${(100 * st.totals.prompt_cache_hit_tokens / st.totals.prompt_tokens).toFixed(1)} %)` : "");
  const now = st.now;
  rows("sessions", st.sessions, s => `<tr data-session="${esc(s.session_id)}">` +
    `<td>${esc(s.session_id)}</td><td>${esc(s.name) || "–"}</td><td class="${esc(s.state)}">${esc(s.state)}</td>` +
    `<td class="step">${s.step}</td><td>${s.synced_version}</td><td class="queued">${s.queue_depth}</td><td>${s.running}</td>` +
    `<td>${fmtDur(now - s.last_active_at)} ago</td>` +
    `<td>r=${s.lora.rank} α=${fmtNum(s.lora.alpha)} ${esc(s.lora.target_modules.join(","))}${s.lora.train_unembed ? " +unembed" : ""}</td>` +
    `<td>${s.last_sync ? `v${s.last_sync.version} → ${s.last_sync.replicas} replica(s), ${fmtBytes(s.last_sync.bytes)}, ${fmtDur(s.last_sync.seconds)}, ${fmtDur(now - s.last_sync.at)} ago` : "–"}</td></tr>`, 10);
  const curves = st.sessions.filter(s => s.state === "ACTIVE" || s.curve.length);
  document.getElementById("curves").innerHTML = curves.length ? curves.map(s =>
    `<div class="session" data-session="${esc(s.session_id)}"><h3>${esc(s.session_id)}${s.name ? " · " + esc(s.name) : ""} · step ${s.step}</h3>` +
    `<div class="charts">${CHARTS.map(([k, t]) => chart(s.session_id, k, t, s.curve)).join("")}</div></div>`).join("")
    : `<p class="empty">${st.authorized ? "no sessions yet" : "enter the API key to see your sessions"}</p>`;
  rows("pending", st.pending, p => `<tr><td>${esc(p.session)}</td><td>${esc(p.kind)}</td><td>${p.seq_id}</td>` +
    `<td class="${esc(p.status)}">${esc(p.status)}</td><td>${fmtDur(p.waiting_s)}</td><td>${p.running_s ? fmtDur(p.running_s) : "–"}</td></tr>`, 6);
  rows("recent", st.recent.slice(-20).reverse(), o => `<tr><td>${esc(o.session) || "–"}</td><td>${esc(o.kind)}</td>` +
    `<td>${o.seq_id >= 0 ? o.seq_id : "–"}</td><td class="${esc(o.status)}">${esc(o.status)}</td><td>${fmtDur(o.queue_s)}</td>` +
    `<td>${fmtDur(o.run_s)}</td><td>${o.tokens_trained || o.tokens_sampled || "–"}</td><td class="bad">${esc(o.error_code)}</td></tr>`, 8);
  rows("replicas", st.replicas, x => `<tr data-replica="${esc(x.replica_id)}"><td>${esc(x.replica_id)}</td><td>${esc(x.address) || "–"}</td>` +
    `<td class="${esc(x.state)}">${esc(x.state)}</td><td>${x.outstanding}</td><td>${x.restarts}</td>` +
    `<td>${Object.entries(x.versions).map(([k, v]) => esc(k) + "@v" + v).join(", ") || "–"}${x.hidden ? ` (+${x.hidden} other)` : ""}</td></tr>`, 6);
  const rs = st.rollout_store || {};
  document.getElementById("rollout-store").textContent = rs.max_rollouts ? `${rs.rollouts}/${rs.max_rollouts} kept, ` +
    `${fmtBytes(rs.bytes)} of ${fmtBytes(rs.max_bytes)}, ${rs.dropped} dropped` : "";
  rows("rollouts", st.rollouts || [], x => `<tr data-rollout="${esc(x.rollout_id)}"><td>${esc(x.rollout_id)}</td>` +
    `<td>${x.calls}</td><td>${x.sampled_tokens}</td><td>${fmtBytes(x.bytes)}</td><td>${fmtDur(now - x.updated)} ago</td></tr>`, 5);
  rows("usage", st.usage || [], u => `<tr data-key="${esc(u.key ? u.key.slice(0, 12) : "none")}">` +
    `<td>${esc(u.key ? u.key.slice(0, 12) : "none")}</td><td>${u.prefill_tokens}</td><td>${u.prefix_cache_tokens}</td>` +
    `<td>${u.sampled_tokens}</td><td class="trained">${u.trained_tokens}</td><td>${u.forward_tokens}</td>` +
    `<td>${u.optimizer_steps}</td><td>${fmtDur(u.trainer_seconds)}</td><td>${fmtDur(u.sampler_seconds)}</td>` +
    `<td>${fmtBytes(u.checkpoint_bytes)}</td></tr>`, 10);
  rows("checkpoints", st.checkpoints.slice().reverse(), c => `<tr><td>${esc(c.uri)}</td><td>${esc(c.kind)}${c.merged ? " (merged)" : ""}</td>` +
    `<td>${c.step}</td><td>${fmtBytes(c.bytes)}</td><td>${fmtDur(now - c.created_at)} ago</td></tr>`, 5);
}

async function poll() {
  const status = document.getElementById("status");
  const key = sessionStorage.getItem(KEY_STORE);
  try {
    const resp = await fetch("/api/dashboard/state", {headers: key ? {"X-API-Key": key} : {}, cache: "no-store"});
    if (resp.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      askKey("that key was refused");
    } else if (!resp.ok) {
      throw new Error("HTTP " + resp.status);
    } else {
      const st = await resp.json();
      if (st.auth_required && !st.authorized) askKey("");
      render(st);
      status.textContent = "updated " + new Date().toLocaleTimeString();
      status.className = "status";
    }
  } catch (err) {
    status.textContent = "resource unreachable (" + err.message + "); retrying";
    status.className = "status down";
  }
  setTimeout(poll, INTERVAL_MS);
}

function askKey(message) {
  const form = document.getElementById("keyform");
  form.hidden = false;
  document.getElementById("keyerror").textContent = message;
}

document.getElementById("keyform").addEventListener("submit", ev => {
  ev.preventDefault();
  const key = document.getElementById("apikey").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  document.getElementById("keyform").hidden = true;
  document.getElementById("apikey").value = "";
});

poll();
