"""The HTML report: the plot, the incidents with wall-clock times and evidence, the actions and acks.

One self-contained file (the PNG inlined as base64), readable offline and
attachable to a ticket. Every text from the records is escaped.
"""

from __future__ import annotations

import base64
import html
import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spikeguard.reporting.goodput import Goodput
    from spikeguard.reporting.timeline import Timeline

SHOWN_IDS = 40  # sample ids written out per skip window (the record has them all)
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1250px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } .critical { color: #b00; font-weight: bold; } .high { color: #d60; }
.muted { color: #777; } img { max-width: 100%; border: 1px solid #ddd; }
"""


def _when(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _versus(loss: float | None, baseline: float | None) -> str:
    """How far the loss is from its baseline: a ratio for a positive loss, a difference for one
    that has gone below zero (no ratio of it means anything)."""
    if loss is None or not baseline or not math.isfinite(loss):
        return ""
    if baseline > 0.0 and loss >= 0.0:
        return f" ({loss / baseline:.1f}x)"
    return f" ({loss - baseline:+.3g})"


def _e(text: object) -> str:
    return html.escape(str(text))


def _layers(moves: list[dict]) -> str:
    if not moves:
        return "<span class='muted'>none stood out</span>"
    return "<br>".join(
        f"{_e(m['layer'])}: share {m['baseline_share']:.0%} &rarr; {m['peak_share']:.0%}"
        + (f", norm x{m['norm_ratio']:.3g}" if m.get("norm_ratio") else "")
        + f" <span class='muted'>({m['steps_before_onset']} step(s) before onset)</span>"
        for m in moves[:3]
    )


def _samples(found: dict | None) -> str:
    if not found:
        return "<span class='muted'>no record (report --incidents DIR)</span>"
    text = (
        f"{found['samples']} sample ids of {found['batches']} batches, checkpoint of step "
        f"{found['checkpoint_step']}: <code>{_e(found['record'])}</code>"
    )
    if found["top"]:
        text += "<br>top offenders (spikeguard inspect): " + ", ".join(
            f"{_e(row['sample_id'])} (score {row['score']})" for row in found["top"]
        )
    else:
        text += "<br><span class='muted'>rank them: spikeguard inspect RECORD --setup MODULE:FUNCTION</span>"
    return text


def _goodput(g: "Goodput") -> str:
    reasons = ", ".join(f"{_e(reason)} {n}" for reason, n in g.updates_skipped_by_reason.items())
    return (
        "<h2>Goodput</h2><table><tr><th>goodput</th><th>steps kept</th><th>steps re-run</th>"
        "<th>batches skipped</th><th>updates skipped</th><th>wall time in recovery</th></tr>"
        f"<tr><td>{g.ratio:.1%}</td><td>{g.steps_kept}</td><td>{g.steps_rerun}</td>"
        f"<td>{g.batches_skipped}</td><td>{g.updates_skipped}</td><td>{g.recovery_seconds:.1f} s</td>"
        "</tr></table><p class='muted'>Goodput: steps kept with their update applied, over all "
        "steps run. Badput: steps re-run after rollbacks, updates skipped"
        f"{' (' + reasons + ')' if reasons else ''}, and the wall time the re-runs took; batches "
        "skipped are data the run did not train on (steps' worth).</p>"
    )


def render(timeline: "Timeline", png_path: str | None = None) -> str:
    t = timeline
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>spikeguard report: {_e(t.run_id)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>spikeguard report: run {_e(t.run_id)}</h1>",
    ]
    reruns = sum(p.rerun for p in t.steps)
    start = t.steps[0].time if t.steps else None
    end = t.steps[-1].time if t.steps else None
    parts.append(
        f"<p>{len(t.steps)} steps recorded from {_e(_when(start))} to {_e(_when(end))}, "
        f"epochs {', '.join(map(str, t.epochs)) or '0'} ({reruns} re-run after rollbacks); "
        f"{len(t.incidents)} incident(s), {len(t.actions)} action(s), {len(t.rollbacks)} "
        f"rollback(s), {t.checkpoints} checkpoint(s).</p>"
    )
    if t.goodput is not None:
        parts.append(_goodput(t.goodput))
    if png_path:
        with open(png_path, "rb") as handle:
            data = base64.b64encode(handle.read()).decode()
        parts.append(
            f"<img alt='loss and gradient norm of run {_e(t.run_id)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    parts.append("<h2>Incidents</h2>")
    if not t.incidents:
        parts.append("<p class='muted'>No incident: every step was judged normal.</p>")
    else:
        parts.append(
            "<table><tr><th>onset (wall clock)</th><th>steps</th><th>epoch</th>"
            "<th>type</th><th>urgency</th><th>loss vs baseline</th><th>detectors</th>"
            "<th>rules</th><th>critical</th><th>layers that moved first</th><th>samples</th></tr>"
        )
        for i in t.incidents:
            ratio = _versus(i.loss, i.baseline)
            said = (
                "<br>".join(
                    f"{_e(name)}: {'<b>anomaly</b>' if v['anomaly'] else 'normal'} "
                    f"{_e(v['type'])} {v['confidence']:.2f}"
                    + (
                        f" <span class='muted'>{_e(v['message'])}</span>"
                        if v.get("message")
                        else ""
                    )
                    for name, v in sorted(i.detectors.items())
                )
                or "<span class='muted'>no verdicts recorded</span>"
            )
            parts.append(
                f"<tr><td>{_e(_when(i.time))}</td><td>{i.onset_step}"
                f"{'' if i.last_step == i.onset_step else f'&ndash;{i.last_step}'}"
                f" ({i.decisions} decision(s))</td><td>{i.epoch}</td><td>{_e(i.type)}</td>"
                f"<td class='{_e(i.urgency)}'>{_e(i.urgency)}</td>"
                f"<td>{_num(i.loss)} vs {_num(i.baseline)}{ratio}</td><td>{said}</td>"
                f"<td>{_e(', '.join(i.rules))}</td><td>{'yes' if i.critical else 'no'}</td>"
                f"<td>{_layers(i.layers)}</td><td>{_samples(i.samples)}</td></tr>"
            )
        parts.append(
            "</table><p class='muted'>Baseline: median of the finite losses of the "
            "20 steps before the onset. Layers: a layer's squared share of the gradient norm that "
            "rose by 0.1 or more while its own norm left its range (robust z &ge; 6 against "
            "the 50 steps before), earliest first.</p>"
        )
    if t.reruns:
        transient = [f"{s} (epoch {e})" for s, e, r in t.reruns if r == "transient"]
        reproducible = [f"{s} (epoch {e})" for s, e, r in t.reruns if r == "reproducible"]
        parts.append(
            "<h2>Re-run steps</h2><p>The Guard re-ran suspicious steps once from the same state "
            "(verify_reruns). <b>Transient</b> (the re-run differed: suspect the device; the re-run's "
            "update applied when its own values were clean, else skipped; no rollback): "
            f"{len(transient)}{': steps ' + _e(', '.join(transient)) if transient else ''}. "
            f"Reproducible (the data or the optimisation; the policy applied): {len(reproducible)}"
            f"{': steps ' + _e(', '.join(reproducible)) if reproducible else ''}.</p>"
        )
    parts.append("<h2>What the trainer did</h2>")
    if not t.actions:
        parts.append("<p class='muted'>No action was sent.</p>")
    else:
        parts.append(
            "<table><tr><th>action</th><th>for step</th><th>parameters</th><th>reason</th>"
            "<th>ack</th><th>at step</th><th>epoch after</th><th>acked at</th>"
            "<th>result</th></tr>"
        )
        for a in t.actions:
            params = ", ".join(f"{_e(k)}={_e(v)}" for k, v in sorted(a.params.items()))
            if a.skipped_samples is not None:
                shown = ", ".join(map(_e, a.skipped_samples[:SHOWN_IDS]))
                more = len(a.skipped_samples) - SHOWN_IDS
                params += (
                    f"<br>samples of the window's steps (incident record): "
                    f"{len(a.skipped_samples)}: {shown}{f', ... {more} more' if more > 0 else ''}"
                )
            parts.append(
                f"<tr><td>{_e(a.kind)}</td><td>{a.apply_at_step}</td><td>{params}</td>"
                f"<td>{_e(a.reason)}</td><td>{_e(a.ack_status)}</td>"
                f"<td>{'' if a.ack_step is None else a.ack_step}</td>"
                f"<td>{'' if a.ack_epoch is None else a.ack_epoch}</td>"
                f"<td>{_e(_when(a.ack_time)) if a.ack_time else ''}</td><td>{_e(a.result)}</td></tr>"
            )
        parts.append("</table>")
    if t.rollbacks:
        parts.append("<h2>Rollbacks</h2><ul>")
        for start, target, epoch in t.rollbacks:
            parts.append(
                f"<li>at step {start}: back to the checkpoint of step {target}; steps "
                f"from {target} on re-run in epoch {epoch}</li>"
            )
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(timeline: "Timeline", path: str, png_path: str | None = None) -> None:
    with open(path, "w", encoding="utf-8") as out:
        out.write(render(timeline, png_path))
