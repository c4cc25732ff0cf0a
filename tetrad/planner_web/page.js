// The plan page: a form that becomes `tetrad plan` flags (POST /api/plan), the ranking it
// returns, and charts.js's drawings of it.
"use strict";

// [flag name, label, modes]; a field left empty is searched (layout) or the CLI's default.
const FIELDS = [
  ["gpus_per_node", "GPUs per node", "train serve"], ["tp", "tp", "train serve"],
  ["pp", "pp", "train serve"], ["dp", "dp", "train"], ["cp", "cp", "train"],
  ["ep", "ep", "train serve"], ["vpp", "vpp", "train"], ["zero", "ZeRO", "train"],
  ["recompute", "recompute", "train"], ["schedule", "schedule", "train"],
  ["micro_batch", "micro batch", "train"], ["seq_len", "seq len", "train"],
  ["global_batch", "global batch", "train"], ["tokens", "tokens (e.g. 1e12)", "train"],
  ["prompt_len", "prompt", "serve"], ["output_len", "output", "serve"],
  ["batch", "batch", "serve"], ["dtype", "dtype", "train serve"],
  ["kv_dtype", "KV dtype", "serve"], ["stack", "stack", "train serve"],
  ["recompute_ops", "recompute ops (norm,activation)", "train"],
  ["gpu_power", "power cap W", "train serve"], ["compile", "torch.compile", "train", "switch"],
  ["offload", "offload", "train", "switch"],
  ["price_per_gpu_hour", "$ per GPU-hour", "train serve"], ["rank_by", "rank by", "train serve"],
  ["top", "top", "train serve"],
];
const TEXT_FIELDS = new Set(["tokens", "price_per_gpu_hour", "recompute_ops", "gpu_power"]);
const DEFAULTS = {top: "10"};
const R1 = {mode: "serve", model: "deepseek-r1", gpu: "h100-sxm", num_gpus: 16,
            fields: {gpus_per_node: "8", dtype: "fp8", top: "6"}};

const state = {options: null, upload: null, request: null, answer: null};

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function buildFields() {
  const kept = {};
  for (const input of $("fields").querySelectorAll("[data-flag]")) {
    kept[input.dataset.flag] = input.type === "checkbox" ? input.checked : input.value;
  }
  const box = $("fields");
  box.replaceChildren(node("legend", {}, null, "Layout and workload (empty: searched or default)"));
  const choices = state.options.choices[mode()] || {};
  for (const [name, label, modes, kind] of FIELDS) {
    if (!modes.split(" ").includes(mode())) continue;
    const wrap = node("label", {}, box, label + " ");
    let input;
    if (kind === "switch" && !choices[name]) {  // a flag alone; with choices, a menu
      input = node("input", {type: "checkbox"}, wrap);
      input.checked = kept[name] === true;
    } else if (choices[name]) {
      input = node("select", {}, wrap);
      node("option", {value: ""}, input, "default");
      for (const choice of choices[name]) node("option", {value: choice}, input, String(choice));
    } else {
      input = node("input", TEXT_FIELDS.has(name) ? {type: "text"} : {type: "number", min: "1"},
                   wrap);
    }
    input.id = "opt-" + name;
    input.dataset.flag = name;
    if (input.type === "checkbox") continue;
    const previous = kept[name] ?? DEFAULTS[name] ?? "";
    if (!choices[name] || choices[name].map(String).includes(previous)) input.value = previous;
  }
}

function fillMenus() {
  const model = $("opt-model");
  for (const name of state.options.models) node("option", {value: name}, model, name);
  model.value = "llama3-8b";
  const gpu = $("opt-gpu");
  for (const item of state.options.gpus) {
    const price = item.price_per_hour ? `, $${item.price_per_hour.toFixed(2)}/h` : "";
    node("option", {value: item.name}, gpu, `${item.name} (${item.memory_gib} GiB${price})`);
  }
  for (const name of state.options.servers) node("option", {value: name}, gpu, name);
  gpu.value = "h100-sxm";
  buildFields();
}

function collectRequest() {
  const options = {gpu: $("opt-gpu").value, num_gpus: $("opt-num_gpus").value};
  const uploaded = $("opt-model").value === "(uploaded)";
  if (!uploaded) options.model = $("opt-model").value;
  for (const input of $("fields").querySelectorAll("[data-flag]")) {
    if (input.type === "checkbox") {
      if (input.checked) options[input.dataset.flag] = true;
    } else if (input.value !== "") {
      options[input.dataset.flag] = input.value;
    }
  }
  const request = {mode: mode(), options};
  if (uploaded) request.upload = state.upload;
  return request;
}

async function runPlan(request, detail = 0) {
  $("status").textContent = "planning…";
  $("error").textContent = "";
  try {
    const response = await fetch("/api/plan", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({...request, detail}),
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error ? answer.error.message : response.statusText);
    state.request = request;
    state.answer = answer;
    render();
    $("status").textContent = "";
    return answer;
  } catch (error) {
    $("status").textContent = "";
    $("error").textContent = error.message;
    return null;
  }
}

function layoutName(parallel) {
  const parts = ["tp", "pp", "dp", "cp", "ep"].filter((k) => k in parallel &&
    (parallel[k] !== 1 || ["tp", "pp", "dp"].includes(k))).map((k) => k + parallel[k]);
  if ("zero" in parallel && parallel.zero) parts.push("zero" + parallel.zero);
  if (parallel.pp > 1 && parallel.schedule) {
    parts.push(parallel.schedule + (parallel.vpp > 1 ? "/v" + parallel.vpp : ""));
  }
  if ("micro_batch" in parallel) parts.push("mb" + parallel.micro_batch);
  return parts.join(" ");
}

function columns(plan) {
  const cost = plan.price_per_gpu_hour !== null && plan.price_per_gpu_hour !== undefined;
  if (plan.mode === "train") {
    const out = [["layout", (c) => layoutName(c.parallel)],
      ["recompute", (c) => c.parallel.recompute], ["GiB", (c) => fmt(c.memory_gib.total)],
      ["fits", (c) => (c.fits ? "yes" : "NO")], ["step s", (c) => fmt(c.step_time_s.total)],
      ["bubble s", (c) => fmt(c.step_time_s.bubble)],
      ["comm s", (c) => fmt(c.step_time_s.communication_exposed)],
      ["tok/s", (c) => fmt(c.tokens_per_s, 4)], ["MFU", (c) => (100 * c.mfu).toFixed(1) + "%"]];
    if (plan.configs.some((c) => c.num_gpus !== undefined && c.num_gpus !== plan.num_gpus)) {
      out.splice(1, 0, ["GPUs", (c) => String(c.num_gpus)]);  // ranked by cost: fewer can win
    }
    if (plan.configs.some((c) => c.days !== undefined)) out.push(["days", (c) => fmt(c.days)]);
    if (cost) out.push(["tokens/$", (c) => fmt(c.tokens_per_dollar, 4)]);
    if (plan.configs.some((c) => c.cost_usd !== undefined && c.cost_usd !== null)) {
      out.push(["cost $", (c) => fmt(c.cost_usd, 4)]);
    }
    return out;
  }
  const out = [["layout", (c) => layoutName(c.parallel)],
    ["weights GiB", (c) => fmt(c.memory_gib.params)], ["KV GiB", (c) => fmt(c.memory_gib.kv_cache)],
    ["fits", (c) => (c.fits ? "yes" : "NO")],
    ["max seqs", (c) => String(c.max_concurrent_sequences)],
    ["batch", (c) => String(c.batch)], ["TTFT ms", (c) => fmt(1e3 * c.ttft_s)],
    ["TPOT ms", (c) => fmt(1e3 * c.tpot_s)], ["decode tok/s", (c) => fmt(c.decode_tokens_per_s, 4)],
    ["output tok/s", (c) => fmt(c.output_tokens_per_s, 4)]];
  if (cost) out.push(["output tokens/$", (c) => fmt(c.output_tokens_per_dollar, 4)]);
  return out;
}

function renderRanking() {
  const plan = state.answer.plan;
  const cols = columns(plan);
  const head = $("ranking").tHead;
  head.replaceChildren();
  const row = node("tr", {}, head);
  node("th", {}, row, "#");
  for (const [title] of cols) node("th", {}, row, title);
  const body = $("ranking").tBodies[0];
  body.replaceChildren();
  const selected = state.answer.detail ? state.answer.detail.row : -1;
  plan.configs.forEach((config, index) => {
    const tr = node("tr", {"data-row": index}, body);
    if (index === selected) tr.classList.add("selected");
    if (!config.fits) tr.classList.add("nofit");
    node("td", {}, tr, String(index + 1));
    for (const [, value] of cols) node("td", {}, tr, value(config));
    if (plan.mode === "train") tr.addEventListener("click", () => runPlan(state.request, index));
  });
}

function render() {
  const {plan, command, detail} = state.answer;
  $("command").hidden = false;
  $("command").textContent = `$ ${command}   # the same in a terminal; --json prints the plan`;
  $("results").hidden = false;
  $("summary").textContent = `${plan.model} on ${plan.num_gpus} × ${plan.gpu}: ` +
    `${plan.num_candidates} layouts considered, ${plan.num_fitting} fit`;
  renderRanking();
  $("memory").hidden = false;
  $("time").hidden = false;
  const labels = plan.configs.map((c, i) => `${i + 1}. ${layoutName(c.parallel)}`);
  if (plan.mode === "train") {
    const config = plan.configs[detail.row];
    const keys = ["params", "grads", "optimizer", "activations"];
    $("memory-title").textContent = `Memory per GPU of each pipeline stage: ${labels[detail.row]}`;
    stackedColumns($("memory-chart"), detail.stages_gib.map((parts, stage) =>
      ({label: "stage " + stage, parts})), keys, config.memory_gib.usable, "GiB");
    legend("memory-legend", keys);
    const timeKeys = ["compute", "communication_exposed", "bubble"];
    $("time-title").textContent = "Step time of the best layouts (# as in the ranking)";
    stackedRows($("time-chart"), plan.configs.map((c, i) => (
      {label: "#" + (i + 1), title: labels[i], parts: c.step_time_s})), timeKeys, "s", detail.row);
    legend("time-legend", timeKeys);
    $("pipeline").hidden = false;
    drawTimeline(detail.timeline, config);
  } else {
    const keys = ["params", "activations", "kv_cache"];
    $("memory-title").textContent =
      "Memory per GPU of the best layouts (weights, scratch, KV cache)";
    stackedColumns($("memory-chart"), plan.configs.map((c, i) => (
      {label: labels[i], parts: c.memory_gib})), keys, plan.configs[0].memory_gib.usable, "GiB");
    legend("memory-legend", keys);
    const timeKeys = ["prefill", "decode"];
    $("time-title").textContent = `A static batch from prompts to last token ` +
      `(${plan.prompt_len} + ${plan.output_len} tokens)`;
    stackedRows($("time-chart"), plan.configs.map((c, i) => ({label: "#" + (i + 1),
      title: labels[i], parts: {prefill: c.batch_ttft_s, decode: c.request_s - c.batch_ttft_s}})),
                timeKeys, "s", -1);
    legend("time-legend", timeKeys);
    $("pipeline").hidden = true;
  }
}

function renderWorked(answer) {
  const plan = answer.plan;
  const fitting = plan.configs.filter((c) => c.fits);
  const box = $("worked");
  box.hidden = false;
  box.replaceChildren(node("h2", {}, null,
                           "Worked answer: DeepSeek-R1 on 16 H100 in two nodes of 8"));
  if (!fitting.length) {
    node("p", {}, box, "No layout fits: see the ranking below for how far each is over.");
    return;
  }
  const fastest = fitting.reduce((a, b) => (b.decode_tokens_per_s > a.decode_tokens_per_s ? b : a));
  const quickest = fitting.reduce((a, b) => (b.tpot_s < a.tpot_s ? b : a));
  node("p", {}, box, `One copy of the ${fmt(plan.num_parameters / 1e9, 4)}B parameters in ` +
       `${plan.dtype} is ${fmt(plan.weights_gib_total, 4)} GiB; the KV cache takes ` +
       `${fmt(plan.kv_cache_bytes_per_token / 1024)} KiB per token. ${fitting.length} of ` +
       `${plan.configs.length} layouts shown fit.`);
  node("p", {}, box, `For throughput: ${layoutName(fastest.parallel)}, ` +
       `${fmt(fastest.decode_tokens_per_s, 4)} decode tokens/s with ` +
       `${fastest.max_concurrent_sequences} sequences in memory. For latency: ` +
       `${layoutName(quickest.parallel)}, ${fmt(1e3 * quickest.tpot_s)} ms per output token ` +
       `(first token ${fmt(1e3 * quickest.ttft_s)} ms).`);
  node("p", {class: "note"}, box, "Why: every tensor-parallel rank keeps MLA's KV latent whole, " +
       "so attention replicated over data-parallel ranks, with the experts spread over the GPUs, " +
       "holds the most sequences; docs/planner.md ('Worked answers') and docs/deepseek.md " +
       "('Serving over ranks') go through it.");
}

async function workedAnswer() {
  document.querySelector(`input[name=mode][value=${R1.mode}]`).checked = true;
  buildFields();
  $("opt-model").value = R1.model;
  $("opt-gpu").value = R1.gpu;
  $("opt-num_gpus").value = R1.num_gpus;
  for (const input of $("fields").querySelectorAll("[data-flag]")) {
    input.value = R1.fields[input.dataset.flag] ?? "";
  }
  const answer = await runPlan(collectRequest());
  if (answer) renderWorked(answer);
}

async function start() {
  const response = await fetch("/api/options");
  state.options = await response.json();
  fillMenus();
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", buildFields);
  }
  $("upload").addEventListener("change", async () => {
    const file = $("upload").files[0];
    if (!file) return;
    const stem = file.name.replace(/\.json$/, "");
    state.upload = {name: stem === "config" ? "uploaded-model" : stem, text: await file.text()};
    let option = [...$("opt-model").options].find((o) => o.value === "(uploaded)");
    if (!option) option = node("option", {value: "(uploaded)"}, $("opt-model"));
    option.textContent = "uploaded: " + state.upload.name;
    $("opt-model").value = "(uploaded)";
  });
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    $("worked").hidden = true;
    runPlan(collectRequest());
  });
  $("r1-button").addEventListener("click", workedAnswer);
  document.body.dataset.ready = "yes";
}

start();
