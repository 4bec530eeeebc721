// What the sidecar's pages share: DOM helpers, the API call with its errors in words, the
// token kept in this tab's sessionStorage, approve / reject, and the refresh loop. Every text
// from the API goes in through textContent (never innerHTML).

export const TOKEN_KEY = "seedance.token";
export const ACTOR_KEY = "seedance.actor";
export const REFRESH_MS = 5000;

export const $ = (id) => document.getElementById(id);

// ---- small DOM helpers ---------------------------------------------------------------------

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function fmt(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "string") return value;
  if (typeof value === "boolean") return value ? "true" : "false";
  if (typeof value !== "number") return JSON.stringify(value);
  if (!Number.isFinite(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return value.toExponential(3);
  return Number(value.toPrecision(4)).toString();
}

export const pct = (x) => (typeof x === "number" && Number.isFinite(x)
  ? `${x >= 0 ? "+" : ""}${(100 * x).toFixed(2)}%` : "–");

// Times carry their zone: an on-call engineer and the job may be continents apart.
export function when(seconds) {
  if (typeof seconds !== "number") return "–";
  return new Date(seconds * 1000).toLocaleString(undefined,
                                                 { hour12: false, timeZoneName: "short" });
}

export function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString(undefined,
                                                     { hour12: false, timeZoneName: "short" });
}

export function listOf(body, key) {
  if (Array.isArray(body)) return body;
  if (body && Array.isArray(body[key])) return body[key];
  return [];
}

// ---- the API -------------------------------------------------------------------------------

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export function explain(status, detail) {
  if (status === 401) return "Token missing: enter the API token above and try again.";
  if (status === 403) return "Token wrong: the sidecar refused this token. Check it and retry.";
  if (status === 404) return `Not found: ${detail || "the change no longer exists"}.`;
  if (status === 409) return `Refused: ${detail || "the change moved on meanwhile"}.`;
  if (status === 422) return `Refused as invalid: ${detail}`;
  if (status === 502) return `Owner unreachable: ${detail}`;
  if (status === 503) return `The sidecar is not ready: ${detail || "try again shortly"}.`;
  return `The sidecar answered ${status}: ${detail || "no detail"}.`;
}

export async function api(path, { method = "GET", body, auth = false } = {}) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (auth) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
  }
  let reply;
  try {
    reply = await fetch(path, { method, headers, cache: "no-store",
                                body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new ApiError(0, `Could not reach the sidecar (${err.message}).`);
  }
  const text = await reply.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!reply.ok) {
    let detail = data && typeof data === "object" ? data.detail : data;
    if (Array.isArray(detail)) detail = detail.map((d) => d.msg || JSON.stringify(d)).join("; ");
    throw new ApiError(reply.status, explain(reply.status, detail));
  }
  return data;
}

// ---- status text ---------------------------------------------------------------------------

export function say(target, message, kind = "info") {
  target.textContent = message;
  target.dataset.kind = kind;
}

export function table(caption, heads, rows, empty) {
  if (rows.length === 0) return h("p", { class: "muted" }, empty);
  return h("table", {}, h("caption", { class: "sr-only" }, caption),
           h("thead", {}, h("tr", {}, heads.map((x) => h("th", { scope: "col" }, x)))),
           h("tbody", {}, rows));
}

// Whether approving restarts the job, from the change's scope (a restart-scope knob is read
// only when the job starts; the sidecar never restarts a job itself).
export function applyText(change) {
  return change.scope === "restart"
    ? "Needs a restart: approving does not restart the job; the running job ignores this "
      + "change until it is next started."
    : "Applied live: approving switches the job at its next step boundary, without a "
      + "restart, and rolls it back if it measures worse.";
}

// Keeps one card per item in `holder`, in the items' order, building only new ones: typing,
// an open "Show events" and a loaded plot survive the refresh.
export function syncCards(holder, cards, items, { key = (item) => item.id, build, update,
  empty }) {
  const ids = new Set(items.map(key));
  for (const [id, card] of cards) {
    if (!ids.has(id)) { card.remove(); cards.delete(id); }
  }
  if (items.length === 0) {
    holder.replaceChildren(h("p", { class: "muted" }, empty));
    return;
  }
  holder.querySelector(":scope > p.muted")?.remove();
  for (const item of items) {
    let card = cards.get(key(item));
    if (!card) {
      card = build(item);
      cards.set(key(item), card);
    } else if (update) {
      update(card, item);
    }
    holder.append(card);  // moves existing cards into order without rebuilding them
  }
}

export function describe(change) {
  return Object.entries(change.values || {})
    .map(([k, v]) => `${k}: ${fmt((change.baseline || {})[k])} → ${fmt(v)}`).join(", ");
}

// ---- approve / reject ----------------------------------------------------------------------

export async function decide(change, verb, card, { base = "/v1/changes", after }) {
  const status = card.querySelector(".card-status");
  const actor = ($("actor").value || "").trim();
  const note = card.querySelector(`textarea[name="note"]`).value.trim();
  if (!actor) {
    say(status, "Enter your name under “Who approves” first.", "error");
    $("actor").focus();
    return;
  }
  if (verb === "reject" && !note) {
    say(status, "Give a reason in the comment box to reject.", "error");
    card.querySelector("textarea").focus();
    return;
  }
  if (verb === "approve" && change.risk === "high" && !window.confirm(
    `Approve a HIGH-RISK change?\n\n${change.job}: ${describe(change)}\n\n${applyText(change)}`)) {
    say(status, "Not approved: cancelled at the high-risk confirmation.");
    return;
  }
  const body = verb === "approve" ? { by: actor, comment: note } : { by: actor, reason: note };
  for (const b of card.querySelectorAll("button")) b.disabled = true;
  say(status, `Sending ${verb}…`);
  try {
    const moved = await api(`${base}/${encodeURIComponent(change.id)}/${verb}`,
                            { method: "POST", body, auth: true });
    const state = (moved && (moved.state || (moved.change && moved.change.state))) || "updated";
    // A fleet page's decision is made by the sidecar that holds the job: say which.
    const where = moved && moved.routed_to ? ` on sidecar ${moved.routed_to.sidecar_id}` : "";
    const message = `Change ${change.id} ${verb === "approve" ? "approved" : "rejected"} `
      + `by ${actor}${where}; it is now ${state}.`;
    say(status, message, "ok");
    say($("status"), message, "ok");
    await after();
  } catch (err) {
    say(status, err.message, "error");
    say($("status"), `Change ${change.id}: ${err.message}`, "error");
    for (const b of card.querySelectorAll("button")) b.disabled = false;
  }
}

export function setUpToken() {
  const token = $("token");
  const actor = $("actor");
  token.value = sessionStorage.getItem(TOKEN_KEY) || "";
  actor.value = sessionStorage.getItem(ACTOR_KEY) || "";
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = token.value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
    if (actor.value.trim()) sessionStorage.setItem(ACTOR_KEY, actor.value.trim());
    say($("status"), value ? "Token saved for this tab." : "No token: approve and reject will "
        + "be refused.", value ? "ok" : "error");
  });
  // Typing is enough: a token typed but not submitted is still the one used.
  token.addEventListener("input", () => {
    const value = token.value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  });
  actor.addEventListener("input", () => sessionStorage.setItem(ACTOR_KEY, actor.value.trim()));
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    token.value = "";
    say($("status"), "Token forgotten.", "info");
    token.focus();
  });
}


export function startRefreshing(refresh) {
  $("refresh").addEventListener("click", () => refresh());
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);
}
