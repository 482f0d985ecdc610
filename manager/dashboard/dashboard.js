// The varuna-manager dashboard: polls the read-only JSON API and draws it with plotly.js.
// Everything users chose (job names, event messages) is written as text, never as HTML.
"use strict";

const POLL_MS = 2000;
const state = { jobId: decodeURIComponent(location.hash.slice(1)), renders: 0 };
const el = (id) => document.getElementById(id);

function text(node, value) { node.textContent = value === undefined || value === null ? "" : String(value); }

function when(t) { return new Date(t * 1000); }

function clock(t) { return when(t).toLocaleTimeString([], { hour12: false }); }

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401) {
    throw new Error("not authorized: open this page once as /?token=<the manager's token>");
  }
  if (!response.ok) { throw new Error(`${path}: HTTP ${response.status}`); }
  return response.json();
}

function showProblem(message) {
  const p = el("problem");
  text(p, message);
  p.hidden = !message;
}

function fillJobs(jobs) {
  const select = el("job-select");
  if (!state.jobId && jobs.length) { state.jobId = jobs[jobs.length - 1].job_id; }
  const wanted = jobs.map((j) => `${j.job_id}|${j.state}`).join(",");
  if (select.dataset.jobs === wanted) { return; }
  select.dataset.jobs = wanted;
  select.replaceChildren(...jobs.map((j) => {
    const option = document.createElement("option");
    option.value = j.job_id;
    text(option, `${j.name} (${j.job_id}) [${j.state}]`);
    option.selected = j.job_id === state.jobId;
    return option;
  }));
}

function fillSummary(job) {
  text(el("job-name"), job.name);
  text(el("job-id"), job.job_id);
  text(el("job-state"), job.state);
  text(el("job-step"), `${job.step} / ${job.target_steps}`);
  text(el("pxd"), job.pxd ? `${job.pxd} (P=${job.P}, D=${job.D}${job.micro_batch_size ? `, m=${job.micro_batch_size}` : ""})` : "not launched");
  text(el("job-generation"), job.generation ? `${job.generation} (${job.generation_state})` : "-");
  text(el("job-message"), job.message);
}

function row(cells, className) {
  const tr = document.createElement("tr");
  if (className) { tr.className = className; }
  for (const [value, cellClass] of cells) {
    const td = document.createElement("td");
    if (cellClass) { td.className = cellClass; }
    text(td, value);
    tr.appendChild(td);
  }
  return tr;
}

function fillTables(data) {
  el("vms").tBodies[0].replaceChildren(...data.vms.map((vm) => row([
    [vm.vm_id], [vm.type], [vm.state], [vm.slow ? "slow (excluded)" : vm.health, `health-${vm.health}`],
    [vm.heartbeat_age_s === null ? "never" : `${vm.heartbeat_age_s.toFixed(1)} s ago`],
    [vm.in_generation ? "yes" : "-"], [vm.detail],
  ], vm.slow ? "slow" : vm.state)));
  el("events").tBodies[0].replaceChildren(...data.events.map((e) => row([
    [clock(e.time)], [e.generation ? `g${e.generation}` : "-"], [e.kind], [e.vm_id], [e.message],
  ], `event-${e.kind}`)));
}

function morphLines(morphs) {
  return morphs.map((m) => ({
    type: "line", xref: "x", yref: "paper", x0: when(m.time), x1: when(m.time), y0: 0, y1: 1,
    line: { color: "#b00020", width: 1.5, dash: "dot" },
  }));
}

const LAYOUT = { margin: { l: 55, r: 15, t: 35, b: 40 }, uirevision: "keep", showlegend: false };
const CONFIG = { displayModeBar: false, responsive: true };
const title = (words) => ({ text: words, x: 0.01, xanchor: "left", font: { size: 13 } });

function pxdChart(data) {
  // One horizontal segment per generation at its P·D, from its launch to its end (or now).
  const x = [], y = [], hover = [];
  for (const g of data.generations) {
    const end = g.ended || (data.job.state === "running" || data.job.state === "stopping" ? data.now : g.launched);
    x.push(when(g.launched), when(end), null);
    y.push(g.P * g.D, g.P * g.D, null);
    const label = `generation ${g.generation}: P×D = ${g.pxd}`;
    hover.push(label, label, "");
  }
  // Staggered in three rows: morphs seconds apart would print over each other.
  const annotations = data.morphs.map((m, i) => ({
    x: when(m.time), y: 1, xref: "x", yref: "paper", yanchor: "bottom", showarrow: false, yshift: 13 * (i % 3),
    text: `morph ${m.from}→${m.to}`, font: { color: "#b00020", size: 11 },
    hovertext: `${m.reason}${m.latency_s != null ? ` (latency ${m.latency_s.toFixed(1)} s)` : ""}`,
  }));
  return Plotly.react(el("pxd-chart"), [{
    x, y, text: hover, hoverinfo: "text+x", mode: "lines", line: { width: 4, color: "#243447" },
  }], {
    ...LAYOUT, margin: { ...LAYOUT.margin, t: 70 }, title: title("P×D over time (workers = P·D; dotted: morphs)"),
    yaxis: { title: { text: "workers" }, rangemode: "tozero", dtick: 1 },
    shapes: morphLines(data.morphs), annotations,
  }, CONFIG);
}

function seriesChart(id, data, field, heading, axis) {
  const points = data.progress;
  return Plotly.react(el(id), [{
    x: points.map((p) => when(p.time)), y: points.map((p) => p[field]),
    text: points.map((p) => `step ${p.step}, g${p.generation}, P×D ${p.pxd}` +
                     (p.mfu == null ? "" : `, MFU ${(100 * p.mfu).toFixed(1)}%`)),
    mode: "lines+markers", marker: { size: 4 }, line: { width: 1.5 }, connectgaps: false,
  }], {
    ...LAYOUT, title: title(heading), yaxis: { title: { text: axis } },
    shapes: morphLines(data.morphs),
  }, CONFIG);
}

function ganttChart(data) {
  const g = data.gantt;
  if (!g) {
    return Plotly.react(el("gantt-chart"), [], {
      ...LAYOUT, title: title("Gantt: waiting for every stage to report a step"),
    }, CONFIG);
  }
  const ops = Object.keys(g.colors).filter((op) => g.bars.some((b) => b.op === op));
  const traces = ops.map((op) => {
    const bars = g.bars.filter((b) => b.op === op);
    return {
      type: "bar", orientation: "h", name: op, marker: { color: g.colors[op] },
      y: bars.map((b) => `stage ${b.stage}`), base: bars.map((b) => b.start_s * 1e3),
      x: bars.map((b) => (b.end_s - b.start_s) * 1e3),
      text: bars.map((b) => (b.microbatch === null ? "" : String(b.microbatch))),
      textposition: "inside", insidetextanchor: "middle",
      hovertemplate: `${op} %{text} %{base:.1f}–%{x:.1f} ms<extra></extra>`,
    };
  });
  const meta = g.metadata;
  return Plotly.react(el("gantt-chart"), traces, {
    ...LAYOUT, showlegend: true, barmode: "overlay", legend: { orientation: "h", y: -0.2 },
    title: title(`Gantt of generation ${g.generation} (${g.pxd}, m=${meta.m}, Nm=${meta.Nm}, ${meta.schedule}),` +
      " replayed from its measured stage times"),
    xaxis: { title: { text: "ms into the mini-batch" } },
    yaxis: { autorange: "reversed" },
  }, CONFIG);
}

async function refresh() {
  try {
    const { jobs } = await getJSON("/api/jobs");
    fillJobs(jobs);
    if (!state.jobId) {
      showProblem("no jobs yet: submit one with varuna-manager submit");
      return;
    }
    const data = await getJSON(`/api/jobs/${encodeURIComponent(state.jobId)}`);
    fillSummary(data.job);
    fillTables(data);
    await Promise.all([
      pxdChart(data),
      seriesChart("throughput-chart", data, "samples_per_s", "throughput (dotted: morphs)", "samples/s"),
      seriesChart("loss-chart", data, "loss", "loss", "loss"),
      seriesChart("tflops-chart", data, "tflops", "model TFLOP/s per device (needs the calibration's FLOP count)",
                  "TFLOP/s"),
      ganttChart(data),
    ]);
    state.renders += 1;
    // What a test waits for: the job drawn, how many times, with how many morphs.
    document.body.dataset.job = state.jobId;
    document.body.dataset.morphs = String(data.morphs.length);
    document.body.dataset.renders = String(state.renders);
    showProblem("");
    text(el("updated"), `updated ${clock(data.now)}`);
  } catch (err) {
    showProblem(String(err.message || err));
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

el("job-select").addEventListener("change", (event) => {
  state.jobId = event.target.value;
  location.hash = encodeURIComponent(state.jobId);
  refresh();
});
loop();
