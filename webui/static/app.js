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
const when = t => !t ? "-" : new Date(t * 1000).toLocaleString([], {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit"});
const bytes = n => n < 2 ** 20 ? `${(n / 1024).toFixed(0)} KiB` : n < 2 ** 30 ? `${(n / 2 ** 20).toFixed(1)} MiB` : `${(n / 2 ** 30).toFixed(2)} GiB`;
// summary.json's peak_memory_gib: {"gpu_peak_allocated_gib": x, "host_peak_rss_gib": y, ...} shown as "gpu allocated x GiB, ..."
const peak = p => !p ? "-" : typeof p === "object" ? Object.entries(p).map(([k, v]) => `${k.replace(/_gib$/, "").replace(/_?peak_?/, " ").replace(/_/g, " ").trim()} ${fmt(v, 3)} GiB`).join(", ") : `${fmt(p, 3)} GiB`;
const enc = encodeURIComponent;
const fileUrl = (id, path) => `/api/runs/${enc(id)}/files/${path.split("/").map(enc).join("/")}`;
const ACTIVE = ["queued", "starting", "running"];

async function api(path, body, method) {
  const options = body === undefined && !method ? {} : {method: method || "POST", headers: {"Content-Type": "application/json"},
                                                        body: body === undefined ? undefined : JSON.stringify(body)};
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const detail = data.detail || {};
    const error = new Error(typeof detail === "string" ? detail : (detail.message || response.statusText).replace(/^error: /, ""));
    error.errors = typeof detail === "object" && detail.errors ? detail.errors : [error.message];
    error.status = response.status;
    error.replaceable = typeof detail === "object" && detail.replaceable;
    throw error;
  }
  return data;
}

// ---- runs list -----------------------------------------------------------------------------------
// Polled every 2 s after each answer (never while one is outstanding: with many runs an answer can
// take longer than the period). `listPoll` counts route changes, so a poll of an earlier visit stops.
let listTimer = null, listPoll = 0;
async function pollRuns(poll) {
  try { await showRuns(); } catch (error) { /* the server restarting: the next poll tries again */ }
  if (poll === listPoll) listTimer = setTimeout(() => pollRuns(poll), 2000);
}

async function showRuns() {
  const runs = await api("/api/runs");
  const body = $("#runs tbody");
  body.replaceChildren();
  $("#runs-empty").hidden = runs.length > 0;
  for (const r of runs) {
    const row = el("tr", {"data-run": r.id});
    const link = el("a", {href: `#/run/${enc(r.id)}`}, r.id);
    const outputs = [r.weights ? "LoRA" : "", r.checkpoints.length ? `${r.checkpoints.length} checkpoint(s)` : "",
                     r.samples_count ? `${r.samples_count} sample(s)` : ""].filter(Boolean).join(", ") || "-";
    let action = "";
    if (r.state === "queued") {
      action = el("button", {class: "cancel"}, "Cancel");
      action.addEventListener("click", () => api(`/api/runs/${enc(r.id)}/cancel`, {}).then(showRuns).catch(e => alert(e.message)));
    }
    const cells = [link, el("span", {class: `state ${r.state}`}, r.state), r.model,
      `${r.step} / ${r.max_steps ?? "?"}`, fmt(r.loss), fmt(r.loss_smoothed), fmt(r.s_per_step, 3),
      when(r.started), duration(r.duration_s), duration(r.eta_s), peak(r.peak_memory_gib), outputs, action];
    cells.forEach((c, i) => {
      const td = el("td", {class: `col-${["id", "state", "model", "step", "loss", "smoothed", "speed", "started",
                                          "duration", "eta", "peak", "outputs", "action"][i]}`});
      c instanceof Node ? td.appendChild(c) : td.textContent = c ?? "-";
      row.appendChild(td);
    });
    body.appendChild(row);
  }
}

// ---- start form ----------------------------------------------------------------------------------
let schema = null, yamlValues = {};
async function showStart(query) {
  if (!schema) {
    schema = await api("/api/schema");
    for (const e of schema.entries) $("#entry").appendChild(el("option", {value: e.name, title: e.description}, `${e.name} (${e.family})`));
    for (const name of await api("/api/profiles")) $("#profile").appendChild(el("option", {value: name}, name));
    buildForm();
  }
  $("#clone-note").hidden = true;
  const clone = query.get("clone");
  if (clone) await cloneRun(clone);
}

function buildForm() {
  const common = $("#form-common"), advanced = $("#form");
  const sections = {};
  const ordered = schema.fields.filter(f => f.common).sort((a, b) => a.order - b.order);  // the essentials first
  for (const f of [...ordered, ...schema.fields.filter(f => !f.common)]) {
    let parent = common;
    if (!f.common) {
      const section = f.section || "general";
      if (!sections[section]) {
        const fs = el("fieldset");
        fs.appendChild(el("legend", {}, section));
        sections[section] = fs;
        advanced.appendChild(fs);
      }
      parent = sections[section];
    }
    parent.appendChild(fieldElement(f));
  }
  fillForm();
}

function fieldElement(f) {
  const wrap = el("label", {class: `field${f.kind === "yaml" && f.common ? " wide" : ""}`});
  wrap.appendChild(el("span", {class: "name"}, f.label));
  if (f.label !== f.key) wrap.appendChild(el("span", {class: "key"}, f.key));
  let input;
  if (f.kind === "choice" || f.kind === "boolean") {
    input = el("select");
    const options = f.kind === "boolean" ? ["true", "false"] : f.choices;
    if (f.optional) input.appendChild(el("option", {value: ""}, "(null: auto/off)"));
    for (const o of options) input.appendChild(el("option", {value: o}, o));
  } else if (f.kind === "yaml") {
    input = el("textarea", {rows: f.common ? 3 : 1, spellcheck: "false", placeholder: f.key === "validation.prompts" ? '["a photo of ohwx", "ohwx in the snow"]' : "YAML, e.g. [a, b]"});
  } else {
    input = el("input", {type: "text", placeholder: f.optional ? "null" : ""});
  }
  input.dataset.key = f.key;
  input.addEventListener("input", () => wrap.classList.toggle("changed", fieldChanged(input)));
  wrap.appendChild(input);
  const help = [f.help, f.choices && f.kind === "yaml" ? `each one of ${f.choices.join(", ")}` : ""].filter(Boolean).join("; ");
  if (help) wrap.appendChild(el("span", {class: "help", title: help}, help));
  return wrap;
}

const fieldOf = key => schema.fields.find(f => f.key === key);
const baseValue = key => key in yamlValues ? yamlValues[key] : fieldOf(key).default;
const fieldChanged = input => (input.value || null) !== (baseValue(input.dataset.key) || null);  // "" and null alike

function fillForm(edits = {}) {
  for (const input of document.querySelectorAll(".form [data-key]")) {
    const key = input.dataset.key;
    input.value = (key in edits ? edits[key] : baseValue(key)) ?? "";
    input.closest(".field").classList.toggle("changed", fieldChanged(input));
  }
}

async function loadForm(edits = {}) {
  $("#errors").replaceChildren();
  try {
    const form = await api("/api/form", {config: $("#yaml").value});
    yamlValues = form.values;
    fillForm(edits);
    selectEntry(form.family);
  } catch (error) { showErrors(error.errors); }
}

// The entry script of the YAML's family (its `family:`, else its model's pipeline), unless the chosen one is of it.
function selectEntry(family) {
  const ofFamily = schema.entries.filter(e => e.family === family).map(e => e.name);
  if (ofFamily.length && !ofFamily.includes($("#entry").value)) $("#entry").value = ofFamily[0];
}

async function cloneRun(id) {
  try {
    const launched = await api(`/api/runs/${enc(id)}/launch`);
    $("#yaml").value = launched.config;
    $("#profile").value = "";
    if ([...$("#entry").options].some(o => o.value === launched.entry)) $("#entry").value = launched.entry;
    $("#run-name").value = launched.name;  // <source>-2: a clone is named after the run it copies
    await loadForm(launched.values);
    $("#clone-note").textContent = `A new run like '${id}': its YAML and the settings it changed are filled in.`;
    $("#clone-note").hidden = false;
  } catch (error) { showErrors(error.errors); }
}

function formEdits() {
  const edits = {};
  for (const input of document.querySelectorAll(".form [data-key]")) {
    if (fieldChanged(input)) edits[input.dataset.key] = input.value === "" && fieldOf(input.dataset.key).optional ? null : input.value;
  }
  return edits;
}

function request() {
  return {config: $("#yaml").value, entry: $("#entry").value, form: formEdits(), name: $("#run-name").value.trim() || null,
          gpu_memory: $("#gpu-memory").value.trim() || null};
}

function showErrors(errors) {
  $("#errors").replaceChildren(...(errors || []).map(e => el("li", {}, e)));
}

async function checkAndPlan() {
  showErrors([]);
  $("#plan").hidden = false;
  $("#plan").textContent = "checking the config and running --plan ...";
  try {
    const plan = await api("/api/plan", request());
    $("#plan").textContent = plan.output || "(no output)";
  } catch (error) { $("#plan").hidden = true; showErrors(error.errors); }
}

async function launchRun() {
  showErrors([]);
  const body = request();
  $("#launch").disabled = true;
  try {
    let started;
    try {
      started = await api("/api/runs", body);
    } catch (error) {
      const ask = `A run named '${body.name}' exists. Replace it? Its checkpoints, samples and weights are deleted.`;
      if (!(error.status === 409 && error.replaceable && confirm(ask))) throw error;
      started = await api("/api/runs", {...body, replace: true});
    }
    location.hash = `#/run/${enc(started.id)}`;
  } catch (error) { showErrors(error.errors); } finally { $("#launch").disabled = false; }
}

// ---- one run -------------------------------------------------------------------------------------
let source = null, metrics = [], drawn = {}, current = null;
async function showRun(id) {
  metrics = [];
  drawn = {};
  current = null;
  $("#run-id").textContent = id;
  $("#state").textContent = "";
  $("#dataset-box").open = false;
  for (const sel of ["#samples", "#checkpoints tbody", "#memory", "#log", "#launcher-log", "#config", "#artefacts", "#message", "#dataset"]) $(sel).replaceChildren();
  try {
    updateRun({...(await api(`/api/runs/${enc(id)}`)), metrics_from: 0});
  } catch (error) {
    $("#message").textContent = error.message;
    for (const b of document.querySelectorAll("#view-run .actions button")) b.disabled = true;
    return;
  }
  source = new EventSource(`/api/runs/${enc(id)}/events`);
  source.onmessage = event => updateRun(JSON.parse(event.data));
}

function updateRun(r) {
  current = r;
  metrics = metrics.slice(0, r.metrics_from).concat(r.metrics);
  $("#state").textContent = r.state;
  $("#state").className = `state ${r.state}`;
  $("#step").textContent = `step ${r.step} / ${r.max_steps ?? "?"}`;
  $("#loss").textContent = fmt(r.loss);
  $("#loss-smoothed").textContent = fmt(r.loss_smoothed);
  $("#speed").textContent = fmt(r.s_per_step, 3);
  $("#eta").textContent = duration(r.eta_s);
  $("#started").textContent = when(r.started);
  $("#duration").textContent = duration(r.duration_s);
  $("#message").textContent = r.state === "queued" ? "waiting for a free slot (the runs before it end first)" : (r.message || "");
  const live = r.state === "starting" || r.state === "running";
  $("#stop").disabled = !live || r.stopping;  // a second SIGTERM would exit without the checkpoint
  $("#stop").textContent = r.stopping ? "Stopping: writing the checkpoint" : "Stop (checkpoint and exit)";
  $("#resume").disabled = ACTIVE.includes(r.state) || !r.checkpoints.length;
  $("#cancel").hidden = r.state !== "queued";
  $("#delete").disabled = ACTIVE.includes(r.state);
  $("#clone").disabled = false;
  const steps = $("#resume-steps");
  if (document.activeElement !== steps && (!steps.dataset.run || steps.dataset.run !== r.id || !steps.value)) {
    steps.value = r.max_steps ?? "";
    steps.dataset.run = r.id;
  }
  $("#download").hidden = !r.weights;
  if (r.weights) $("#download").href = fileUrl(r.id, r.weights);
  drawPlots();
  once("samples", r.samples, () => drawSamples(r));  // images and open details stay as they are between events
  once("checkpoints", r.checkpoint_files, () => drawCheckpoints(r));
  once("memory", [r.plan, r.peak_memory_gib], () => drawMemory(r));
  const log = $("#log"), atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  if (log.textContent !== r.log) { log.textContent = r.log; if (atEnd || !drawn.logScrolled) { log.scrollTop = log.scrollHeight; drawn.logScrolled = true; } }
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
  const keys = [...new Set(metrics.flatMap(m => Object.keys(m).filter(k => k.startsWith("loss/"))))];
  if (keys.length > 1) {  // one dataset's loss is the loss itself: drawn once
    for (const key of keys) loss[key.slice(5)] = metrics.filter(m => typeof m[key] === "number").map(m => [m.step, m[key]]);
  }
  const heldOut = metrics.filter(m => typeof m.eval_loss === "number").map(m => [m.step, m.eval_loss]);
  if (heldOut.length) loss["held-out"] = heldOut;  // the evaluation section's loss (trainer/evaluation/held_out.py)
  plotLines($("#loss-plot"), loss);
  plotLines($("#lr-plot"), {lr: metrics.filter(m => typeof m.lr === "number").map(m => [m.step, m.lr])});
}

// Samples: one step at a time (the slider; the newest unless moved), beside the base model's; a click opens the large view.
let sampleSteps = [], followLatest = true;
function drawSamples(r) {
  const steps = r.samples.filter(s => s.step !== 0 || r.samples.length === 1);
  sampleSteps = steps;
  const slider = $("#sample-step");
  $("#sample-controls").hidden = steps.length === 0;
  if (!steps.length) { $("#samples").replaceChildren(el("p", {class: "hint"}, "No samples yet (validation.every_n_steps in the config).")); return; }
  slider.max = steps.length - 1;
  if (followLatest || Number(slider.value) > steps.length - 1) slider.value = steps.length - 1;
  showSampleStep();
}

function showSampleStep() {
  const r = current, index = Number($("#sample-step").value), s = sampleSteps[index];
  if (!s) return;
  followLatest = index === sampleSteps.length - 1;
  $("#sample-step-label").textContent = `step ${s.step} (${index + 1} of ${sampleSteps.length})`;
  const base = r.samples.find(x => x.step === 0);
  const rows = [];
  if (base && s.step !== 0) rows.push(sampleRow(r, base, "base model (before training)"));
  rows.push(sampleRow(r, s, `step ${s.step}`));
  $("#samples").replaceChildren(...rows);
}

function sampleRow(r, s, title) {
  const row = el("div", {class: "samples-row", "data-step": s.step});
  row.appendChild(el("h3", {}, title));
  s.files.forEach((path, i) => {
    const figure = el("figure", {class: "sample"});
    const img = el("img", {src: fileUrl(r.id, path), alt: s.prompts[i] || `prompt ${i}`, "data-prompt": i});
    img.addEventListener("click", () => openLightbox(i, s.step));
    figure.appendChild(img);
    figure.appendChild(el("figcaption", {}, s.prompts[i] ?? `prompt ${i} (a caption of the dataset: validation.prompts is empty)`));
    row.appendChild(figure);
  });
  return row;
}

// The large view: one prompt's sample, its step chosen with the slider (or the arrow keys), the base model's first.
let lightboxPrompt = 0;
function openLightbox(prompt, step) {
  lightboxPrompt = prompt;
  const slider = $("#lightbox-step");
  slider.max = Math.max(0, current.samples.length - 1);
  slider.value = Math.max(0, current.samples.findIndex(s => s.step === step));
  $("#lightbox").hidden = false;
  showLightbox();
}

function showLightbox() {
  const s = current.samples[Number($("#lightbox-step").value)];
  if (!s) return;
  const i = Math.min(lightboxPrompt, s.files.length - 1);
  $("#lightbox-img").src = fileUrl(current.id, s.files[i]);
  $("#lightbox-caption").textContent = `${s.step === 0 ? "base model" : `step ${s.step}`} · ${s.prompts[i] ?? `prompt ${i}`}`;
}

function drawCheckpoints(r) {
  $("#checkpoints tbody").replaceChildren(...r.checkpoint_files.map(c => {
    const row = el("tr", {"data-checkpoint": c.name});
    const links = el("td");
    for (const w of c.weights) { links.appendChild(el("a", {href: fileUrl(r.id, w), class: "weights"}, w.split("/").pop())); links.appendChild(document.createTextNode(" · ")); }
    links.appendChild(el("a", {href: `/api/runs/${enc(r.id)}/checkpoints/${enc(c.name)}.zip`, class: "zip"}, "whole folder (.zip)"));
    const name = el("td", {}, c.name);
    if (c.eval_loss != null) name.appendChild(el("span", {class: "held-out"}, ` held-out ${fmt(c.eval_loss)}`));
    if (c.best) { row.classList.add("best"); name.appendChild(el("strong", {class: "best-mark", title: "lowest held-out loss: the checkpoint to keep"}, " ★ best")); }
    for (const cell of [name, el("td", {}, c.step), el("td", {}, bytes(c.bytes)), links]) row.appendChild(cell);
    return row;
  }));
}

function drawMemory(r) {
  const box = $("#memory");
  box.replaceChildren();
  const planned = r.plan && (r.plan.output || "").split("\n").find(line => line.startsWith("GPU peak"));
  box.appendChild(el("p", {id: "planned-peak"}, `plan: ${planned || "none was made before this run started (Check and plan memory)"}`));
  box.appendChild(el("p", {id: "measured-peak"}, `measured: ${r.peak_memory_gib ? peak(r.peak_memory_gib) : "at the end of the run"}`));
  if (r.plan) { const d = el("details"); d.appendChild(el("summary", {}, "the whole plan")); d.appendChild(el("pre", {}, r.plan.output)); box.appendChild(d); }
}

// The run's dataset: images with their captions, each editable and saved beside its image.
async function showDataset() {
  const id = current && current.id;
  if (!id) return;
  const box = $("#dataset");
  box.replaceChildren(el("p", {class: "hint"}, "loading ..."));
  let data;
  try { data = await api(`/api/runs/${enc(id)}/dataset`); } catch (error) { box.replaceChildren(el("p", {class: "errors"}, error.message)); return; }
  box.replaceChildren();
  data.folders.forEach((folder, n) => {
    box.appendChild(el("h3", {}, `${folder.name}: ${folder.path} (${folder.total} images, .${folder.caption_type} captions)`));
    if (folder.error) { box.appendChild(el("p", {class: "errors"}, folder.error)); return; }
    box.appendChild(captionFolderControls(id, n, data.caption_model));
    if (folder.total > folder.items.length) box.appendChild(el("p", {class: "hint"}, `the first ${folder.items.length} are shown`));
    const grid = el("div", {class: "dataset-grid"});
    for (const item of folder.items) grid.appendChild(datasetItem(id, n, item));
    box.appendChild(grid);
  });
}

// "Caption this folder": caption.py in a child process; its state is polled until it ends.
let captionTimers = {};
function captionFolderControls(id, n, defaultModel) {
  const row = el("div", {class: "row caption-folder", "data-folder": n});
  const model = el("input", {class: "caption-model", size: 36, value: defaultModel, title: "hub id or local folder of a vision-language model"});
  const trigger = el("input", {class: "caption-trigger", size: 12, placeholder: "trigger word", title: "put first in every caption"});
  const overwrite = el("input", {type: "checkbox", class: "caption-overwrite"});
  const start = el("button", {class: "caption-start"}, "Caption this folder");
  const stop = el("button", {class: "caption-stop", hidden: ""}, "Stop");
  const status = el("span", {class: "caption-status hint"});
  const replace = el("label", {}, " replace existing captions");
  replace.prepend(overwrite);
  for (const node of [model, trigger, replace, start, stop, status]) row.appendChild(node);
  const url = `/api/runs/${enc(id)}/dataset/${n}/caption-folder`;
  const show = job => {
    const counts = job.state === "none" ? "" : `captioned ${job.captioned}, kept ${job.skipped}, failed ${job.failed}`;
    status.textContent = {none: "", running: `captioning ... ${counts}`, done: `done: ${counts}`,
                          interrupted: `interrupted (${counts}); start again to go on`, failed: `failed: ${job.error}`}[job.state] ?? job.state;
    if (job.failures && job.failures.length) status.title = job.failures.map(f => `${f.image}: ${f.reason}`).join("\n");
    start.disabled = job.state === "running";
    stop.hidden = job.state !== "running";  // also a captioner an earlier server left running
  };
  const poll = async () => {
    clearTimeout(captionTimers[n]);
    let job;
    try { job = await api(url); } catch (error) { status.textContent = error.message; return; }
    show(job);
    if (job.state === "running") captionTimers[n] = setTimeout(poll, 2000);
    else if (start.dataset.started) { delete start.dataset.started; showDataset(); }  // the new captions
  };
  stop.addEventListener("click", async () => {
    stop.disabled = true;
    try { show(await api(`${url}/stop`, {})); } catch (error) { status.textContent = error.message; }
    stop.disabled = false;
  });
  start.addEventListener("click", async () => {
    if (overwrite.checked && !confirm("Replace every existing caption of this folder?")) return;
    start.disabled = true;
    try {
      show(await api(url, {model: model.value, trigger_word: trigger.value || null, overwrite: overwrite.checked}));
      start.dataset.started = "1";
      captionTimers[n] = setTimeout(poll, 2000);
    } catch (error) { status.textContent = error.message; start.disabled = false; }
  });
  poll();
  return row;
}

function datasetItem(id, n, item) {
  const card = el("div", {class: "dataset-item", "data-image": item.image});
  card.appendChild(el("img", {src: `/api/runs/${enc(id)}/dataset/${n}/images/${item.image.split("/").map(enc).join("/")}`, alt: item.image, loading: "lazy"}));
  card.appendChild(el("span", {class: "path"}, item.image));
  const text = el("textarea", {rows: 3, class: "caption", placeholder: "(no caption file)"});
  text.value = item.caption ?? "";
  const save = el("button", {class: "save-caption", disabled: ""}, "Save caption");
  const status = el("span", {class: "saved"});
  text.addEventListener("input", () => { save.disabled = text.value === (item.caption ?? ""); status.textContent = ""; });
  save.addEventListener("click", async () => {
    save.disabled = true;
    try {
      await api(`/api/runs/${enc(id)}/dataset/${n}/captions`, {image: item.image, caption: text.value});
      item.caption = text.value.trim();
      status.textContent = "saved";
    } catch (error) { status.textContent = error.message; save.disabled = false; }
  });
  for (const node of [text, save, status]) card.appendChild(node);
  return card;
}

// ---- routing -------------------------------------------------------------------------------------
async function route() {
  if (source) { source.close(); source = null; }
  clearTimeout(listTimer);
  listPoll += 1;
  Object.values(captionTimers).forEach(clearTimeout);
  $("#lightbox").hidden = true;
  const hash = location.hash || "#/";
  const [path, query] = hash.split("?");
  for (const view of ["runs", "start", "run"]) $(`#view-${view}`).hidden = true;
  if (path.startsWith("#/run/")) {
    $("#view-run").hidden = false;
    followLatest = true;
    await showRun(decodeURIComponent(path.slice(6)));
  } else if (path === "#/start") {
    $("#view-start").hidden = false;
    await showStart(new URLSearchParams(query || ""));
  } else {
    $("#view-runs").hidden = false;
    await pollRuns(listPoll);
  }
}

const runId = () => $("#run-id").textContent;
$("#profile").addEventListener("change", async () => {
  const name = $("#profile").value;
  if (!name) return;
  $("#yaml").value = (await api(`/api/profiles/${enc(name)}`)).text;
  await loadForm();
});
$("#upload").addEventListener("change", async () => {
  const file = $("#upload").files[0];
  if (file) { $("#yaml").value = await file.text(); $("#profile").value = ""; await loadForm(); }
});
$("#load-form").addEventListener("click", () => loadForm());
$("#check").addEventListener("click", checkAndPlan);
$("#launch").addEventListener("click", launchRun);
$("#stop").addEventListener("click", () => { $("#stop").disabled = true; api(`/api/runs/${enc(runId())}/stop`, {}).catch(e => alert(e.message)); });
$("#resume").addEventListener("click", async () => {
  const steps = Number($("#resume-steps").value);
  const body = current && steps && steps !== current.max_steps ? {max_train_steps: steps} : {};
  $("#resume").disabled = true;
  try {
    await api(`/api/runs/${enc(runId())}/resume`, body);
    updateRun({...(await api(`/api/runs/${enc(runId())}`)), metrics_from: 0});  // starting, at once
  }
  catch (e) { alert(e.message); $("#resume").disabled = false; }
});
$("#cancel").addEventListener("click", () => api(`/api/runs/${enc(runId())}/cancel`, {}).catch(e => alert(e.message)));
$("#clone").addEventListener("click", () => { location.hash = `#/start?clone=${enc(runId())}`; });
$("#delete").addEventListener("click", async () => {
  const id = runId();
  if (!confirm(`Delete run '${id}'? Its checkpoints, samples, logs and weights are deleted.`)) return;
  try { await api(`/api/runs/${enc(id)}`, undefined, "DELETE"); location.hash = "#/"; } catch (e) { alert(e.message); }
});
$("#sample-step").addEventListener("input", showSampleStep);
$("#lightbox-step").addEventListener("input", showLightbox);
$("#lightbox-close").addEventListener("click", () => { $("#lightbox").hidden = true; });
$("#lightbox").addEventListener("click", event => { if (event.target.id === "lightbox") $("#lightbox").hidden = true; });
document.addEventListener("keydown", event => {
  if ($("#lightbox").hidden) return;
  const slider = $("#lightbox-step");
  if (event.key === "Escape") $("#lightbox").hidden = true;
  else if (event.key === "ArrowRight" || event.key === "ArrowLeft") {
    slider.value = Number(slider.value) + (event.key === "ArrowRight" ? 1 : -1);
    showLightbox();
  }
});
$("#dataset-box").addEventListener("toggle", () => { if ($("#dataset-box").open) showDataset(); });
window.addEventListener("hashchange", route);
route();
