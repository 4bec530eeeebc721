// The fleet page: every job of the sidecars that share this sidecar's state database, from
// GET /v1/fleet, and the changes waiting for a person, approved or rejected through
// POST /v1/fleet/changes/{id}/approve | reject: this sidecar routes each to the job's owner.

import {
  $, REFRESH_MS, api, applyText, clock, decide, describe, fmt, h, pct, setUpToken,
  startRefreshing, syncCards, table, when,
} from "./common.js";

const cards = new Map();  // change id -> card element, kept so typing survives refresh

function aliveCell(owner) {
  if (owner.alive) return h("td", {}, h("span", { class: "state state-kept" }, "alive"));
  const age = owner.heartbeat_age_s === null ? "left the fleet"
    : `silent ${Math.round(owner.heartbeat_age_s)} s`;
  return h("td", {}, h("span", { class: "state state-failed" }, "down"), ` (${age})`);
}

function ownerText(owner, me) {
  return `${owner.sidecar_id}${owner.sidecar_id === me ? " (this sidecar)" : ""}`
    + (owner.url ? ` at ${owner.url}` : "");
}

function keptText(job) {
  const kept = job.kept_config;
  if (!kept) return "–";
  return `v${kept.version}: ` + Object.keys(kept.values).sort()
    .map((k) => `${k}=${fmt(kept.values[k])}`).join(", ");
}

function gainText(job) {
  if (job.kept_gain === null) return "none kept";
  const n = job.kept_changes.length;
  return `${pct(job.kept_gain)} (${n} kept change${n === 1 ? "" : "s"})`;
}

function renderJobs(view) {
  const rows = view.jobs.map((job) => h("tr", { "data-job": job.job },
    h("th", { scope: "row" }, job.job), h("td", {}, job.kind),
    h("td", {}, ownerText(job.owner, view.me)), aliveCell(job.owner),
    h("td", {}, keptText(job)), h("td", {}, gainText(job)),
    h("td", {}, job.findings.length
      ? job.findings.map((f) => `${f.detector} (${f.severity})`).join(", ") : "none"),
    h("td", {}, job.waiting.length ? String(job.waiting.length) : "none")));
  $("jobs").replaceChildren(table("Jobs of the fleet",
    ["job", "kind", "owner", "alive", "kept config", "gain kept", "open findings", "waiting"],
    rows, "No job has attached to a sidecar of this fleet yet."));
}

function waitingCard(change, job, me) {
  const noteId = `note-${change.id}`;
  const card = h("article", { class: "card", "data-change-id": change.id,
                              "aria-labelledby": `title-${change.id}` },
    h("h3", { id: `title-${change.id}` }, `${change.job}: ${describe(change)}`),
    h("p", { class: "meta" },
      h("span", { class: `risk risk-${change.risk}` }, `${change.risk} risk`), " · ",
      `${change.scope} knob · from ${change.source} · proposed ${when(change.created_at_s)}`
      + ` · id ${change.id}`),
    h("p", { class: "owner" }, `Held by sidecar ${ownerText(job.owner, me)}`,
      job.owner.alive ? "" : " — DOWN: a decision cannot reach it"),
    h("p", { class: `applies applies-${change.scope}` }, applyText(change)),
    h("p", { class: "reason" }, h("strong", {}, "Why: "), change.reason),
    h("label", { for: noteId }, "Comment (required to reject)"),
    h("textarea", { id: noteId, name: "note", rows: 2 }),
    h("div", { class: "row" },
      h("button", { type: "button", class: "approve",
                    "aria-label": `Approve change ${change.id} of job ${change.job}`,
                    onclick: () => decide(change, "approve", card,
                                          { base: "/v1/fleet/changes", after: refresh }) },
        "Approve"),
      h("button", { type: "button", class: "reject",
                    "aria-label": `Reject change ${change.id} of job ${change.job}`,
                    onclick: () => decide(change, "reject", card,
                                          { base: "/v1/fleet/changes", after: refresh }) },
        "Reject")),
    h("p", { class: "card-status status", role: "status", "aria-live": "polite" }));
  return card;
}

function renderWaiting(view) {
  const waiting = view.jobs.flatMap((job) => job.waiting.map((change) => [change, job]));
  $("waiting-count").textContent = waiting.length ? String(waiting.length) : "";
  syncCards($("waiting"), cards, waiting, {
    key: ([change]) => change.id, build: ([change, job]) => waitingCard(change, job, view.me),
    empty: "Nothing waits for a person." });
}

function renderSidecars(view) {
  const rows = view.sidecars.map((s) => h("tr", {},
    h("th", { scope: "row" }, s.sidecar_id + (s.sidecar_id === view.me ? " (this one)" : "")),
    h("td", {}, s.url), h("td", {}, `${s.host} pid ${s.pid}`),
    h("td", {}, when(s.started_at_s)), aliveCell(s)));
  $("sidecars").replaceChildren(table("Sidecars of the fleet",
    ["sidecar", "URL", "where", "started", "alive"], rows, "No sidecar registered."));
}

let refreshing = null;

async function refresh() {
  if (refreshing) return refreshing;
  refreshing = (async () => {
    try {
      const view = await api("/v1/fleet");
      const alive = view.sidecars.filter((s) => s.alive).length;
      $("fleet-status").textContent = `${view.jobs.length} jobs on ${view.sidecars.length} `
        + `sidecars, ${alive} alive (silent for ${fmt(view.stale_after_s)} s counts as down); `
        + `this page is served by sidecar ${view.me}.`;
      renderJobs(view);
      renderWaiting(view);
      renderSidecars(view);
    } catch (err) {
      $("fleet-status").textContent = `Fleet: ${err.message}`;
    }
    $("refreshed").textContent = `Refreshed ${clock(Date.now() / 1000)}; `
      + `every ${REFRESH_MS / 1000} s.`;
  })().finally(() => { refreshing = null; });
  return refreshing;
}

setUpToken();
startRefreshing(refresh);
