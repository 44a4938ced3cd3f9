// A cited source shown so a reader can check it: the document's text with its headings, the
// cited sentence marked, or (for a PDF) the cited page drawn by pdf.js with the sentence
// highlighted on it. pdf.js is bundled (pdfjs-dist, loaded on first use); the PDF comes from
// the retrieval service's authenticated, tenant-scoped originals route.
import { authHeaders, errorFromBody } from "./api";
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

/** The original PDF of a document, as bytes (the caller's key, as for every API call). */
export async function fetchOriginal(url: string): Promise<ArrayBuffer> {
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
  return resp.arrayBuffer();
}

/** Draw ``page`` of the PDF into ``into`` with ``sentence`` highlighted (pdf.js, loaded now). */
export async function showPdfPage(into: HTMLElement, data: ArrayBuffer, page: number, sentence: string): Promise<void> {
  const { renderPage } = await import("./pdfview");
  await renderPage(into, data, page, sentence);
}
