// HTTP helpers for the agent API (/v1/...) and the agent's same-origin proxies to the
// other services (/api/retrieval, /api/trainer, /api/inference). Two ways to be signed in:
// - an API key or personal token, pasted: it lives in sessionStorage only and is sent as a
//   Bearer header (or websocket subprotocol), never in a URL;
// - a sign-in with the organisation's OpenID provider: the browser holds an HttpOnly session
//   cookie this code never sees; the page keeps the session's CSRF value (from
//   GET /v1/auth/session) in memory and sends it as X-CSRF-Token, which writes need.

const KEY_NAME = "tandem.apiKey";
const CSRF_HEADER = "X-CSRF-Token";

let sessionCsrf: string | null = null;

export function getKey(): string | null {
  return sessionStorage.getItem(KEY_NAME);
}

export function setKey(key: string): void {
  sessionStorage.setItem(KEY_NAME, key);
}

/** Forgets the pasted key and the session's CSRF value (the cookie stays until signOut). */
export function forgetKey(): void {
  sessionStorage.removeItem(KEY_NAME);
  sessionCsrf = null;
}

/** Signed in either way: a key in this tab, or a provider sign-in's session. */
export function signedIn(): boolean {
  return getKey() !== null || sessionCsrf !== null;
}

export interface SessionInfo {
  tenant: string;
  role: string;
  user_id: string | null;
  email: string | null;
  groups: string[];
  via: "cookie" | "bearer";
  csrf: string | null;
  expires_at: number | null;
}

/** The browser's provider sign-in, when its cookie holds a live session (null otherwise). */
export async function loadSession(): Promise<SessionInfo | null> {
  try {
    const s = await api<SessionInfo>("/v1/auth/session", { noAuthRedirect: true, key: "" });
    if (s.via !== "cookie" || !s.csrf) return null;
    sessionCsrf = s.csrf;
    return s;
  } catch {
    return null;
  }
}

/** Signs out: a session is ended at the server (its token revoked, its cookie cleared). */
export async function signOut(): Promise<void> {
  const csrf = sessionCsrf;
  forgetKey();
  if (!csrf) return;
  try {
    await fetch("/v1/auth/logout", { method: "POST", headers: { [CSRF_HEADER]: csrf } });
  } catch {
    /* the server is away: the cookie expires by itself */
  }
}

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly type = "error",
    readonly param: string | null = null,
  ) {
    super(message);
  }
}

/** Called when the server says the key is no longer good (set by main.ts). */
let onUnauthorized: () => void = () => {};
export function setUnauthorizedHandler(fn: () => void): void {
  onUnauthorized = fn;
}

/** What a request was sent as: the pasted key, else the session (its CSRF value), else nothing. */
function credentialNow(): string | null {
  return getKey() ?? sessionCsrf;
}

/** A 401 signs out only the credential it was sent with: a request still in flight from before a
 * sign-out (a page's poll) must not end the sign-in that came after it. */
function unauthorized(sentAs: string | null): void {
  if (sentAs !== null && credentialNow() === sentAs) onUnauthorized();
}

/** The message of Tandem's error shape {"error": {type, message, param}}, or FastAPI's {"detail"}. */
export function errorFromBody(status: number, body: unknown, fallback: string): ApiError {
  if (body && typeof body === "object") {
    const b = body as Record<string, unknown>;
    const err = b.error as Record<string, unknown> | undefined;
    if (err && typeof err === "object" && typeof err.message === "string") {
      return new ApiError(err.message, status, String(err.type ?? "error"), (err.param as string) ?? null);
    }
    if (typeof b.detail === "string") return new ApiError(b.detail, status);
    if (Array.isArray(b.detail)) {
      const msgs = b.detail.map((d: Record<string, unknown>) => {
        const loc = Array.isArray(d.loc) ? d.loc.join(".") : "";
        return loc ? `${loc}: ${d.msg}` : String(d.msg);
      });
      return new ApiError(msgs.join("; "), status);
    }
  }
  return new ApiError(fallback, status);
}

export function authHeaders(): Record<string, string> {
  const key = getKey();
  if (key) return { Authorization: `Bearer ${key}` };
  return sessionCsrf ? { [CSRF_HEADER]: sessionCsrf } : {};
}

export interface RequestOptions {
  method?: string;
  json?: unknown;
  body?: BodyInit;
  signal?: AbortSignal;
  /** Don't treat a 401 as "signed out" (used by the sign-in check itself). */
  noAuthRedirect?: boolean;
  key?: string;
}

export async function api<T = unknown>(path: string, opts: RequestOptions = {}): Promise<T> {
  // opts.key: that key only ("" : the session cookie alone, as when asking for the session)
  const headers: Record<string, string> =
    opts.key !== undefined ? (opts.key ? { Authorization: `Bearer ${opts.key}` } : {}) : authHeaders();
  let body = opts.body;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.json);
  }
  const sentAs = credentialNow();
  let resp: Response;
  try {
    resp = await fetch(path, { method: opts.method ?? (body ? "POST" : "GET"), headers, body, signal: opts.signal });
  } catch (exc) {
    if ((exc as Error).name === "AbortError") throw exc;
    throw new ApiError(`could not reach the server (${(exc as Error).message})`, 0, "network");
  }
  const text = await resp.text();
  let data: unknown = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }
  if (!resp.ok) {
    if (resp.status === 401 && !opts.noAuthRedirect) unauthorized(sentAs);
    throw errorFromBody(resp.status, data, `${resp.status} ${resp.statusText || "error"} from ${path}`);
  }
  return data as T;
}

/** A list out of the usual envelopes: a bare array, {data}, {items}, or {<name>}. */
export function listOf<T>(data: unknown, ...names: string[]): T[] {
  if (Array.isArray(data)) return data as T[];
  if (data && typeof data === "object") {
    const d = data as Record<string, unknown>;
    for (const name of [...names, "data", "items", "results"]) {
      if (Array.isArray(d[name])) return d[name] as T[];
    }
  }
  return [];
}

export interface SseEvent {
  event: string;
  data: string;
}

/**
 * Server-sent events over fetch (EventSource cannot send an Authorization header).
 * Yields each event; returns when the server closes the stream.
 */
export async function* sse(path: string, init: RequestInit = {}): AsyncGenerator<SseEvent> {
  const sentAs = credentialNow();
  const resp = await fetch(path, {
    ...init,
    headers: { Accept: "text/event-stream", ...authHeaders(), ...(init.headers as Record<string, string>) },
  });
  if (!resp.ok || !resp.body) {
    let data: unknown = null;
    try {
      data = await resp.json();
    } catch {
      /* not JSON */
    }
    if (resp.status === 401) unauthorized(sentAs);
    throw errorFromBody(resp.status, data, `${resp.status} from ${path}`);
  }
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n?/g, "\n");
    let sep: number;
    while ((sep = buf.indexOf("\n\n")) >= 0) {
      const raw = buf.slice(0, sep);
      buf = buf.slice(sep + 2);
      let event = "message";
      const data: string[] = [];
      for (const line of raw.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "event") event = val;
        else if (name === "data") data.push(val);
      }
      if (data.length || event !== "message") yield { event, data: data.join("\n") };
    }
  }
}

/** Multipart upload with upload progress (fetch has no upload progress events). */
export function uploadWithProgress(
  path: string,
  form: FormData,
  onProgress: (fraction: number) => void,
): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const sentAs = credentialNow();
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    for (const [name, value] of Object.entries(authHeaders())) xhr.setRequestHeader(name, value);
    xhr.upload.onprogress = (ev) => {
      if (ev.lengthComputable) onProgress(ev.loaded / ev.total);
    };
    xhr.onerror = () => reject(new ApiError("upload failed: could not reach the server", 0, "network"));
    xhr.onload = () => {
      let data: unknown = null;
      try {
        data = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch {
        data = xhr.responseText;
      }
      if (xhr.status >= 200 && xhr.status < 300) resolve(data);
      else {
        if (xhr.status === 401) unauthorized(sentAs);
        reject(errorFromBody(xhr.status, data, `upload failed: HTTP ${xhr.status}`));
      }
    };
    xhr.send(form);
  });
}

export const retrieval = (path: string) => `/api/retrieval/v1${path}`;
export const trainer = (path: string) => `/api/trainer/v1${path}`;
export const inference = (path: string) => `/api/inference/v1${path}`;

export function enc(segment: string): string {
  return encodeURIComponent(segment);
}

export function wsUrl(path: string): string {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}${path}`;
}
