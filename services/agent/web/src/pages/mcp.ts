// MCP servers: the tenant's registered MCP servers (add one, see its tools, enable it, or single
// tools of it, per agent). Header values are secrets: sent once when adding, never shown again.
import { api, ApiError, enc, listOf } from "../api";
import { clear, field, h, toast } from "../dom";

interface McpServer {
  name: string;
  url: string;
  header_names: string[];
  agents: string[];
  tools: string[] | null;
}

interface McpTool {
  name: string;
  description: string;
  input_schema: { properties?: Record<string, unknown>; required?: string[] };
}

interface CatalogEntry {
  id: string;
  kind: string;
}

/** "Name: value" lines as a headers object; a line without a colon is an error naming it. */
export function parseHeaders(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line) continue;
    const at = line.indexOf(":");
    if (at <= 0) throw new Error(`header line "${line}" needs "Name: value"`);
    out[line.slice(0, at).trim()] = line.slice(at + 1).trim();
  }
  return out;
}

export function mcpPage(root: HTMLElement) {
  let agents: string[] = [];
  const list = h("div", { class: "mcp-servers", id: "mcp-servers", "aria-live": "polite" });

  // --- add a server -----------------------------------------------------------------
  const name = h("input", { id: "mcp-name", required: true, pattern: "[a-z0-9][a-z0-9_\\-]{0,31}", autocomplete: "off" });
  const url = h("input", { id: "mcp-url", type: "url", required: true, placeholder: "https://example.com/mcp" });
  const headers = h("textarea", { id: "mcp-headers", rows: 2, placeholder: "Authorization: Bearer …" });
  const addErr = h("p", { class: "error", role: "alert", id: "mcp-add-error" });
  const form = h(
    "form",
    { class: "card", "aria-labelledby": "mcp-add-title" },
    h("h2", { id: "mcp-add-title" }, "Add an MCP server"),
    field("Name", name, "1-32 lowercase letters, digits, '_' or '-'"),
    field("URL", url, "The server's Streamable HTTP endpoint"),
    field("Headers", headers, "One 'Name: value' per line; stored encrypted and never shown again"),
    h("button", { type: "submit", class: "primary", id: "mcp-add" }, "Add server"),
    addErr,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    addErr.textContent = "";
    try {
      const body: Record<string, unknown> = { name: name.value.trim(), url: url.value.trim() };
      const parsed = parseHeaders(headers.value);
      if (Object.keys(parsed).length) body.headers = parsed;
      await api("/v1/mcp/servers", { json: body });
      toast(`MCP server ${body.name} added`);
      form.reset();
      await load();
    } catch (exc) {
      addErr.textContent = (exc as Error).message;
    }
  });

  // --- one server ----------------------------------------------------------------------
  async function save(server: McpServer, patch: Record<string, unknown>): Promise<void> {
    try {
      await api(`/v1/mcp/servers/${enc(server.name)}`, { method: "PATCH", json: patch });
      toast(`${server.name} saved`);
      await load();
    } catch (exc) {
      toast((exc as Error).message, "error");
    }
  }

  function toolsView(server: McpServer, tools: McpTool[]): HTMLElement {
    const boxes = tools.map((t) =>
      h("input", { type: "checkbox", value: t.name, checked: server.tools === null || server.tools.includes(t.name) }),
    );
    const rows = tools.map((t, i) => {
      const args = Object.keys(t.input_schema?.properties ?? {});
      return h(
        "li",
        { class: "mcp-tool" },
        h("label", null, boxes[i], h("code", null, t.name)),
        t.description ? h("span", { class: "hint" }, ` ${t.description}`) : null,
        args.length ? h("small", { class: "hint" }, ` (${args.join(", ")})`) : null,
      );
    });
    const saveTools = h("button", { type: "button" }, "Save enabled tools");
    saveTools.addEventListener("click", () => {
      const chosen = boxes.filter((b) => b.checked).map((b) => b.value);
      void save(server, chosen.length === tools.length ? { all_tools: true } : { tools: chosen });
    });
    return h(
      "div",
      { class: "mcp-tools" },
      tools.length ? h("ul", { "aria-label": `Tools of ${server.name}` }, rows) : h("p", null, "The server lists no tools."),
      tools.length ? saveTools : null,
    );
  }

  function serverCard(server: McpServer): HTMLElement {
    const toolsBox = h("div", { class: "mcp-tools-box" });
    const showTools = h("button", { type: "button" }, "Show tools");
    showTools.addEventListener("click", async () => {
      clear(toolsBox);
      toolsBox.append(h("p", { class: "hint" }, "Asking the server…"));
      try {
        const data = await api(`/v1/mcp/servers/${enc(server.name)}/tools`);
        clear(toolsBox);
        toolsBox.append(toolsView(server, listOf<McpTool>(data)));
      } catch (exc) {
        clear(toolsBox);
        toolsBox.append(h("p", { class: "error", role: "alert" }, (exc as Error).message));
      }
    });
    const agentBoxes = agents.map((a) => h("input", { type: "checkbox", value: a, checked: server.agents.includes(a) }));
    const saveAgents = h("button", { type: "button" }, "Save agents");
    saveAgents.addEventListener("click", () => {
      void save(server, { agents: agentBoxes.filter((b) => b.checked).map((b) => b.value) });
    });
    const remove = h("button", { type: "button", class: "danger" }, "Delete");
    remove.addEventListener("click", async () => {
      if (!confirm(`Delete the MCP server ${server.name}?`)) return;
      try {
        await api(`/v1/mcp/servers/${enc(server.name)}`, { method: "DELETE" });
        toast(`${server.name} deleted`);
        await load();
      } catch (exc) {
        toast((exc as Error).message, "error");
      }
    });
    return h(
      "section",
      { class: "card mcp-server", "aria-label": `MCP server ${server.name}` },
      h("h3", null, server.name),
      h("p", null, h("code", null, server.url)),
      server.header_names.length ? h("p", { class: "hint" }, `Headers: ${server.header_names.join(", ")} (hidden)`) : null,
      server.tools !== null ? h("p", { class: "hint" }, `Enabled tools: ${server.tools.join(", ") || "none"}`) : null,
      h(
        "fieldset",
        null,
        h("legend", null, "Enabled for agents"),
        agents.length
          ? agentBoxes.map((b, i) => h("label", { class: "inline" }, b, ` ${agents[i]} `))
          : h("span", { class: "hint" }, "No agents"),
        agents.length ? saveAgents : null,
      ),
      h("div", { class: "actions" }, showTools, " ", remove),
      toolsBox,
    );
  }

  async function load(): Promise<void> {
    try {
      const [servers, catalog] = await Promise.all([api("/v1/mcp/servers"), api("/v1/pipelines")]);
      agents = listOf<CatalogEntry>(catalog).filter((p) => p.kind === "agent").map((p) => p.id);
      const items = listOf<McpServer>(servers);
      clear(list);
      if (!items.length) list.append(h("p", { class: "hint" }, "No MCP servers yet."));
      for (const server of items) list.append(serverCard(server));
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) return;
      clear(list);
      list.append(h("p", { class: "error", role: "alert" }, (exc as Error).message));
    }
  }

  root.append(
    h(
      "div",
      { class: "page mcp-page" },
      h("h1", null, "MCP servers"),
      h(
        "p",
        { class: "hint" },
        "Tools of the MCP servers you add join agent runs: enabled per agent here, or named in a run's mcp_servers.",
      ),
      form,
      h("h2", null, "Your servers"),
      list,
    ),
  );
  void load();
}
