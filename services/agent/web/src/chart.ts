// A small SVG line chart (no chart library): one or more series against the step.
const SVG = "http://www.w3.org/2000/svg";

export interface Series {
  name: string;
  color: string;
  points: [number, number][];
}

function el<K extends keyof SVGElementTagNameMap>(tag: K, attrs: Record<string, string | number>): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function fmt(v: number): string {
  const a = Math.abs(v);
  if (a !== 0 && (a < 0.01 || a >= 10000)) return v.toExponential(1);
  return a >= 100 ? v.toFixed(0) : v.toFixed(a >= 10 ? 1 : 3);
}

/** Draws the series into `host` (replacing its content); each series gets its own y range. */
export function drawChart(host: HTMLElement, title: string, series: Series[]): void {
  const W = 640;
  const H = 220;
  const pad = { l: 56, r: 16, t: 12, b: 28 };
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "chart-svg", preserveAspectRatio: "none" });
  const live = series.filter((s) => s.points.length);
  const desc = live
    .map((s) => `${s.name}: ${s.points.length} points, latest ${fmt(s.points[s.points.length - 1][1])} at step ${s.points[s.points.length - 1][0]}`)
    .join("; ");
  svg.setAttribute("aria-label", `${title}. ${desc || "no points yet"}`);
  const all = live.flatMap((s) => s.points);
  svg.appendChild(el("rect", { x: pad.l, y: pad.t, width: W - pad.l - pad.r, height: H - pad.t - pad.b, class: "plot-bg" }));
  if (!all.length) {
    const t = el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis-label" });
    t.textContent = "waiting for the first step…";
    svg.appendChild(t);
    host.replaceChildren(svg);
    return;
  }
  const xs = all.map((p) => p[0]);
  let x0 = Math.min(...xs);
  let x1 = Math.max(...xs);
  if (x0 === x1) {
    x0 -= 1;
    x1 += 1;
  }
  const sx = (x: number) => pad.l + ((x - x0) / (x1 - x0)) * (W - pad.l - pad.r);
  for (const [i, s] of live.entries()) {
    const ys = s.points.map((p) => p[1]).filter(Number.isFinite);
    let y0 = Math.min(...ys);
    let y1 = Math.max(...ys);
    if (y0 === y1) {
      y0 -= Math.abs(y0) * 0.1 || 1;
      y1 += Math.abs(y1) * 0.1 || 1;
    }
    const sy = (y: number) => pad.t + (1 - (y - y0) / (y1 - y0)) * (H - pad.t - pad.b);
    // y labels of the first series on the left, of a second one on the right.
    const side = i === 0 ? pad.l - 6 : W - pad.r + 2;
    const anchor = i === 0 ? "end" : "start";
    for (const v of [y0, (y0 + y1) / 2, y1]) {
      const t = el("text", { x: side, y: sy(v) + 4, "text-anchor": anchor, class: "axis-label", fill: s.color });
      t.textContent = fmt(v);
      svg.appendChild(t);
      if (i === 0) svg.appendChild(el("line", { x1: pad.l, x2: W - pad.r, y1: sy(v), y2: sy(v), class: "grid" }));
    }
    const d = s.points
      .filter((p) => Number.isFinite(p[1]))
      .map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`)
      .join(" ");
    svg.appendChild(el("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, class: `series series-${s.name}` }));
    for (const p of s.points) {
      if (Number.isFinite(p[1])) svg.appendChild(el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: s.color, class: "point" }));
    }
  }
  for (const v of [x0, x1]) {
    const t = el("text", { x: sx(v), y: H - 8, "text-anchor": v === x0 ? "start" : "end", class: "axis-label" });
    t.textContent = `step ${Math.round(v)}`;
    svg.appendChild(t);
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of live) {
    const item = document.createElement("span");
    item.className = "legend-item";
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = s.color;
    item.append(sw, ` ${s.name} (${fmt(s.points[s.points.length - 1][1])})`);
    legend.appendChild(item);
  }
  host.replaceChildren(svg, legend);
}
