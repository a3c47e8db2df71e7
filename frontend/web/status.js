// The status view: running and waiting requests, KV cache use and generated
// tokens per second over the last minute, read from the server's /metrics
// every two seconds while the view is shown, the rate drawn on a canvas.

import { call } from "./api.js";

const PERIOD_MS = 2000;
const WINDOW = 30; // samples: one minute
const rates = [];
let previous = null;
let timer = null;

// Sums each metric's samples over their labels, from Prometheus' text format.
export function parseMetrics(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!match) continue;
    sums[match[1]] = (sums[match[1]] || 0) + Number(match[3]);
  }
  return sums;
}

function draw(canvas) {
  // Drawn at the screen's resolution, in CSS pixels.
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const style = getComputedStyle(document.documentElement);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = style.getPropertyValue("--border");
  ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
  const top = Math.max(1, ...rates);
  ctx.fillStyle = style.getPropertyValue("--muted");
  ctx.font = "12px sans-serif";
  ctx.fillText(top.toFixed(0) + " tok/s", 6, 14);
  if (rates.length < 2) return;
  ctx.strokeStyle = style.getPropertyValue("--accent");
  ctx.lineWidth = 2;
  ctx.beginPath();
  rates.forEach((rate, k) => {
    const x = (k / (WINDOW - 1)) * (width - 2) + 1;
    const y = height - 4 - (rate / top) * (height - 24);
    if (k) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
  });
  ctx.stroke();
}

async function sample() {
  let metrics;
  try {
    metrics = parseMetrics(await (await call("/metrics")).text());
  } catch (error) {
    document.getElementById("stat-running").textContent = "?";
    document.getElementById("stat-running").title = String(error.message || error);
    return;
  }
  const now = performance.now();
  const generated = metrics["vllm:generation_tokens_total"] || 0;
  if (previous) {
    const rate = Math.max(0, (generated - previous.generated) / ((now - previous.now) / 1000));
    rates.push(rate);
    if (rates.length > WINDOW) rates.shift();
    document.getElementById("stat-tps").textContent = rate.toFixed(1);
  }
  previous = { now, generated };
  document.getElementById("stat-running").textContent = metrics["vllm:num_requests_running"] ?? "–";
  document.getElementById("stat-waiting").textContent = metrics["vllm:num_requests_waiting"] ?? "–";
  const kv = metrics["vllm:kv_cache_usage_perc"];
  document.getElementById("stat-kv").textContent = kv === undefined ? "–" : (kv * 100).toFixed(1) + " %";
  draw(document.getElementById("tps-chart"));
}

export function showStatus(visible) {
  clearInterval(timer);
  timer = null;
  if (!visible) return;
  sample();
  timer = setInterval(sample, PERIOD_MS);
}
