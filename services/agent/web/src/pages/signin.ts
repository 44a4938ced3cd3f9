import { api, ApiError, setKey } from "../api";
import { field, h } from "../dom";

interface AuthConfig {
  oidc: boolean;
  name: string;
  login_url: string | null;
}

interface WhoAmI {
  tenant?: string;
  key_id?: string;
}

/** Checks a key against GET /v1/whoami; returns a short "tenant" label. */
export async function whoami(key: string): Promise<string> {
  const who = await api<WhoAmI>("/v1/whoami", { key, noAuthRedirect: true });
  return who?.tenant ? `tenant ${who.tenant}` : "signed in";
}

export function signinPage(root: HTMLElement) {
  const input = h("input", {
    type: "password",
    name: "api-key",
    autocomplete: "off",
    spellcheck: "false",
    required: true,
    placeholder: "tdm_…",
  });
  const error = h("p", { class: "error", role: "alert", id: "signin-error" });
  const button = h("button", { type: "submit", class: "primary" }, "Sign in");
  const form = h(
    "form",
    { class: "card signin", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in to Tandem"),
    h(
      "p",
      null,
      "Paste an API key. `tandem up` prints one on first start and keeps it in $TANDEM_HOME/api-key; ",
      "`tandem keys create` makes more. The key stays in this browser tab only.",
    ),
    field("API key", input),
    error,
    button,
  );
  const params = new URLSearchParams(location.hash.split("?")[1] ?? "");
  // A failed provider sign-in comes back here with the server's reason.
  const failed = params.get("error");
  if (failed) error.textContent = `Could not sign in: ${failed}`;
  // With the organisation's OpenID provider set up, its button comes first; keys still work.
  void api<AuthConfig>("/v1/auth/config", { noAuthRedirect: true, key: "" })
    .then((cfg) => {
      if (!cfg?.oidc || !cfg.login_url) return;
      const next = params.get("next");
      const query = next && /^[a-z]+$/.test(next) ? `?next=${next}` : "";
      const sso = h(
        "a",
        { class: "button signin-oidc", id: "signin-oidc", href: `${cfg.login_url}${query}` },
        `Sign in with ${cfg.name}`,
      );
      const title = form.querySelector("h1");
      title?.after(sso, h("p", { class: "muted signin-or" }, "or with an API key or personal token"));
    })
    .catch(() => {
      /* no provider information: the key form alone */
    });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    error.textContent = "";
    if (!key) {
      error.textContent = "Enter an API key.";
      input.focus();
      return;
    }
    button.disabled = true;
    button.textContent = "Checking…";
    try {
      const who = await whoami(key);
      setKey(key);
      const whoEl = document.getElementById("who");
      if (whoEl) whoEl.textContent = who;
      const next = new URLSearchParams(location.hash.split("?")[1] ?? "").get("next");
      location.hash = `#/${next && /^[a-z]+$/.test(next) ? next : "chat"}`;
    } catch (exc) {
      const e = exc as ApiError;
      error.textContent =
        e.status === 401 ? "That key was not accepted (unknown or revoked)." : `Could not sign in: ${e.message}`;
      input.focus();
      input.select();
    } finally {
      button.disabled = false;
      button.textContent = "Sign in";
    }
  });
  root.appendChild(h("div", { class: "center" }, form));
  input.focus();
  return {};
}
