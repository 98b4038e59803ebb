// A small line chart drawn as SVG (no plotting library, nothing fetched): plotLines(svg, {name: [[x, y], ...]}).
"use strict";
const PLOT_COLOURS = ["#1d4ed8", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#9ca3af"];

function plotLines(svg, series) {
  const W = 600, H = 260, L = 60, R = 10, T = 22, B = 30, TICKS = 4;
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const all = Object.values(series).flat().filter(p => Number.isFinite(p[1]));
  if (!all.length) return;
  const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 <= Math.abs(y1) * 1e-6) { const pad = Math.abs(y1) * 0.1 || 1; y0 -= pad; y1 += pad; }  // a flat line, e.g. a constant LR
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const add = (tag, attrs, text) => {
    const el = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    svg.appendChild(el);
    return el;
  };
  const fmt = v => Math.abs(v) >= 1e-2 && Math.abs(v) < 1e4 ? Number(v.toPrecision(3)).toString() : v.toExponential(1);
  for (let i = 0; i <= TICKS; i++) {  // a light grid with its values
    const y = y0 + (y1 - y0) * i / TICKS, x = Math.round(x0 + (x1 - x0) * i / TICKS);
    add("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), stroke: "#eee"});
    add("line", {x1: sx(x), x2: sx(x), y1: T, y2: H - B, stroke: "#eee"});
    add("text", {x: 2, y: sy(y) + 4, "font-size": 11, fill: "#555"}, fmt(y));
    add("text", {x: sx(x) - 10, y: H - 10, "font-size": 11, fill: "#555"}, String(x));
  }
  add("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#999"});
  Object.entries(series).forEach(([name, points], i) => {
    const colour = PLOT_COLOURS[i % PLOT_COLOURS.length];
    const good = points.filter(p => Number.isFinite(p[1]));
    add("polyline", {points: good.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "),
                     fill: "none", stroke: colour, "stroke-width": name === "smoothed" ? 2 : 1.2,
                     "stroke-opacity": name === "smoothed" || Object.keys(series).length === 1 ? 1 : .55,
                     "data-series": name, "data-count": good.length});
    add("text", {x: L + 8 + 130 * i, y: T - 8, "font-size": 11, fill: colour}, name);
  });
}

function smoothSeries(points, beta = 0.9) {  // bias-corrected EMA, as trainer/reporting/summary.py smooths
  let avg = 0;
  return points.map(([x, y], i) => { avg = beta * avg + (1 - beta) * y; return [x, avg / (1 - beta ** (i + 1))]; });
}
