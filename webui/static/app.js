// The page: a runs list, a start form generated from the config schema, and a live run view (server-sent events).
"use strict";
const $ = sel => document.querySelector(sel);
const el = (tag, attrs = {}, text) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
};
const fmt = (v, digits = 4) => v === null || v === undefined ? "-" : (typeof v === "number" ? Number(v.toPrecision(digits)).toString() : String(v));
const duration = s => s === null || s === undefined ? "-" : s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
// summary.json's peak_memory_gib: {"gpu_peak_allocated_gib": x, "host_peak_rss_gib": y, ...} shown as "gpu allocated x GiB, ..."
const peak = p => !p ? "-" : typeof p === "object" ? Object.entries(p).map(([k, v]) => `${k.replace(/_gib$/, "").replace(/_?peak_?/, " ").replace(/_/g, " ").trim()} ${fmt(v, 3)} GiB`).join(", ") : `${fmt(p, 3)} GiB`;
const fileUrl = (id, path) => `/api/runs/${encodeURIComponent(id)}/files/${path.split("/").map(encodeURIComponent).join("/")}`;

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const detail = data.detail || {};
    const error = new Error(typeof detail === "string" ? detail : (detail.message || response.statusText));
    error.errors = typeof detail === "object" && detail.errors ? detail.errors : [error.message];
    throw error;
  }
  return data;
}

// ---- runs list -----------------------------------------------------------------------------------
let listTimer = null;
async function showRuns() {
  const runs = await api("/api/runs");
  const body = $("#runs tbody");
  body.replaceChildren();
  $("#runs-empty").hidden = runs.length > 0;
  for (const r of runs) {
    const row = el("tr", {"data-run": r.id});
    const link = el("a", {href: `#/run/${encodeURIComponent(r.id)}`}, r.id);
    const files = el("a", {href: `#/run/${encodeURIComponent(r.id)}`}, r.weights ? "LoRA, samples, logs" : "samples, logs");
    const cells = [link, el("span", {class: `state ${r.state}`}, r.state), r.family, r.model,
      `${r.step} / ${r.max_steps ?? "?"}`, fmt(r.loss), fmt(r.loss_smoothed), fmt(r.s_per_step, 3), duration(r.eta_s),
      peak(r.peak_memory_gib), files];
    for (const c of cells) { const td = el("td"); c instanceof Node ? td.appendChild(c) : td.textContent = c ?? "-"; row.appendChild(td); }
    body.appendChild(row);
  }
}

// ---- start form ----------------------------------------------------------------------------------
let schema = null, yamlValues = {};
async function showStart() {
  if (!schema) {
    schema = await api("/api/schema");
    for (const e of schema.entries) $("#entry").appendChild(el("option", {value: e.name, title: e.description}, `${e.name} (${e.family})`));
    for (const name of await api("/api/profiles")) $("#profile").appendChild(el("option", {value: name}, name));
    buildForm();
  }
}

function buildForm() {
  const form = $("#form");
  const sections = {};
  for (const f of schema.fields) {
    const section = f.section || "general";
    if (!sections[section]) {
      const fs = el("fieldset");
      fs.appendChild(el("legend", {}, section));
      sections[section] = fs;
      form.appendChild(fs);
    }
    const wrap = el("label", {class: "field", title: [f.help, f.choices && f.kind === "yaml" ? `each one of ${f.choices.join(", ")}` : ""].filter(Boolean).join("; ")});
    wrap.appendChild(el("span", {}, f.key));
    let input;
    if (f.kind === "choice" || f.kind === "boolean") {
      input = el("select");
      const options = f.kind === "boolean" ? ["true", "false"] : f.choices;
      if (f.optional) input.appendChild(el("option", {value: ""}, "(null: auto/off)"));
      for (const o of options) input.appendChild(el("option", {value: o}, o));
    } else if (f.kind === "yaml") {
      input = el("textarea", {rows: 1, spellcheck: "false", placeholder: "YAML, e.g. [a, b]"});
    } else {
      input = el("input", {type: "text", placeholder: f.optional ? "null" : ""});
    }
    input.dataset.key = f.key;
    input.addEventListener("input", () => wrap.classList.toggle("changed", fieldChanged(input)));
    wrap.appendChild(input);
    sections[section].appendChild(wrap);
  }
  fillForm();
}

const fieldOf = key => schema.fields.find(f => f.key === key);
const baseValue = key => key in yamlValues ? yamlValues[key] : fieldOf(key).default;
const fieldChanged = input => (input.value || null) !== (baseValue(input.dataset.key) || null);  // "" and null alike

function fillForm() {
  for (const input of document.querySelectorAll("#form [data-key]")) {
    input.value = baseValue(input.dataset.key) ?? "";
    input.parentElement.classList.remove("changed");
  }
}

async function loadForm() {
  $("#errors").replaceChildren();
  try {
    yamlValues = (await api("/api/form", {config: $("#yaml").value})).values;
    fillForm();
  } catch (error) { showErrors(error.errors); }
}

function formEdits() {
  const edits = {};
  for (const input of document.querySelectorAll("#form [data-key]")) {
    if (fieldChanged(input)) edits[input.dataset.key] = input.value === "" && fieldOf(input.dataset.key).optional ? null : input.value;
  }
  return edits;
}

function request() {
  return {config: $("#yaml").value, entry: $("#entry").value, form: formEdits(), name: $("#run-name").value || null,
          gpu_memory: $("#gpu-memory").value || null};
}

function showErrors(errors) {
  const list = $("#errors");
  list.replaceChildren(...errors.map(e => el("li", {}, e)));
}

async function checkAndPlan() {
  showErrors([]);
  $("#launch").hidden = true;
  $("#plan").hidden = false;
  $("#plan").textContent = "checking the config and running --plan ...";
  try {
    const plan = await api("/api/plan", request());
    $("#plan").textContent = plan.output || "(no output)";
    $("#launch").hidden = false;  // a plan that does not fit is shown, and launching stays the user's call
  } catch (error) { $("#plan").hidden = true; showErrors(error.errors); }
}

async function launchRun() {
  try {
    const {id} = await api("/api/runs", request());
    location.hash = `#/run/${encodeURIComponent(id)}`;
  } catch (error) { showErrors(error.errors); }
}

// ---- one run -------------------------------------------------------------------------------------
let source = null, metrics = [], drawn = {};
function showRun(id) {
  metrics = [];
  drawn = {};
  $("#run-id").textContent = id;
  for (const sel of ["#samples", "#checkpoints", "#memory", "#log", "#launcher-log", "#config", "#artefacts", "#message"]) $(sel).replaceChildren();
  source = new EventSource(`/api/runs/${encodeURIComponent(id)}/events`);
  source.onmessage = event => updateRun(JSON.parse(event.data));
}

function updateRun(r) {
  metrics = metrics.slice(0, r.metrics_from).concat(r.metrics);
  $("#state").textContent = r.state;
  $("#state").className = `state ${r.state}`;
  $("#step").textContent = `step ${r.step} / ${r.max_steps ?? "?"}`;
  $("#loss").textContent = fmt(r.loss);
  $("#loss-smoothed").textContent = fmt(r.loss_smoothed);
  $("#speed").textContent = fmt(r.s_per_step, 3);
  $("#eta").textContent = duration(r.eta_s);
  $("#message").textContent = r.message || "";
  $("#stop").disabled = r.state !== "running" || r.stopping;  // a second SIGTERM would exit without the checkpoint
  $("#stop").textContent = r.stopping ? "Stopping: writing the checkpoint" : "Stop (checkpoint and exit)";
  $("#resume").disabled = r.state === "running" || !r.checkpoints.length;
  $("#download").hidden = !r.weights;
  if (r.weights) $("#download").href = fileUrl(r.id, r.weights);
  drawPlots();
  once("samples", r.samples, () => drawSamples(r));  // images and open details stay as they are between events
  $("#checkpoints").replaceChildren(...r.checkpoints.map(c => el("li", {}, c)));
  once("memory", [r.plan, r.peak_memory_gib], () => drawMemory(r));
  $("#log").textContent = r.log;
  $("#launcher-log").textContent = r.launcher_log;
  $("#config").textContent = JSON.stringify(r.config, null, 2);
  $("#artefacts").replaceChildren(...r.artefacts.map(name => { const li = el("li"); li.appendChild(el("a", {href: fileUrl(r.id, name)}, name)); return li; }));
}

function once(part, data, draw) {
  const key = JSON.stringify(data);
  if (drawn[part] !== key) { drawn[part] = key; draw(); }
}

function drawPlots() {
  const loss = {loss: metrics.filter(m => typeof m.loss === "number").map(m => [m.step, m.loss])};
  loss.smoothed = smoothSeries(loss.loss);
  const keys = new Set(metrics.flatMap(m => Object.keys(m).filter(k => k.startsWith("loss/"))));
  for (const key of keys) loss[key.slice(5)] = metrics.filter(m => typeof m[key] === "number").map(m => [m.step, m[key]]);
  plotLines($("#loss-plot"), loss);
  plotLines($("#lr-plot"), {lr: metrics.filter(m => typeof m.lr === "number").map(m => [m.step, m.lr])});
}

function drawSamples(r) {
  const base = r.samples.find(s => s.step === 0);
  const rows = r.samples.filter(s => s.step !== 0 || r.samples.length === 1);
  const box = $("#samples");
  box.replaceChildren(...rows.map(s => {
    const row = el("div", {class: "samples-row", "data-step": s.step});
    const cell = (path, caption) => { const f = el("figure"); f.appendChild(el("img", {src: fileUrl(r.id, path), alt: caption})); f.appendChild(el("figcaption", {}, caption)); return f; };
    if (base && s.step !== 0) base.files.forEach((p, i) => row.appendChild(cell(p, `base, prompt ${i}`)));
    s.files.forEach((p, i) => row.appendChild(cell(p, `step ${s.step}, prompt ${i}`)));
    return row;
  }));
}

function drawMemory(r) {
  const box = $("#memory");
  box.replaceChildren();
  const planned = r.plan && (r.plan.output || "").split("\n").find(line => line.startsWith("GPU peak"));
  box.appendChild(el("p", {id: "planned-peak"}, `plan: ${planned || "no plan was made when this run was started"}`));
  box.appendChild(el("p", {id: "measured-peak"}, `measured: ${r.peak_memory_gib ? peak(r.peak_memory_gib) : "at the end of the run (summary.json)"}`));
  if (r.plan) { const d = el("details"); d.appendChild(el("summary", {}, "the whole plan")); d.appendChild(el("pre", {}, r.plan.output)); box.appendChild(d); }
}

// ---- routing -------------------------------------------------------------------------------------
async function route() {
  if (source) { source.close(); source = null; }
  clearInterval(listTimer);
  const hash = location.hash || "#/";
  for (const view of ["runs", "start", "run"]) $(`#view-${view}`).hidden = true;
  if (hash.startsWith("#/run/")) {
    $("#view-run").hidden = false;
    showRun(decodeURIComponent(hash.slice(6)));
  } else if (hash === "#/start") {
    $("#view-start").hidden = false;
    await showStart();
  } else {
    $("#view-runs").hidden = false;
    await showRuns();
    listTimer = setInterval(showRuns, 2000);
  }
}

$("#profile").addEventListener("change", async () => {
  const name = $("#profile").value;
  if (!name) return;
  $("#yaml").value = (await api(`/api/profiles/${encodeURIComponent(name)}`)).text;
  await loadForm();
});
$("#upload").addEventListener("change", async () => {
  const file = $("#upload").files[0];
  if (file) { $("#yaml").value = await file.text(); await loadForm(); }
});
$("#load-form").addEventListener("click", loadForm);
$("#check").addEventListener("click", checkAndPlan);
$("#launch").addEventListener("click", launchRun);
$("#stop").addEventListener("click", () => ($("#stop").disabled = true) && api(`/api/runs/${encodeURIComponent($("#run-id").textContent)}/stop`, {}).catch(e => alert(e.message)));
$("#resume").addEventListener("click", () => api(`/api/runs/${encodeURIComponent($("#run-id").textContent)}/resume`, {}).then(() => route()).catch(e => alert(e.message)));
window.addEventListener("hashchange", route);
route();
