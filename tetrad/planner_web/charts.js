// The plan page's charts, drawn as SVG by the page itself (no chart library: nothing is
// fetched from outside), and the small helpers page.js shares.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const MAX_TIMELINE_WIDTH = 8000;  // pixels
const COLOURS = {params: "#4e79a7", grads: "#f28e2b", optimizer: "#e15759",
                 activations: "#76b7b2", kv_cache: "#59a14f", compute: "#4e79a7",
                 communication_exposed: "#e15759", bubble: "#bab0ac", prefill: "#f28e2b",
                 decode: "#4e79a7", F: "#4e79a7", B: "#59a14f", W: "#f28e2b"};
const $ = (id) => document.getElementById(id);

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "";
  const abs = Math.abs(value);
  if (abs >= 1e5) return value.toExponential(digits - 1).replace("e+", "e");
  if (abs >= 100) return Math.round(value).toLocaleString("en");
  return Number(value.toPrecision(digits)).toString();
}

function node(tag, attrs = {}, parent = null, text = null) {
  const element = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
                                         : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) element.setAttribute(key, value);
  if (text !== null) element.textContent = text;
  if (parent) parent.appendChild(element);
  return element;
}

function sumParts(parts, keys) {
  return keys.reduce((sum, key) => sum + (parts[key] || 0), 0);
}

function niceStep(max, count) {
  const raw = max / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const step of [1, 2, 5, 10]) if (raw <= step * power) return step * power;
  return 10 * power;
}

function legend(id, keys) {
  const box = $(id);
  box.replaceChildren();
  for (const key of keys) {
    const span = node("span", {}, box);
    node("i", {style: `background:${COLOURS[key]}`}, span);
    span.appendChild(document.createTextNode(key.replace("_", " ")));
  }
}

// Vertical stacked bars: bars = [{label, parts: {key: value}}], a dashed line at `limit`.
function stackedColumns(target, bars, keys, limit, unit) {
  const width = 560, height = 260, left = 48, bottom = 40, top = 10;
  const highest = Math.max(limit || 0, ...bars.map((bar) => sumParts(bar.parts, keys)));
  const step = niceStep(highest || 1, 5);
  const scale = (height - bottom - top) / (Math.ceil(highest / step) * step || 1);
  const svg = node("svg:svg", {width, height, viewBox: `0 0 ${width} ${height}`});
  for (let tick = 0; tick * step <= highest + step / 2; tick++) {
    const y = height - bottom - tick * step * scale;
    node("svg:line", {x1: left, x2: width, y1: y, y2: y, stroke: "#eee"}, svg);
    node("svg:text", {x: left - 4, y: y + 4, "text-anchor": "end", "font-size": 10}, svg,
         fmt(tick * step));
  }
  node("svg:text", {x: 4, y: top + 4, "font-size": 10}, svg, unit);
  const slot = (width - left) / bars.length;
  const barWidth = Math.min(60, slot * 0.7);
  bars.forEach((bar, index) => {
    let y = height - bottom;
    const x = left + index * slot + (slot - barWidth) / 2;
    for (const key of keys) {
      const h = (bar.parts[key] || 0) * scale;
      if (h <= 0) continue;
      y -= h;
      const rect = node("svg:rect", {x, y, width: barWidth, height: h, fill: COLOURS[key],
                                     class: "bar"}, svg);
      node("svg:title", {}, rect, `${bar.label}: ${key} ${fmt(bar.parts[key])} ${unit}`);
    }
    node("svg:text", {x: x + barWidth / 2, y: height - bottom + 14, "text-anchor": "middle",
                      "font-size": 10}, svg,
         bar.label.length > 16 ? bar.label.slice(0, 15) + "…" : bar.label);
  });
  if (limit) {
    const y = height - bottom - limit * scale;
    node("svg:line", {x1: left, x2: width, y1: y, y2: y, stroke: "#b00020",
                      "stroke-dasharray": "5,3"}, svg);
    node("svg:text", {x: width - 4, y: y - 3, "text-anchor": "end", "font-size": 10,
                      fill: "#b00020"}, svg, `usable ${fmt(limit)} ${unit}`);
  }
  target.replaceChildren(svg);
}

// Horizontal stacked bars, one row per layout.
function stackedRows(target, rows, keys, unit, selected) {
  const width = 560, rowHeight = 20, left = 36, top = 4, bottom = 24;
  const height = top + bottom + rows.length * rowHeight;
  const longest = Math.max(...rows.map((row) => sumParts(row.parts, keys))) || 1;
  const step = niceStep(longest, 5);
  const scale = (width - left - 10) / (Math.ceil(longest / step) * step);
  const svg = node("svg:svg", {width, height, viewBox: `0 0 ${width} ${height}`});
  for (let tick = 0; tick * step <= longest + step / 2; tick++) {
    const x = left + tick * step * scale;
    node("svg:line", {x1: x, x2: x, y1: top, y2: height - bottom, stroke: "#eee"}, svg);
    node("svg:text", {x, y: height - bottom + 12, "text-anchor": "middle", "font-size": 10}, svg,
         fmt(tick * step));
  }
  node("svg:text", {x: width - 4, y: height - 2, "text-anchor": "end", "font-size": 10}, svg, unit);
  rows.forEach((row, index) => {
    const y = top + index * rowHeight;
    node("svg:text", {x: left - 4, y: y + 14, "text-anchor": "end", "font-size": 10,
                      "font-weight": index === selected ? "bold" : "normal"}, svg, row.label);
    let x = left;
    for (const key of keys) {
      const w = (row.parts[key] || 0) * scale;
      if (w <= 0) continue;
      const rect = node("svg:rect", {x, y: y + 3, width: w, height: rowHeight - 6,
                                     fill: COLOURS[key], class: "bar"}, svg);
      node("svg:title", {}, rect,
           `${row.title}: ${key.replace("_", " ")} ${fmt(row.parts[key])} ${unit}`);
      x += w;
    }
  });
  target.replaceChildren(svg);
}

function lighter(colour, chunk, chunks) {
  const mix = chunks > 1 ? 0.55 * chunk / (chunks - 1) : 0;
  const rgb = [1, 3, 5].map((i) => parseInt(colour.slice(i, i + 2), 16));
  return `rgb(${rgb.map((c) => Math.round(c + (255 - c) * mix)).join(",")})`;
}

function drawTimeline(timeline, config) {
  // Some 6 pixels a compute at least, scrolled sideways beyond the page's width.
  const computes = Math.max(...timeline.ranks.map((spans) => spans.length));
  const width = Math.min(MAX_TIMELINE_WIDTH,
                         Math.max($("pipeline").clientWidth - 30, 6 * computes));
  const rowHeight = 22, left = 50;
  const top = 4, bottom = 24, height = top + bottom + timeline.pp * rowHeight;
  const scale = (width - left - 10) / timeline.makespan_s;
  const svg = node("svg:svg", {width, height, viewBox: `0 0 ${width} ${height}`});
  const chunks = Math.max(...timeline.ranks.flat().map((s) => Math.floor(s[1] / timeline.pp))) + 1;
  timeline.ranks.forEach((spans, rank) => {
    const y = top + rank * rowHeight;
    node("svg:text", {x: left - 4, y: y + 15, "text-anchor": "end", "font-size": 10}, svg,
         "rank " + rank);
    for (const [kind, stage, microbatch, start, end] of spans) {
      const x = left + start * scale, w = (end - start) * scale;
      const fill = lighter(COLOURS[kind], Math.floor(stage / timeline.pp), chunks);
      const rect = node("svg:rect", {x, y: y + 2, width: Math.max(w, 0.5), height: rowHeight - 4,
                                     fill, stroke: w > 3 ? "#fff" : "none", class: "span"}, svg);
      node("svg:title", {}, rect, `${kind} microbatch ${microbatch}, stage ${stage}: ` +
           `${fmt(1e3 * start)}–${fmt(1e3 * end)} ms`);
      if (w > 14) {
        node("svg:text", {x: x + w / 2, y: y + 15, "text-anchor": "middle", "font-size": 9,
                          fill: "#fff"}, svg, String(microbatch));
      }
    }
  });
  const step = niceStep(timeline.makespan_s, 8);
  for (let tick = 0; tick * step <= timeline.makespan_s * 1.0001; tick++) {
    const x = left + tick * step * scale;
    node("svg:text", {x, y: height - bottom + 13, "text-anchor": "middle", "font-size": 10}, svg,
         fmt(tick * step));
  }
  node("svg:text", {x: width - 4, y: height - 2, "text-anchor": "end", "font-size": 10}, svg, "s");
  $("timeline-chart").replaceChildren(svg);
  legend("timeline-legend", timeline.weight_s === null ? ["F", "B"] : ["F", "B", "W"]);
  const drawn = timeline.microbatches_drawn === timeline.microbatches ? ""
    : ` (${timeline.microbatches_drawn} of its ${timeline.microbatches} microbatches drawn)`;
  $("timeline-note").textContent = `${timeline.schedule}, pp ${timeline.pp}` +
    (timeline.vpp > 1 ? `, ${timeline.vpp} chunks per rank` : "") +
    `: one pass${drawn} takes ${fmt(timeline.makespan_s)} s, bubble ` +
    `${(100 * timeline.bubble_fraction).toFixed(1)}% of it; a microbatch's forward ` +
    `${fmt(1e3 * timeline.forward_s)} ms, backward ${fmt(1e3 * timeline.backward_s)} ms` +
    (timeline.weight_s === null ? "" : ` (W ${fmt(1e3 * timeline.weight_s)} ms)`) +
    " on the slowest stage, exposed communication included" +
    (drawn ? `; the plan's whole step idles ${fmt(config.step_time_s.bubble)} s in the bubble.`
           : ".");
}
