// Markdown from the model (and from documents quoted by it) is untrusted. Two layers:
// markdown-it with raw HTML disabled escapes any tags in the text and refuses
// javascript:/data: links; DOMPurify then strips anything that still looks active.
import DOMPurify from "dompurify";
import MarkdownIt from "markdown-it";

const md = new MarkdownIt({ html: false, linkify: false, breaks: false, typographer: false });

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
  if (node.tagName === "IMG") {
    // No remote images: they would leak the page to third parties and break offline.
    const src = node.getAttribute("src") ?? "";
    if (!src.startsWith("data:image/")) node.removeAttribute("src");
  }
});

export function renderMarkdown(text: string): DocumentFragment {
  const html = md.render(text);
  return DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe", "object", "embed"],
    FORBID_ATTR: ["style"],
  });
}

/**
 * Replace citation markers "[n]" in rendered text with buttons, outside code blocks.
 * Built from DOM nodes, so nothing here can inject markup.
 */
export function linkCitations(root: Node, make: (n: number) => HTMLElement | null): void {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, {
    acceptNode(node) {
      const parent = node.parentElement;
      if (parent && parent.closest("code, pre, a")) return NodeFilter.FILTER_REJECT;
      return /\[\d+\]/.test(node.nodeValue ?? "") ? NodeFilter.FILTER_ACCEPT : NodeFilter.FILTER_SKIP;
    },
  });
  const nodes: Text[] = [];
  while (walker.nextNode()) nodes.push(walker.currentNode as Text);
  for (const node of nodes) {
    const text = node.nodeValue ?? "";
    const frag = document.createDocumentFragment();
    let last = 0;
    for (const m of text.matchAll(/\[(\d+)\]/g)) {
      const at = m.index ?? 0;
      const el = make(Number(m[1]));
      if (!el) continue;
      frag.appendChild(document.createTextNode(text.slice(last, at)));
      frag.appendChild(el);
      last = at + m[0].length;
    }
    frag.appendChild(document.createTextNode(text.slice(last)));
    node.replaceWith(frag);
  }
}
