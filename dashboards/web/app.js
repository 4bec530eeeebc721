// The on-call page: reads the sidecar's JSON API, draws each pending change's evidence plot as
// inline SVG, and sends approve / reject (common.js) with the token kept in this tab's
// sessionStorage. Every text from the API goes in through textContent (never innerHTML).

import {
  $, REFRESH_MS, api, decide, describe, fmt, h, listOf, pct, setUpToken, startRefreshing, table,
  when,
} from "./common.js";

const FINAL = new Set(["kept", "rolled_back", "rejected", "expired", "failed",
  "manual_intervention_required"]);
const IN_FLIGHT = new Set(["approved", "applying", "observing"]);
const SVG = "http://www.w3.org/2000/svg";
const PLOT = { width: 420, height: 140, left: 56, right: 8, top: 10, bottom: 22 };
const COLOURS = ["#1f5fa8", "#b35900", "#2e7d32", "#7b1fa2", "#c62828", "#00838f"];

const pendingCards = new Map();  // change id -> card element, kept so typing survives refresh

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
  for (const w of data.windows || []) {
    const a = Math.max(x(w.start_s), PLOT.left);
    const b = Math.min(x(w.end_s), PLOT.left + W);
    if (b > a) {
      svg.append(s("rect", { x: a, y: PLOT.top, width: b - a, height: H,
                             class: `window window-${w.arm}` },
                   s("title", {}, `${w.arm} window, config v${w.version}`)));
    }
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
  axis(new Date(t0 * 1000).toLocaleTimeString(undefined, { hour12: false }),
       PLOT.left, PLOT.height - 6, "start");
  axis(new Date(t1 * 1000).toLocaleTimeString(undefined, { hour12: false }),
       PLOT.left + W, PLOT.height - 6, "end");
  const legend = lines.length > 1 || (data.windows || []).length
    ? h("p", { class: "legend muted" },
        lines.map((l, i) => h("span", { class: "key", style: null },
                              h("span", { class: `swatch swatch-${i % COLOURS.length}` }),
                              l.label)),
        (data.windows || []).length ? " Shaded: candidate (orange) and baseline (blue) windows."
          : "")
    : null;
  return h("figure", { class: "plot-figure" }, svg,
           h("figcaption", {}, title, " around the proposal (line: proposed)"), legend);
}

async function loadPlot(change, holder) {
  try {
    const data = await api(`/v1/changes/${encodeURIComponent(change.id)}/series`);
    holder.replaceChildren(drawPlot(data));
  } catch (err) {
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
    h("p", { class: "meta" },
      h("span", { class: `risk risk-${change.risk}` }, `${change.risk} risk`), " · ",
      `${change.scope} knob · from ${change.source} · proposed ${when(change.created_at_s)}`
      + ` · expires ${when(change.expires_at_s)} · id ${change.id}`),
    h("p", { class: "reason" }, h("strong", {}, "Why: "), change.reason),
    change.source === "trial" && change.meta && change.meta.trial !== undefined
      ? h("p", {}, `Optuna trial ${change.meta.trial} of study ${change.meta.study || "?"}.`)
      : null,
    related.length ? h("div", {}, h("h4", {}, findingId ? "The finding behind it"
                                      : `Findings open on ${change.job}`),
                        related.map(findingEvidence))
      : h("p", { class: "muted" }, findingId ? `Finding ${findingId} is no longer active.`
        : `No finding is open on ${change.job}.`),
    valuesTable(change),
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
    h("p", { class: "card-status status", role: "status", "aria-live": "polite" }));
  loadPlot(change, plot);
  return card;
}

// ---- sections ------------------------------------------------------------------------------

function renderPending(pending, findings) {
  const holder = $("pending");
  $("pending-count").textContent = pending.length ? String(pending.length) : "";
  const ids = new Set(pending.map((c) => c.id));
  for (const [id, card] of pendingCards) {
    if (!ids.has(id)) { card.remove(); pendingCards.delete(id); }
  }
  if (pending.length === 0) {
    holder.replaceChildren(h("p", { class: "muted" }, "Nothing waits for approval."));
    return;
  }
  holder.querySelector(":scope > p.muted")?.remove();
  for (const change of pending) {
    let card = pendingCards.get(change.id);
    if (!card) {
      card = pendingCard(change, findings);
      pendingCards.set(change.id, card);
    } else {
      loadPlot(change, card.querySelector(".plot-holder"));
    }
    holder.append(card);  // moves existing cards into order without rebuilding them
  }
}

function stateCell(change) {
  return h("td", {}, h("span", { class: `state state-${change.state}` },
                       change.state.replace("_", " ")));
}

function renderInflight(changes) {
  const rows = changes.map((c) => {
    const plan = c.plan || {};
    const arms = plan.arms || [];
    const progress = arms.length ? `window ${Number(plan.index || 0) + 1} of ${arms.length}`
      + (plan.version ? ` (v${plan.version}${plan.acked ? ", acked" : ", waiting for ack"})` : "")
      : "waiting for the job";
    return h("tr", {}, h("td", {}, c.job), h("td", {}, describe(c)), stateCell(c),
             h("td", {}, progress), h("td", {}, effect(c)), h("td", {}, c.approved_by || "–"));
  });
  $("inflight").replaceChildren(table("Changes in progress",
    ["job", "change", "state", "progress", "measured effect", "approved by"], rows,
    "No change is being applied or observed."));
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

async function showEvents(change, button, holder) {
  if (!holder.hidden) {
    holder.hidden = true;
    button.setAttribute("aria-expanded", "false");
    button.setAttribute("aria-label", `Show events of change ${change.id}`);
    button.textContent = "Show events";
    return;
  }
  button.setAttribute("aria-expanded", "true");
  button.setAttribute("aria-label", `Hide events of change ${change.id}`);
  button.textContent = "Hide events";
  holder.hidden = false;
  holder.replaceChildren(h("p", { class: "muted" }, "Loading events…"));
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
    holder.replaceChildren(h("p", { class: "error" }, err.message));
  }
}

function renderHistory(changes) {
  const done = changes.filter((c) => FINAL.has(c.state)).slice(-50).reverse();
  const rows = done.flatMap((c) => {
    const holder = h("div", { class: "events-holder", id: `events-${c.id}`, hidden: true });
    const button = h("button", { type: "button", class: "link", "aria-expanded": "false",
                                 "aria-controls": `events-${c.id}`,
                                 "aria-label": `Show events of change ${c.id}`,
                                 onclick: () => showEvents(c, button, holder) }, "Show events");
    const end = (c.plan && c.plan.ended_because) || "";
    return [h("tr", {}, h("td", {}, when(c.created_at_s)), h("td", {}, c.job),
                h("td", {}, describe(c)), stateCell(c), h("td", {}, c.source),
                h("td", {}, c.approved_by || "–"), h("td", {}, effect(c), end ? ` · ${end}` : ""),
                h("td", {}, button)),
            h("tr", { class: "events-row" }, h("td", { colspan: 8 }, holder))];
  });
  $("history").replaceChildren(table("Change history",
    ["proposed", "job", "change", "state", "source", "approved by", "outcome", ""], rows,
    "No finished changes yet."));
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

let refreshing = null;

async function refresh() {
  if (refreshing) return refreshing;
  refreshing = (async () => {
    const [status, changes, findings] = await Promise.allSettled(
      [api("/v1/status"), api("/v1/changes"), api("/v1/findings")]);
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
      renderHistory(all);
    } else {
      for (const id of ["pending", "inflight", "trials", "history"]) {
        $(id).replaceChildren(h("p", { class: "error" }, changes.reason.message));
      }
    }
    $("refreshed").textContent = `Refreshed ${new Date().toLocaleTimeString(undefined,
      { hour12: false })}; every ${REFRESH_MS / 1000} s.`;
  })().finally(() => { refreshing = null; });
  return refreshing;
}

setUpToken();
startRefreshing(refresh);
