// The engine view: polls /engine/stats and draws its figures, block maps and throughput.
import { api, errorMessage, Unauthorized } from "/static/api.js";

const $ = (id) => document.getElementById(id);
const COLORS = ["--free", "--used", "--cached", "--offloaded"].map(
  (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim());
const percent = (value) => (value === null || value === undefined ? "–" : `${(value * 100).toFixed(1)}%`);

// One square per cell, as large as the canvas allows.
function drawMap(canvas, map) {
  const context = canvas.getContext("2d");
  const width = canvas.clientWidth || canvas.width;
  const cells = map.cells.length;
  const side = Math.max(2, Math.floor(Math.sqrt((width * canvas.height) / cells)));
  let columns = Math.max(1, Math.floor(width / side));
  while (Math.ceil(cells / columns) * side > canvas.height && side > 2) columns += 1;
  canvas.width = width;
  context.clearRect(0, 0, canvas.width, canvas.height);
  const gap = side > 4 ? 1 : 0;
  for (let i = 0; i < cells; i += 1) {
    context.fillStyle = COLORS[Number(map.cells[i])];
    context.fillRect((i % columns) * side, Math.floor(i / columns) * side, side - gap, side - gap);
  }
}

function legend(element, map) {
  element.replaceChildren(...Object.entries(map.counts).map(([state, count]) => {
    const item = document.createElement("li");
    item.innerHTML = `<span class="swatch ${state}"></span>`;
    item.append(`${state} ${count}`);
    item.dataset.state = state;
    item.dataset.count = count;
    return item;
  }));
}

function mapNote(map) {
  const per = map.blocks_per_cell > 1 ? `, ${map.blocks_per_cell} per square` : "";
  return `${map.num_blocks} blocks${per}`;
}

function drawThroughput(throughput) {
  const series = throughput.series;
  const svg = $("throughput");
  const peak = Math.max(1, ...series.flatMap((p) => [p.prompt, p.generation]));
  const span = Math.max(60, -series[0]?.t || 0);
  const line = (key) => series.map((p) => `${300 + (p.t / span) * 300},${118 - (p[key] / peak) * 112}`).join(" ");
  svg.innerHTML = `<polyline class="prompt" points="${line("prompt")}"></polyline>` +
                  `<polyline class="generation" points="${line("generation")}"></polyline>`;
  const last = series[series.length - 1] || { prompt: 0, generation: 0 };
  $("prompt-rate").textContent = last.prompt.toFixed(1);
  $("generation-rate").textContent = last.generation.toFixed(1);
  $("throughput-note").textContent = `last ${Math.round(span / 60)} min, peak ${peak.toFixed(0)}`;
}

function show(stats) {
  $("running").textContent = stats.running;
  $("waiting").textContent = stats.waiting;
  $("kv-usage").textContent = percent(stats.kv_cache_usage);
  $("kv-usage").dataset.value = stats.kv_cache_usage;
  const prefix = stats.prefix_cache;
  $("hit-rate").textContent = percent(prefix.recent_hit_rate ?? prefix.hit_rate);
  $("hit-rate").title = `since start: ${percent(prefix.hit_rate)} of ${prefix.queries} tokens`;
  const preempted = stats.preemptions;
  $("preemptions").textContent = preempted.total;
  $("preemptions").title = `swap ${preempted.swap}, recompute ${preempted.recompute}`;
  $("offload-usage").textContent = stats.offload_usage === null ? "off" : percent(stats.offload_usage);
  if (stats.blocks) {
    drawMap($("block-map"), stats.blocks);
    legend($("block-legend"), stats.blocks);
    $("block-note").textContent = mapNote(stats.blocks);
  }
  $("offload-section").hidden = !stats.offload_blocks;
  if (stats.offload_blocks) {
    drawMap($("offload-map"), stats.offload_blocks);
    $("offload-note").textContent = mapNote(stats.offload_blocks);
  }
  drawThroughput(stats.throughput);
}

export function startEngineView(interval) {
  let stopped = false;
  const poll = async () => {
    try {
      const response = await api("/engine/stats", {}, false);
      if (!response.ok) throw new Error(await errorMessage(response));
      show(await response.json());
      $("engine-error").hidden = true;
    } catch (error) {
      $("engine-error").textContent = `engine stats: ${error.message}`;
      $("engine-error").hidden = false;
      stopped = error instanceof Unauthorized;  // resumes once the chat side sets a key
    }
    setTimeout(poll, stopped ? interval * 5 : interval);
  };
  poll();
}
