// Line boxes a citation carries from its chunk: where each line of the chunk is on its page, as
// the parser saw it (PDF text, or OCR of a scan or an image). Drawing the boxes whose text
// overlaps the cited sentence highlights it without finding its text on the page again.
import { h } from "./dom";

/** ``[start, end, page, x0, top, x1, bottom]``: offsets into the citation's text, the 1-based
 * page, and the line's box in page units with the origin at the page's top-left. */
export type LineBox = [number, number, number, number, number, number, number];
/** ``[page, width, height]`` in the same units as the boxes. */
export type PageSize = [number, number, number];

export interface Highlight {
  /** The boxes to draw (all on one page). */
  boxes: LineBox[];
  /** That page's size in page units, when the citation says. */
  size: { width: number; height: number } | null;
}

function isBox(b: unknown): b is LineBox {
  return Array.isArray(b) && b.length >= 7 && b.slice(0, 7).every((v) => typeof v === "number" && Number.isFinite(v));
}

/** The boxes on ``page`` whose text ``[start, end)`` overlaps ``[from, to)``. */
export function boxesIn(boxes: unknown, from: number, to: number, page: number): LineBox[] {
  if (!Array.isArray(boxes)) return [];
  return boxes.filter((b): b is LineBox => isBox(b) && b[2] === page && b[0] < to && b[1] > from && b[5] > b[3] && b[6] > b[4]);
}

/** The page the cited text ``[from, to)`` is drawn on: ``page`` when a box of it is there, else
 * the first page one is on (the sentence may start at the foot of the page before), else ``page``. */
export function pageOfSpan(boxes: unknown, from: number, to: number, page: number): number {
  if (!Array.isArray(boxes) || boxesIn(boxes, from, to, page).length) return page;
  const first = boxes.find((b): b is LineBox => isBox(b) && b[0] < to && b[1] > from);
  return first ? first[2] : page;
}

export function pageSizeOf(sizes: unknown, page: number): { width: number; height: number } | null {
  if (!Array.isArray(sizes)) return null;
  for (const s of sizes) {
    if (Array.isArray(s) && s[0] === page && Number(s[1]) > 0 && Number(s[2]) > 0) return { width: Number(s[1]), height: Number(s[2]) };
  }
  return null;
}

/** What to draw for a citation whose text ``[from, to)`` is cited on ``page``; null without boxes. */
export function highlightOf(boxes: unknown, sizes: unknown, from: number, to: number, page: number): Highlight | null {
  const hits = boxesIn(boxes, from, to, page);
  return hits.length ? { boxes: hits, size: pageSizeOf(sizes, page) } : null;
}

/**
 * One ``.pdf-hit`` per box over ``layer`` (positioned over the drawn page), scaled by
 * ``sx``/``sy`` from page units to the drawn page's pixels.
 */
export function drawBoxes(layer: HTMLElement, boxes: LineBox[], sx: number, sy: number): HTMLElement[] {
  return boxes.map(([start, end, page, x0, top, x1, bottom]) => {
    const el = h("div", {
      class: "pdf-hit box-hit",
      "data-box": `${x0},${top},${x1},${bottom}`,
      "data-page": String(page),
      "data-span": `${start},${end}`,
    });
    el.style.left = `${x0 * sx}px`;
    el.style.top = `${top * sy}px`;
    el.style.width = `${(x1 - x0) * sx}px`;
    el.style.height = `${(bottom - top) * sy}px`;
    layer.append(el);
    return el;
  });
}
