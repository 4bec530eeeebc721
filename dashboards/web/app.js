// The on-call page: reads the sidecar's JSON API, draws each change's measured effect (its
// metric with the candidate / baseline windows) as inline SVG on every card, pending, in
// progress and finished, and sends approve / reject (common.js) with the token kept in this
// tab's sessionStorage. Every text from the API goes in through textContent (never innerHTML).

import {
  $, REFRESH_MS, api, applyText, clock, decide, describe, fmt, h, listOf, pct, setUpToken,
  startRefreshing, syncCards, table, when,
} from "./common.js";

const FINAL = new Set(["kept", "rolled_back", "rejected", "expired", "failed",
  "manual_intervention_required"]);
const IN_FLIGHT = new Set(["approved", "applying", "observing"]);
const SVG = "http://www.w3.org/2000/svg";
const PLOT = { width: 420, height: 140, left: 56, right: 8, top: 10, bottom: 22 };
const COLOURS = ["#1f5fa8", "#b35900", "#2e7d32", "#7b1fa2", "#c62828", "#00838f"];

const HISTORY = 20;  // finished changes shown, newest first
// change id -> card element per section, kept across refreshes (typing, open events, plots)
const cards = { pending: new Map(), inflight: new Map(), history: new Map() };
let offlineSince = null;  // when the sidecar stopped answering (s), null while it answers
let lastGood = null;  // when it last answered (s)

// ---- small DOM helpers ---------------------------------------------------------------------

function s(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// ---- the evidence plot ---------------------------------------------------------------------

function drawPlot(data) {
  const lines = (data.series || []).map((line) => ({
    label: line.label, points: line.points.filter((p) => p[1] !== null),
  })).filter((line) => line.points.length > 0);
  const unit = data.unit && data.unit !== "1" ? ` ${data.unit}` : "";
  const title = `${data.metric}${unit}`;
  if (lines.length === 0) {
    return h("p", { class: "muted plot-empty" },
             `No points of ${data.metric} for job ${data.job} around this change yet.`);
  }
  const all = lines.flatMap((l) => l.points);
  const ts = all.map((p) => p[0]);
  const vs = all.map((p) => p[1]);
  const marks = (data.marks || []).map((m) => m.t_s)
    .filter((t) => t >= data.since_s && t <= data.until_s);
  // The axis spans the data and the proposal, not the whole lookback: a young job's minute
  // of points fills the plot instead of a sliver at its right edge.
  const t0 = Math.min(...ts, ...marks);
  const t1 = Math.max(...ts, ...marks, t0 + 1);
  let v0 = Math.min(...vs);
  let v1 = Math.max(...vs);
  if (v0 === v1) { v0 -= Math.abs(v0) * 0.05 || 1; v1 += Math.abs(v1) * 0.05 || 1; }
  const W = PLOT.width - PLOT.left - PLOT.right;
  const H = PLOT.height - PLOT.top - PLOT.bottom;
  const x = (t) => PLOT.left + ((t - t0) / (t1 - t0)) * W;
  const y = (v) => PLOT.top + (1 - (v - v0) / (v1 - v0)) * H;
  const last = lines[0].points[lines[0].points.length - 1][1];
  const summary = `${title} for job ${data.job}: ${all.length} points, min ${fmt(Math.min(...vs))}`
    + `, max ${fmt(Math.max(...vs))}, latest ${fmt(last)}`
    + (data.metric_from === "default" ? " (the job's throughput; the change named no metric)" : "");
  const svg = s("svg", { viewBox: `0 0 ${PLOT.width} ${PLOT.height}`, role: "img",
                         class: "plot", "aria-label": summary },
                s("title", {}, summary));
  svg.append(s("rect", { x: PLOT.left, y: PLOT.top, width: W, height: H, class: "plot-bg" }));
  // Each window shaded, and the mean of its points drawn across it: the effect at a glance.
  const means = [];
  for (const w of data.windows || []) {
    const a = Math.max(x(w.start_s), PLOT.left);
    const b = Math.min(x(w.end_s), PLOT.left + W);
    if (b <= a) continue;
    const name = `${w.arm} window, config v${w.version}${w.running ? " (running)" : ""}`;
    svg.append(s("rect", { x: a, y: PLOT.top, width: b - a, height: H,
                           class: `window window-${w.arm}${w.running ? " window-running" : ""}` },
                 s("title", {}, name)));
    const inside = all.filter((p) => p[0] >= w.start_s && p[0] <= w.end_s).map((p) => p[1]);
    if (inside.length === 0) continue;
    const mean = inside.reduce((sum, v) => sum + v, 0) / inside.length;
    means.push({ arm: w.arm, version: w.version, mean });
    svg.append(s("line", { x1: a, x2: b, y1: y(mean), y2: y(mean),
                           class: `window-mean window-mean-${w.arm}` },
                 s("title", {}, `${name}: mean ${fmt(mean)}${unit}`)));
  }
  for (const mark of data.marks || []) {
    if (mark.t_s < t0 || mark.t_s > t1) continue;
    svg.append(s("line", { x1: x(mark.t_s), x2: x(mark.t_s), y1: PLOT.top, y2: PLOT.top + H,
                           class: "mark" }, s("title", {}, `${mark.label} ${when(mark.t_s)}`)));
  }
  lines.forEach((line, i) => {
    const d = line.points.map((p, j) => `${j ? "L" : "M"}${x(p[0]).toFixed(1)},`
                                        + `${y(p[1]).toFixed(1)}`).join("");
    svg.append(s("path", { d, class: "line", stroke: COLOURS[i % COLOURS.length] },
                 s("title", {}, line.label)));
  });
  const axis = (text, ax, ay, anchor) => svg.append(
    s("text", { x: ax, y: ay, "text-anchor": anchor, class: "axis" }, text));
  axis(fmt(v1), PLOT.left - 4, PLOT.top + 9, "end");
  axis(fmt(v0), PLOT.left - 4, PLOT.top + H, "end");
  axis(clock(t0), PLOT.left, PLOT.height - 6, "start");
  axis(clock(t1), PLOT.left + W, PLOT.height - 6, "end");
  const legend = lines.length > 1 || (data.windows || []).length
    ? h("p", { class: "legend muted" },
        lines.map((l, i) => h("span", { class: "key" },
                              h("span", { class: `swatch swatch-${i % COLOURS.length}` }),
                              l.label)),
        (data.windows || []).length ? " Shaded: candidate (orange) and baseline (blue) windows;"
          + " the flat line in each is its mean." : "")
    : null;
  const marked = (data.marks || []).map((m) => m.label).join(", ");
  return h("figure", { class: "plot-figure" }, svg,
           h("figcaption", {}, title, ` around the change (dashed: ${marked})`),
           means.length ? h("p", { class: "window-means" }, "Window means: ", means.map((m) =>
             `${m.arm} v${m.version} ${fmt(m.mean)}${unit}`).join("; "), ".") : null,
           legend);
}

async function loadPlot(change, holder) {
  try {
    const data = await api(`/v1/changes/${encodeURIComponent(change.id)}/series`);
    holder.replaceChildren(drawPlot(data));
    holder.dataset.loaded = "true";
  } catch (err) {
    // The sidecar gone is said once, by the page's banner: the last plot stays as it was.
    if (err.status === 0) {
      if (!holder.dataset.loaded) {
        holder.replaceChildren(h("p", { class: "muted" }, "The plot waits for the sidecar."));
      }
      return;
    }
    holder.replaceChildren(h("p", { class: "error" }, `Plot unavailable: ${err.message}`));
  }
}

// ---- pieces of a change --------------------------------------------------------------------

function valuesTable(change) {
  const rows = Object.keys(change.values || {}).sort().map((knob) => h("tr", {},
    h("th", { scope: "row" }, knob),
    h("td", {}, fmt((change.baseline || {})[knob])),
    h("td", {}, fmt(change.values[knob]))));
  return h("table", { class: "values" },
           h("caption", {}, "What it changes"),
           h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "knob"),
                            h("th", { scope: "col" }, "now (baseline)"),
                            h("th", { scope: "col" }, "proposed"))),
           h("tbody", {}, rows));
}

function findingEvidence(finding) {
  const ev = finding.evidence || {};
  const thresholds = new Map((ev.thresholds || []).map((t) => [t.measurement, t]));
  const unit = (u) => (u && u !== "1" ? ` ${u}` : "");
  const rows = (ev.measurements || []).map((m) => {
    const t = thresholds.get(m.name);
    return h("tr", {}, h("th", { scope: "row" }, m.name), h("td", {}, fmt(m.value) + unit(m.unit)),
             h("td", {}, t ? `${t.comparison} ${fmt(t.value)}${unit(t.unit)}` : ""));
  });
  const where = Object.entries(finding.resource || {}).map(([k, v]) => `${k} ${v}`).join(", ");
  return h("div", { class: "evidence" },
    h("p", {}, h("span", { class: `sev sev-${finding.severity}` }, finding.severity), " ",
      h("strong", {}, finding.detector), ` on job ${finding.job}`, where ? ` (${where})` : "",
      finding.opened_at_ns ? ` since ${when(finding.opened_at_ns / 1e9)}` : ""),
    h("p", {}, ev.summary || ""),
    rows.length ? h("table", { class: "measurements" },
                    h("caption", {}, "Measured"),
                    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "measurement"),
                                     h("th", { scope: "col" }, "value"),
                                     h("th", { scope: "col" }, "threshold"))),
                    h("tbody", {}, rows)) : null,
    ev.model ? h("p", { class: "muted" }, `Judged by ${ev.model}`) : null,
    (finding.suggested_changes || []).length
      ? h("ul", { class: "suggested" }, finding.suggested_changes.map((c) => h("li", {},
          `Suggested: ${c.knob} = ${fmt(c.value)} (${c.expected_effect})`)))
      : null);
}

function effect(change) {
  const c = change.comparison;
  if (!c || !c.pairs) {
    return ["rejected", "expired"].includes(change.state) ? "never applied" : "not measured yet";
  }
  const conf = typeof c.confidence === "number" ? ` at ${Math.round(100 * c.confidence)}%` : "";
  return `${pct(c.gain)} tokens/s [${pct(c.ci_low)}, ${pct(c.ci_high)}]${conf}, `
    + `${c.pairs} pair${c.pairs === 1 ? "" : "s"}, loss ${c.loss_ok ? "on track" : "off track"}`
    + ` (${pct(c.loss_excess)})`;
}

function metaLine(change, ...more) {
  return h("p", { class: "meta" },
    h("span", { class: `risk risk-${change.risk}` }, `${change.risk} risk`), " · ",
    `${change.scope} knob · from ${change.source} · proposed ${when(change.created_at_s)}`,
    ...more, ` · id ${change.id}`);
}

function pendingCard(change, findings) {
  const plot = h("div", { class: "plot-holder" }, h("p", { class: "muted" }, "Loading plot…"));
  // The finding the proposer named, else (as the webhook message does) those open on the job.
  const findingId = change.meta && (change.meta.finding_id || change.meta.finding);
  const related = findingId ? findings.filter((f) => f.id === findingId)
    : findings.filter((f) => f.job === change.job).slice(0, 3);
  const noteId = `note-${change.id}`;
  const card = h("article", { class: "card", "data-change-id": change.id,
                              "aria-labelledby": `title-${change.id}` },
    h("h3", { id: `title-${change.id}` }, `${change.job}: ${describe(change)}`),
    metaLine(change, ` · expires ${when(change.expires_at_s)}`),
    h("p", { class: "reason" }, h("strong", {}, "Why: "), change.reason),
    h("p", { class: `applies applies-${change.scope}` }, applyText(change)),
    h("div", { class: "card-grid" },
      h("div", {},
        change.source === "trial" && change.meta && change.meta.trial !== undefined
          ? h("p", {}, `Optuna trial ${change.meta.trial} of study ${change.meta.study || "?"}.`)
          : null,
        valuesTable(change),
        related.length ? h("div", {}, h("h4", {}, findingId ? "The finding behind it"
                                          : `Findings open on ${change.job}`),
                            related.map(findingEvidence))
          : h("p", { class: "muted" }, findingId ? `Finding ${findingId} is no longer active.`
            : `No finding is open on ${change.job}.`)),
      h("div", {},
        plot,
        h("label", { for: noteId }, "Comment (required to reject)"),
        h("textarea", { id: noteId, name: "note", rows: 2 }),
        h("div", { class: "row" },
          h("button", { type: "button", class: "approve",
                        "aria-label": `Approve change ${change.id} of job ${change.job}`,
                        onclick: () => decide(change, "approve", card, { after: refresh }) },
            "Approve"),
          h("button", { type: "button", class: "reject",
                        "aria-label": `Reject change ${change.id} of job ${change.job}`,
                        onclick: () => decide(change, "reject", card, { after: refresh }) },
            "Reject")),
        h("p", { class: "card-status status", role: "status", "aria-live": "polite" }))));
  loadPlot(change, plot);
  return card;
}

function progress(change) {
  if (!IN_FLIGHT.has(change.state)) {
    const end = (change.plan && change.plan.ended_because) || "";
    return end ? ` Ended because ${end}.` : "";
  }
  const plan = change.plan || {};
  const arms = plan.arms || [];
  if (!arms.length) return " Waiting for the job.";
  return ` Window ${Number(plan.index || 0) + 1} of ${arms.length}`
    + (plan.version ? ` (v${plan.version}, ${plan.acked ? "acked" : "waiting for ack"}).` : ".");
}

// The part of a change's card that moves as the change does (rebuilt on each refresh).
function stateLines(change) {
  return [
    metaLine(change, ` · approved by ${change.approved_by || "–"}`),
    h("p", { class: "effect" }, h("span", { class: `state state-${change.state}` },
                                  change.state.replaceAll("_", " ")),
      " · measured effect: ", effect(change), ".", progress(change))];
}

function changeCard(change) {
  const plot = h("div", { class: "plot-holder" }, h("p", { class: "muted" }, "Loading plot…"));
  const holder = h("div", { class: "events-holder", id: `events-${change.id}`, hidden: true });
  const button = h("button", { type: "button", class: "link", "aria-expanded": "false",
                               "aria-controls": `events-${change.id}`,
                               "aria-label": `Show events of change ${change.id}`,
                               onclick: () => toggleEvents(change, button, holder) },
                   "Show events");
  const card = h("article", { class: "card", "data-change-id": change.id,
                              "aria-labelledby": `title-${change.id}` },
    h("h3", { id: `title-${change.id}` }, `${change.job}: ${describe(change)}`),
    h("div", { class: "card-state" }, stateLines(change)),
    IN_FLIGHT.has(change.state)
      ? h("p", { class: `applies applies-${change.scope}` }, applyText(change)) : null,
    h("div", { class: "card-grid" }, plot, h("div", {}, button, holder)));
  loadPlot(change, plot);
  return card;
}

function updateCard(card, change, { live }) {
  card.querySelector(".card-state").replaceChildren(...stateLines(change));
  if (!live) return;  // a finished change's plot and events no longer move
  loadPlot(change, card.querySelector(".plot-holder"));
  const holder = card.querySelector(".events-holder");
  if (!holder.hidden) loadEvents(change, holder);
}

// ---- sections ------------------------------------------------------------------------------

function renderPending(pending, findings) {
  $("pending-count").textContent = pending.length ? String(pending.length) : "";
  syncCards($("pending"), cards.pending, pending, {
    build: (change) => pendingCard(change, findings),
    update: (card, change) => loadPlot(change, card.querySelector(".plot-holder")),
    empty: "Nothing waits for approval." });
}

function renderInflight(changes) {
  syncCards($("inflight"), cards.inflight, changes, {
    build: changeCard, update: (card, change) => updateCard(card, change, { live: true }),
    empty: "No change is being applied or observed." });
}

function stateCell(change) {
  return h("td", {}, h("span", { class: `state state-${change.state}` },
                       change.state.replaceAll("_", " ")));
}

function renderFindings(findings) {
  const active = findings.filter((f) => f.closed_at_ns === null || f.closed_at_ns === undefined);
  $("findings").replaceChildren(active.length
    ? h("div", { class: "cards" }, active.map((f) => h("article", { class: "card finding" },
        findingEvidence(f))))
    : h("p", { class: "muted" }, "No active findings."));
}

function renderTrials(changes) {
  const trials = changes.filter((c) => c.source === "trial").slice(-20).reverse();
  const rows = trials.map((c) => h("tr", {},
    h("td", {}, when(c.created_at_s)), h("td", {}, c.job),
    h("td", {}, c.meta && c.meta.trial !== undefined ? `#${c.meta.trial}` : "–"),
    h("td", {}, describe(c)), stateCell(c), h("td", {}, effect(c))));
  $("trials").replaceChildren(table("Recent trials",
    ["proposed", "job", "trial", "config", "state", "measured effect"], rows,
    "No trials yet."));
}

async function loadEvents(change, holder) {
  try {
    const body = await api(`/v1/changes/${encodeURIComponent(change.id)}`);
    const events = listOf(body, "events");
    holder.replaceChildren(events.length ? h("ol", { class: "events" }, events.map((e) =>
      h("li", {}, `${when(e.at_ns / 1e9)} · ${e.kind}`,
        e.from_state || e.to_state ? ` (${e.from_state || "–"} → ${e.to_state || "–"})` : "",
        ` by ${e.actor}: ${e.reason}`,
        e.version_after !== null && e.version_after !== undefined
          ? ` [v${e.version_before ?? "–"} → v${e.version_after}]` : "")))
      : h("p", { class: "muted" }, "No events recorded."));
  } catch (err) {
    if (err.status !== 0) holder.replaceChildren(h("p", { class: "error" }, err.message));
  }
}

function toggleEvents(change, button, holder) {
  const opening = holder.hidden;
  holder.hidden = !opening;
  button.setAttribute("aria-expanded", String(opening));
  button.setAttribute("aria-label", `${opening ? "Hide" : "Show"} events of change ${change.id}`);
  button.textContent = opening ? "Hide events" : "Show events";
  if (!opening) return;
  holder.replaceChildren(h("p", { class: "muted" }, "Loading events…"));
  loadEvents(change, holder);
}

function renderHistory(changes) {
  syncCards($("history"), cards.history, changes, {
    build: changeCard, update: (card, change) => updateCard(card, change, { live: false }),
    empty: "No finished changes yet." });
}

function renderStatus(status) {
  const node = $("sidecar-status");
  const side = (status && status.sidecar) || {};
  const parts = [`sidecar ${side.job || "?"} on ${side.listen || "?"}`
                 + (side.ready ? " (ready)" : " (not ready)")];
  for (const j of (status && status.jobs) || []) {
    let text = `job ${j.job}: ${j.state}`;
    if (j.acked_version) text += `, runs v${j.acked_version}`;
    if (j.mode) text += `, approval ${j.mode}`;
    if (j.tuning && j.tuning !== "off") text += `, tuning ${j.tuning}`;
    if (j.change) text += `, change ${j.change.id} ${j.change.state}`;
    parts.push(text);
  }
  const waiting = ((status && status.waiting) || []).length;
  parts.push(waiting ? `${waiting} waiting for approval` : "nothing waiting");
  const hook = status && status.webhook;
  if (hook && hook.configured) parts.push("webhook on");
  node.textContent = parts.join(" · ");
}

// ---- refresh loop --------------------------------------------------------------------------

// The sidecar gone (the network refused, not an HTTP error): one banner, and the page keeps the
// last state it was shown instead of an error in every section.
function gone() {
  offlineSince ??= Date.now() / 1000;
  const banner = $("offline");
  banner.textContent = `The sidecar is not answering (since ${clock(offlineSince)}). `
    + (lastGood === null ? "Nothing was loaded yet. "
      : `This page shows what it said at ${clock(lastGood)}. `)
    + `Trying again every ${REFRESH_MS / 1000} s.`;
  banner.hidden = false;
}

function answered() {
  offlineSince = null;
  lastGood = Date.now() / 1000;
  $("offline").hidden = true;
}

let refreshing = null;

async function refresh() {
  if (refreshing) return refreshing;
  refreshing = (async () => {
    const [status, changes, findings] = await Promise.allSettled(
      [api("/v1/status"), api("/v1/changes"), api("/v1/findings")]);
    if ([status, changes, findings].some((r) => r.status === "rejected" && r.reason.status === 0)) {
      gone();
      return;
    }
    answered();
    if (status.status === "fulfilled") renderStatus(status.value);
    else $("sidecar-status").textContent = `Status: ${status.reason.message}`;
    const found = findings.status === "fulfilled" ? listOf(findings.value, "findings") : [];
    if (findings.status === "rejected") {
      $("findings").replaceChildren(h("p", { class: "error" }, findings.reason.message));
    } else {
      renderFindings(found);
    }
    if (changes.status === "fulfilled") {
      const all = listOf(changes.value, "changes")
        .sort((a, b) => a.created_at_s - b.created_at_s);
      renderPending(all.filter((c) => c.state === "proposed"), found);
      renderInflight(all.filter((c) => IN_FLIGHT.has(c.state)));
      renderTrials(all);
      renderHistory(all.filter((c) => FINAL.has(c.state)).slice(-HISTORY).reverse());
    } else {
      for (const id of ["pending", "inflight", "trials", "history"]) {
        $(id).replaceChildren(h("p", { class: "error" }, changes.reason.message));
      }
    }
    $("refreshed").textContent = `Refreshed ${clock(lastGood)}; every ${REFRESH_MS / 1000} s.`;
  })().finally(() => { refreshing = null; });
  return refreshing;
}

setUpToken();
startRefreshing(refresh);
