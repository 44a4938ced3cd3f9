// A tiny element builder. Text always goes in as text nodes, never as HTML:
// the only HTML this app inserts is sanitized Markdown (see markdown.ts).

export type Child = Node | string | number | null | undefined | false;
type Attrs = Record<string, unknown>;

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs?: Attrs | null,
  ...children: (Child | Child[])[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [name, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (name.startsWith("on") && typeof value === "function") {
        el.addEventListener(name.slice(2).toLowerCase(), value as EventListener);
      } else if (name === "class") {
        el.className = String(value);
      } else if (name === "value" && "value" in el) {
        (el as HTMLInputElement).value = String(value);
      } else if (name === "checked" && "checked" in el) {
        (el as HTMLInputElement).checked = Boolean(value);
      } else if (value === true) {
        el.setAttribute(name, "");
      } else {
        el.setAttribute(name, String(value));
      }
    }
  }
  append(el, children);
  return el;
}

export function append(parent: Node, children: (Child | Child[])[]): void {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    parent.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el: Node): void {
  while (el.firstChild) el.removeChild(el.firstChild);
}

let idCounter = 0;
export function uid(prefix: string): string {
  idCounter += 1;
  return `${prefix}-${idCounter}`;
}

/** A labelled form field: the label is tied to the control for screen readers. */
export function field(label: string, control: HTMLElement, hint?: string): HTMLElement {
  const id = control.id || uid("f");
  control.id = id;
  const hintEl = hint ? h("small", { class: "hint", id: `${id}-hint` }, hint) : null;
  if (hintEl) control.setAttribute("aria-describedby", hintEl.id);
  return h("div", { class: "field" }, h("label", { for: id }, label), control, hintEl);
}

export function toast(message: string, kind: "info" | "error" = "info"): void {
  const box = document.getElementById("toasts");
  if (!box) return;
  const item = h("div", { class: `toast ${kind}` }, message);
  box.appendChild(item);
  setTimeout(() => item.remove(), kind === "error" ? 8000 : 4000);
}

/** Text with every case-insensitive occurrence of the given terms wrapped in <mark>. */
export function highlightTerms(text: string, terms: string[]): Node[] {
  const words = terms.map((t) => t.trim()).filter((t) => t.length >= 2);
  if (!words.length) return [document.createTextNode(text)];
  const escaped = words.map((w) => w.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  const re = new RegExp(`(${escaped.join("|")})`, "gi");
  const out: Node[] = [];
  let last = 0;
  for (const m of text.matchAll(re)) {
    const at = m.index ?? 0;
    if (at > last) out.push(document.createTextNode(text.slice(last, at)));
    out.push(h("mark", null, m[0]));
    last = at + m[0].length;
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}

/** Text with the character range [start, end) wrapped in <mark>, trimmed to some context around it. */
export function highlightSpan(text: string, start: number, end: number, context = 400): Node[] {
  const s = Math.max(0, Math.min(start, text.length));
  const e = Math.max(s, Math.min(end, text.length));
  const from = Math.max(0, s - context);
  const to = Math.min(text.length, e + context);
  return [
    document.createTextNode((from > 0 ? "… " : "") + text.slice(from, s)),
    h("mark", { class: "cited" }, text.slice(s, e)),
    document.createTextNode(text.slice(e, to) + (to < text.length ? " …" : "")),
  ];
}

export function formatBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}
