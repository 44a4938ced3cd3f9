// Icons drawn as inline SVG elements: no emoji (many systems lack an emoji font, and the
// app uses system fonts only) and no icon font or remote image.
const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag: string, attrs: Record<string, string>): SVGElement {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

/** A thumb pointing up or down (the down one is the up one turned over). */
export function thumbIcon(direction: "up" | "down"): SVGSVGElement {
  const svg = svgEl("svg", {
    viewBox: "0 0 24 24",
    width: "18",
    height: "18",
    fill: "none",
    stroke: "currentColor",
    "stroke-width": "2",
    "stroke-linecap": "round",
    "stroke-linejoin": "round",
    "aria-hidden": "true",
    focusable: "false",
    class: `icon-thumb icon-thumb-${direction}`,
  }) as SVGSVGElement;
  const g = svgEl("g", direction === "down" ? { transform: "rotate(180 12 12)" } : {});
  g.append(
    svgEl("rect", { x: "2", y: "10", width: "4", height: "11", rx: "1" }),
    svgEl("path", { d: "M6 11 L10 3 C11.5 3 12.5 4 12.5 5.5 L12 9 H19 C20.2 9 21 10 20.8 11.2 L19.5 19 C19.3 20.2 18.5 21 17.3 21 H6" }),
  );
  svg.appendChild(g);
  return svg;
}
