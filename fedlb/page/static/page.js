// fedlb's live page: polls api/state every second and draws it. The figures go into the
// DOM too (the rounds table's data-* attributes hold rounds.jsonl's numbers as sent), so
// a test can read them back from a headless browser.
"use strict";
const COLORS = ["#2e7dd7", "#d1495b", "#00a36c", "#f3a712", "#7b3fc4", "#1b998b", "#8d6a9f", "#c05746"];
const charts = {};
let shown = -1;
let last = null;  // the state drawn

const el = (tag, attrs = {}, text = "") => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
};
const svg = (tag, attrs = {}) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
};
const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const raw = (v) => (v === null || v === undefined ? "" : String(v));
const ago = (t, now) => (t ? `${Math.max(0, Math.round(now - t))} s ago` : "–");

function chart(id, labels, data, yLabel) {
  // one uPlot per box, made again only when its series change (a silo joined)
  const box = document.getElementById(id);
  const key = labels.join("|");
  const width = Math.max(300, box.clientWidth || 600);
  if (!charts[id] || charts[id].key !== key) {
    if (charts[id]) charts[id].plot.destroy();
    const series = [{ label: labels[0] }].concat(labels.slice(1).map((label, i) => ({
      label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
      points: { show: true, size: 5 },
    })));
    const opts = {
      width, height: 170, series,
      scales: { x: { time: false } },
      axes: [{ label: labels[0], incrs: labels[0] === "round" ? [1, 2, 5, 10, 20, 50, 100] : undefined }, { label: yLabel }],
    };
    charts[id] = { key, plot: new uPlot(opts, data, box) };
  } else {
    charts[id].plot.setData(data);
  }
}

function drawHeader(state) {
  const run = state.run || {};
  document.getElementById("title").textContent = run.name || state.title;
  const bits = [];
  if (run.address) bits.push(`SuperLink ${run.address}`);
  if (run.num_silos) bits.push(`${run.num_silos} silos`);
  if (run.num_rounds) bits.push(`${run.num_rounds} rounds`);
  if (run.out_dir) bits.push(`results in ${run.out_dir}`);
  bits.push(`status: ${run.status || "waiting"}`);
  document.getElementById("run").textContent = bits.join(" · ");
  const cur = state.current;
  let text = cur.running ? `round ${cur.round} running` : (cur.last_round ? `ended after round ${cur.last_round}` : "waiting for the silos");
  const flight = cur.in_flight;
  if (cur.running && flight) {
    const done = Object.entries(flight.replied).map(([silo, s]) => `${silo} (${Number(s).toFixed(1)} s)`);
    text += `: replied ${done.join(", ") || "none yet"}; training ${flight.waiting.join(", ") || "none"}`;
  }
  if (cur.last_round) {
    text += `; round ${cur.last_round}: replied ${cur.replied.join(", ") || "none"}`;
    if (cur.failed.length) text += `; no update: ${cur.failed.join(", ")}`;
  }
  const cur_el = document.getElementById("current");
  cur_el.textContent = text;
  cur_el.dataset.round = raw(cur.round);
  cur_el.dataset.replied = cur.replied.join(",");
  cur_el.dataset.repliedSoFar = flight ? Object.keys(flight.replied).join(",") : "";
  cur_el.dataset.waiting = flight ? flight.waiting.join(",") : "";
}

function drawSilos(state) {
  const body = document.querySelector("#silos tbody");
  body.replaceChildren(...state.silos.map((s) => {
    const row = el("tr", { "data-silo": s.silo, "data-node": raw(s.node), "data-missed": String(s.missed), "data-last-round": raw(s.last_round) });
    row.append(el("td", {}, s.silo), el("td", {}, raw(s.node) || "–"), el("td", {}, s.device || "–"),
      el("td", {}, s.last_round ? `round ${s.last_round}, ${ago(s.last_seen, state.now)}` : "–"),
      el("td", s.missed ? { class: "missed" } : {}, s.missed ? `${s.missed} (${s.missed_rounds.join(", ")})` : "0"),
      el("td", {}, raw(s.next_batch_size) || "–"));
    return row;
  }));
}

function drawRoundsTable(rounds) {
  const body = document.querySelector("#rounds tbody");
  const silos = document.querySelector("#silo-rounds tbody");
  const fields = ["wall_s", "round_s", "ideal_s", "efficiency", "idle_fraction", "accuracy", "loss", "server_accuracy", "server_loss"];
  body.replaceChildren(...rounds.map((r) => {
    const attrs = { "data-round": String(r.round) };
    for (const f of fields) attrs["data-" + f.replace(/_/g, "-")] = raw(r[f]);
    const row = el("tr", attrs);
    row.append(el("td", {}, String(r.round)), el("td", {}, fmt(r.wall_s, 2)), el("td", {}, fmt(r.round_s, 2)),
      el("td", {}, fmt(r.ideal_s, 2)), el("td", {}, fmt(r.efficiency)),
      el("td", {}, r.idle_fraction === null ? "–" : `${Math.round(100 * r.idle_fraction)}%`),
      el("td", {}, fmt(r.accuracy)), el("td", {}, fmt(r.loss)), el("td", {}, fmt(r.server_accuracy)),
      el("td", {}, fmt(r.server_loss)), el("td", {}, String(r.silos.length)));
    return row;
  }));
  const siloFields = ["batch_size", "next_batch_size", "compute_s", "fixed_s", "round_s", "idle_s", "start_s", "wall_s"];
  silos.replaceChildren(...rounds.flatMap((r) => r.silos.map((s) => {
    const attrs = { "data-round": String(r.round), "data-silo": s.silo };
    for (const f of siloFields) attrs["data-" + f.replace(/_/g, "-")] = raw(s[f]);
    return el("tr", attrs);
  })));
}

function drawCharts(rounds) {
  const x = rounds.map((r) => r.round);
  const col = (f) => rounds.map((r) => r[f]);
  chart("chart-wall", ["round", "round wall s", "slowest busy s", "ideal T* s"], [x, col("wall_s"), col("round_s"), col("ideal_s")], "seconds");
  chart("chart-e", ["round", "E"], [x, col("efficiency")], "E");
  const labels = [...new Set(rounds.flatMap((r) => r.silos.map((s) => s.silo)))].sort();
  const bOf = (label) => rounds.map((r) => { const s = r.silos.find((q) => q.silo === label); return s ? s.batch_size : null; });
  chart("chart-b", ["round", ...labels.map((l) => `${l} B`)], [x, ...labels.map(bOf)], "B");
  chart("chart-acc", ["round", "server accuracy", "federated accuracy"], [x, col("server_accuracy"), col("accuracy")], "accuracy");
  chart("chart-loss", ["round", "server loss", "federated loss"], [x, col("server_loss"), col("loss")], "loss");
}

function drawTimeline(rounds) {
  const select = document.getElementById("timeline-round");
  const wanted = select.value === "" || Number(select.value) === Number(select.dataset.latest) ? null : Number(select.value);
  select.replaceChildren(...rounds.map((r) => el("option", { value: String(r.round) }, String(r.round))));
  const latest = rounds.length ? rounds[rounds.length - 1].round : null;
  select.dataset.latest = raw(latest);
  const round = rounds.find((r) => r.round === (wanted ?? latest));
  if (round) select.value = String(round.round);
  const box = document.getElementById("timeline");
  box.replaceChildren();
  if (!round || !round.silos.length) return;
  const v = (n) => (n === null || n === undefined ? 0 : n);
  const span = Math.max(...round.silos.map((s) => Math.max(v(s.wall_s), v(s.start_s) + v(s.compute_s) + v(s.fixed_s) + v(s.idle_s))), 1e-9);
  const width = Math.max(400, box.clientWidth || 600), left = 120, rowH = 26;
  const scale = (width - left - 20) / span;
  const picture = svg("svg", { width, height: rowH * round.silos.length + 24 });
  const slowest = Math.max(...round.silos.map((s) => v(s.round_s)));
  round.silos.forEach((s, i) => {
    const y = i * rowH + 4;
    const name = svg("text", { x: 0, y: y + 15, "font-size": 12 });
    name.textContent = s.silo + (v(s.round_s) === slowest ? " (slowest)" : "");
    picture.append(name);
    let at = 0;
    for (const [part, seconds] of [["start", s.start_s], ["compute", s.compute_s], ["fixed", s.fixed_s], ["idle", s.idle_s]]) {
      const w = v(seconds) * scale;
      const rect = svg("rect", { x: left + at, y, width: Math.max(0, w), height: rowH - 8, class: part });
      const tip = svg("title"); tip.textContent = `${s.silo} ${part}: ${fmt(seconds, 2)} s`;
      rect.append(tip); picture.append(rect); at += w;
    }
    if (s.wall_s !== null) picture.append(svg("line", { x1: left, x2: left + s.wall_s * scale, y1: y + rowH - 5, y2: y + rowH - 5, stroke: "#222", "stroke-width": 2 }));
  });
  const axis = svg("text", { x: left, y: rowH * round.silos.length + 20, "font-size": 11, fill: "#555" });
  axis.textContent = `0 … ${fmt(span, 2)} s; round ${round.round} wall ${fmt(round.wall_s, 2)} s, T* ${fmt(round.ideal_s, 2)} s`;
  picture.append(axis);
  box.append(picture);
}

function drawEvents(events) {
  const list = document.getElementById("events");
  list.replaceChildren(...(events.length ? events : [{ round: "", kind: "", text: "none yet" }]).map((e) =>
    el("li", { class: e.kind.replace(" ", "-") }, e.round === "" ? e.text : `round ${e.round}: ${e.kind === "event" ? "" : e.kind + ": "}${e.text}`)));
}

function drawPolicies(policies) {
  const names = Object.keys(policies);
  document.getElementById("policies-box").hidden = names.length === 0;
  if (!names.length) return;
  const tables = names.map((n) => [policies[n].map((p) => p[0]), policies[n].map((p) => p[1])]);
  const joined = tables.every((t) => t[0].length) ? uPlot.join(tables) : [[]].concat(names.map(() => []));
  chart("policies", ["clock s", ...names], joined, "accuracy");
}

function draw(state) {
  drawHeader(state);
  drawSilos(state);
  drawRoundsTable(state.rounds);
  drawCharts(state.rounds);
  drawTimeline(state.rounds);
  drawEvents(state.events);
  drawPolicies(state.policies);
  document.body.dataset.rounds = String(state.rounds.length);
  document.body.dataset.status = state.run.status || "waiting";
  document.body.dataset.version = String(state.version);
}

// A token-protected page: the printed address's ?token= was for its first request, whose
// answer set the page's cookie (HttpOnly: not readable here), which carries it from then
// on, to the scripts and to api/state. The token leaves the address bar and the history.
const opened = new URL(window.location.href);
if (opened.searchParams.has("token")) {
  opened.searchParams.delete("token");
  window.history.replaceState(null, "", opened.pathname + opened.search + opened.hash);
}

async function poll() {
  try {
    // since: the version drawn (unchanged: a tiny answer)
    const query = new URLSearchParams();
    if (last !== null) query.set("since", String(shown));
    const response = await fetch("api/state?" + query.toString(), { cache: "no-store", credentials: "same-origin" });
    if (response.status === 401) {
      // the token is not (or no longer) the page's: say why, keep what was drawn
      document.body.dataset.status = "refused";
      document.getElementById("current").textContent = (await response.text()).trim();
    } else if (response.ok) {
      const state = await response.json();
      if (state.unchanged && last !== null) {
        last.now = state.now;
        drawSilos(last);  // "last seen ... ago" moves on
      } else if (!state.unchanged) {
        draw(state); shown = state.version; last = state;
      }
    }
  } catch (error) {
    document.body.dataset.status = "unreachable";  // the run ended: keep what was drawn
  }
  setTimeout(poll, 1000);
}
document.getElementById("timeline-round").addEventListener("change", () => { if (last) drawTimeline(last.rounds); });
poll();
