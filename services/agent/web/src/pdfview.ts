// The PDF side of the source view: one page drawn by pdf.js (bundled from pdfjs-dist, its
// worker served beside the app) and the cited sentence highlighted over it: from the line boxes
// the parser stored with the chunk when there are some, else by finding the sentence's text runs.
import { getDocument, GlobalWorkerOptions, Util } from "pdfjs-dist";
import workerUrl from "pdfjs-dist/build/pdf.worker.min.mjs?url";
import { drawBoxes, type Highlight } from "./boxes";
import { h } from "./dom";

GlobalWorkerOptions.workerSrc = workerUrl;

interface Run {
  str: string;
  transform: number[];
  width: number;
  hasEOL?: boolean;
}

const LIGATURES: Record<string, string> = { "\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "st", "\ufb06": "st" };

/** Text as compared: lower case, ligatures as letters, without whitespace and hyphens (the
 * parser joins a word hyphenated across lines; pdf.js's runs keep the hyphen). */
const squash = (s: string) =>
  s.replace(/[\ufb00-\ufb06]/g, (c) => LIGATURES[c] ?? c).replace(/[\s\-\u2010\u00ad]+/g, "").toLowerCase();

/** Indexes of the runs that hold ``sentence`` (matched with whitespace and hyphens ignored). */
export function runsOf(runs: Run[], sentence: string): number[] {
  const want = squash(sentence);
  if (!want) return [];
  let joined = "";
  const owner: number[] = [];
  runs.forEach((r, i) => {
    for (const ch of squash(r.str)) {
      joined += ch;
      owner.push(i);
    }
  });
  const at = joined.indexOf(want);
  if (at < 0) return [];
  return [...new Set(owner.slice(at, at + want.length))];
}

export async function renderPage(
  into: HTMLElement,
  data: ArrayBuffer,
  pageNumber: number,
  sentence: string,
  highlight: Highlight | null = null,
): Promise<void> {
  // No eval (the page's CSP forbids it); fonts the file does not embed come from the system.
  const pdf = await getDocument({ data: new Uint8Array(data), isEvalSupported: false, useSystemFonts: true }).promise;
  const n = Math.min(Math.max(1, pageNumber), pdf.numPages);
  const page = await pdf.getPage(n);
  const viewport = page.getViewport({ scale: 1.25 });
  const canvas = h("canvas", { class: "pdf-canvas", width: String(Math.floor(viewport.width)), height: String(Math.floor(viewport.height)) });
  const layer = h("div", { class: "pdf-page", "data-page": String(n) }, canvas);
  layer.style.width = `${Math.floor(viewport.width)}px`;
  layer.style.height = `${Math.floor(viewport.height)}px`;
  into.append(h("p", { class: "muted pdf-label" }, `Page ${n} of ${pdf.numPages}`), layer);
  await page.render({ canvas, canvasContext: canvas.getContext("2d") as CanvasRenderingContext2D, viewport }).promise;
  if (highlight?.boxes.length) {
    // Page units are PDF points from the page's top-left; the viewport is the page at scale.
    const base = page.getViewport({ scale: 1 });
    const width = highlight.size?.width ?? base.width;
    const height = highlight.size?.height ?? base.height;
    layer.dataset.highlight = "boxes";
    drawBoxes(layer, highlight.boxes, viewport.width / width, viewport.height / height);
    layer.querySelector(".pdf-hit")?.scrollIntoView({ block: "center" });
    await pdf.destroy();
    return;
  }
  layer.dataset.highlight = "text";
  const content = await page.getTextContent();
  const runs = content.items.filter((it): it is Run & typeof it => "str" in it) as unknown as Run[];
  for (const i of runsOf(runs, sentence)) {
    const r = runs[i];
    const t = Util.transform(viewport.transform, r.transform);
    const height = Math.hypot(t[2], t[3]);
    const box = h("div", { class: "pdf-hit", "data-text": r.str });
    box.style.left = `${t[4]}px`;
    box.style.top = `${t[5] - height}px`;
    box.style.width = `${r.width * viewport.scale}px`;
    box.style.height = `${height * 1.2}px`;
    layer.append(box);
  }
  layer.querySelector(".pdf-hit")?.scrollIntoView({ block: "center" });
  await pdf.destroy();
}
