// A cited source shown so a reader can check it: the document's text with its headings, the
// cited sentence marked, or (for a PDF) the cited page drawn by pdf.js with the sentence
// highlighted on it, or (for an image: a scan read by OCR) the image with the cited lines boxed.
// pdf.js is bundled (pdfjs-dist, loaded on first use); the file comes from the retrieval
// service's authenticated, tenant-scoped originals route.
import { authHeaders, errorFromBody } from "./api";
import { drawBoxes, type Highlight } from "./boxes";
import { h } from "./dom";

const HEADING_RE = /^(#{1,6})[ \t]+(.*)$/;

/** Line [a, b) of the text, the part inside [start, end) wrapped in <mark class="cited">. */
function marked(text: string, a: number, b: number, start: number, end: number): Node[] {
  const s = Math.max(a, Math.min(start, b));
  const e = Math.max(s, Math.min(end, b));
  if (e <= s) return [document.createTextNode(text.slice(a, b))];
  const out: Node[] = [];
  if (s > a) out.push(document.createTextNode(text.slice(a, s)));
  out.push(h("mark", { class: "cited" }, text.slice(s, e)));
  if (b > e) out.push(document.createTextNode(text.slice(e, b)));
  return out;
}

/**
 * The whole document text as nodes: "#" lines as headings, other lines as text, [start, end)
 * marked (one <mark> per line it covers). Everything is text nodes: untrusted text stays inert.
 */
export function documentNodes(text: string, start: number, end: number): Node[] {
  const out: Node[] = [];
  let block: Node[] = [];
  const flush = () => {
    if (block.length) out.push(h("div", { class: "doc-block" }, ...block));
    block = [];
  };
  let pos = 0;
  for (const line of text.split("\n")) {
    const a = pos;
    const b = pos + line.length;
    pos = b + 1;
    const m = HEADING_RE.exec(line);
    if (m) {
      flush();
      const level = Math.min(m[1].length + 2, 6);
      const head = h(`h${level}` as "h3", { class: "doc-heading" });
      head.append(...marked(text, a + m[1].length + 1, b, start, end));
      out.push(head);
      continue;
    }
    block.push(...marked(text, a, b, start, end), document.createTextNode("\n"));
  }
  flush();
  return out;
}

export interface Original {
  data: ArrayBuffer;
  /** Its media type: application/pdf, or image/png or image/jpeg (a TIFF frame comes as PNG). */
  type: string;
}

/** The original file of a document, as bytes and type (the caller's key, as for every API call). */
export async function fetchOriginal(url: string): Promise<Original> {
  const resp = await fetch(url, { headers: authHeaders() });
  if (!resp.ok) {
    let body: unknown = null;
    try {
      body = await resp.json();
    } catch {
      /* not JSON */
    }
    throw errorFromBody(resp.status, body, `HTTP ${resp.status}`);
  }
  const type = (resp.headers.get("content-type") ?? "").split(";")[0].trim().toLowerCase();
  return { data: await resp.arrayBuffer(), type };
}

/** Draw ``page`` of the PDF into ``into`` with the cited sentence highlighted: ``highlight``'s
 * boxes when the citation has some, else the page's text runs that hold ``sentence`` (pdf.js,
 * loaded now). */
export async function showPdfPage(
  into: HTMLElement,
  data: ArrayBuffer,
  page: number,
  sentence: string,
  highlight: Highlight | null = null,
): Promise<void> {
  const { renderPage } = await import("./pdfview");
  await renderPage(into, data, page, sentence, highlight);
}

/**
 * Draw an image (page ``page`` of a scan) into ``into``, as wide as the view allows, with
 * ``highlight``'s boxes over it (their units are the image's pixels, or ``highlight.size``'s).
 * A canvas, not an <img>: the page's policy loads images only from its own origin.
 */
export async function showImagePage(into: HTMLElement, original: Original, page: number, highlight: Highlight | null): Promise<void> {
  const bitmap = await createImageBitmap(new Blob([original.data], { type: original.type }));
  const room = Math.max(320, (into.clientWidth || 860) - 4);
  const scale = Math.min(1, room / bitmap.width);
  const width = Math.max(1, Math.round(bitmap.width * scale));
  const height = Math.max(1, Math.round(bitmap.height * scale));
  const canvas = h("canvas", { class: "pdf-canvas image-canvas", width: String(width), height: String(height) });
  (canvas.getContext("2d") as CanvasRenderingContext2D).drawImage(bitmap, 0, 0, width, height);
  const layer = h("div", { class: "pdf-page image-page", "data-page": String(page) }, canvas);
  layer.style.width = `${width}px`;
  layer.style.height = `${height}px`;
  into.append(h("p", { class: "muted pdf-label" }, `Page ${page} (image)`), layer);
  if (highlight?.boxes.length) {
    const size = highlight.size ?? { width: bitmap.width, height: bitmap.height };
    layer.dataset.highlight = "boxes";
    drawBoxes(layer, highlight.boxes, width / size.width, height / size.height);
    layer.querySelector(".pdf-hit")?.scrollIntoView({ block: "center" });
  }
  bitmap.close();
}
