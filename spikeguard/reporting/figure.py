"""The run as a picture: loss and gradient norm over steps, with what happened marked.

Top: loss, the first pass in one colour and steps re-run after a rollback in
another, anomalous steps as red crosses, each incident as a shaded span,
actions as labelled triangles and rollbacks as arrows back to their target.
Middle: the gradient norm (log scale) on the same steps. Bottom: what the run
was changed to: the LR each update used (the schedule times the Guard's
factor, which LR actions change for the rest of the run) and, on the right
axis, the data skip windows dropped so far (steps' worth). Non-finite values,
which cannot be drawn, are marked at the top edge, and so are losses beyond
the axis (which stops at 1.5x the 98th percentile so that one spike does not
flatten the curve), with their value written beside them. Needs the ``[report]``
extra (matplotlib); the Agg backend draws without a display.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from spikeguard.reporting.load import ReportError

if TYPE_CHECKING:
    from spikeguard.reporting.timeline import Timeline

WIDTH_IN, HEIGHT_IN, DPI = 12, 8, 100  # 1200 x 800 pixels
FIRST, RERUN, ANOMALY, INCIDENT, ACTION, ROLLBACK, SKIPPED = (
    "#1f77b4",
    "#2ca02c",
    "#d62728",
    "#f4b6b6",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("plots need matplotlib: pip install 'spikeguard[report]'") from None
    return plt


def _segments(points):
    """Runs of consecutive steps of one epoch, re-run or not: one line each (a rollback breaks
    the line, and so does the end of the re-run: the steps after it are trained for the first time)."""
    segments, current, last = [], [], None
    for p in points:
        if last is not None and (
            p.epoch != last.epoch or p.step != last.step + 1 or p.rerun != last.rerun
        ):
            segments.append(current)
            current = []
        current.append(p)
        last = p
    if current:
        segments.append(current)
    return segments


def _ceiling(values: list[float]) -> tuple[float, float]:
    """y-limits that a 1000x spike does not flatten: up to 1.5x the 98th percentile."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return 0.0, 1.0
    lo = finite[0]
    hi = (
        min(finite[-1], finite[int(0.98 * (len(finite) - 1))] * 1.5)
        if len(finite) > 10
        else finite[-1]
    )
    hi = hi if hi > lo else lo + 1.0
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _changes(timeline: "Timeline", ax_lr, label) -> None:
    """The LR each update used, and the data skipped so far (a second y axis)."""
    for segment in _segments(timeline.steps):
        lrs = [p.lr if p.lr is not None and math.isfinite(p.lr) else float("nan") for p in segment]
        rerun = segment[0].rerun
        ax_lr.plot(
            [p.step for p in segment],
            lrs,
            color=RERUN if rerun else FIRST,
            linewidth=1.0,
            linestyle="--" if rerun else "-",
            label=label("LR used" if not rerun else "LR used, re-run"),
        )
    ax_lr.set_ylabel("LR used")
    ax_lr.grid(True, alpha=0.3)
    ax_skip = ax_lr.twinx()
    total, xs, ys = 0, [], []
    for step, _, steps in sorted(timeline.data_skips, key=lambda s: (s[1], s[0])):
        xs += [step, step]
        ys += [total, total + steps]
        total += steps
    if xs:
        last = max(p.step for p in timeline.steps) if timeline.steps else xs[-1]
        xs, ys = [min(xs[0], 0), *xs, last], [0, *ys, total]
        ax_skip.plot(
            xs,
            ys,
            color=SKIPPED,
            linewidth=1.2,
            drawstyle="steps-post",
            label="data skipped (steps' worth, total)",
        )
        ax_skip.legend(loc="upper right", fontsize=8)
    ax_skip.set_ylabel("data skipped (steps)")
    if not any(p.lr is not None for p in timeline.steps):
        ax_lr.text(
            0.5,
            0.5,
            "no LR recorded",
            transform=ax_lr.transAxes,
            ha="center",
            va="center",
            color="grey",
        )
    else:
        ax_lr.legend(loc="upper left", fontsize=8)


class ActionMark(NamedTuple):
    """One label on the plot: the actions of one plan, at the step where the trainer took them."""

    step: int
    kinds: list[str]


def action_marks(timeline: "Timeline") -> list[ActionMark]:
    """Applied actions grouped by plan (one decision), each plan at the step it happened.

    A rollback's plan (its data skip, LR cut, clipping) is applied on the rewound step, in
    the new epoch; it happened at the step the rollback left, so it is drawn there, once.
    """
    plans: dict[str, list] = {}
    for a in timeline.actions:
        if a.ack_status == "applied":
            plans.setdefault(a.decision_id or a.action_id, []).append(a)
    marks = []
    for rows in plans.values():
        rollback = [a.ack_step for a in rows if a.kind == "rollback" and a.ack_step is not None]
        steps = [a.ack_step if a.ack_step is not None else a.apply_at_step for a in rows]
        marks.append(
            ActionMark(
                rollback[0] if rollback else min(steps), list(dict.fromkeys(a.kind for a in rows))
            )
        )
    return sorted(marks)


def _label_actions(fig, ax, marks: list[ActionMark], y: float) -> None:
    """Write each plan's kinds above its marker, stacking a label a row higher wherever it would
    run into one already placed (labels measured in pixels, so it holds at any zoom of steps)."""
    renderer = fig.canvas.get_renderer()
    rows: list[float] = []  # the right edge (pixels) of the last label of each row
    for mark in marks:
        text = ax.annotate(
            ", ".join(mark.kinds),
            (mark.step, y),
            xytext=(0, 8),
            textcoords="offset points",
            fontsize=7,
            color=ACTION,
            ha="center",
            va="bottom",
            annotation_clip=False,
        )
        box = text.get_window_extent(renderer)
        row = next((i for i, right in enumerate(rows) if box.x0 > right + 2), len(rows))
        if row == len(rows):
            rows.append(0.0)
        rows[row] = box.x1
        text.set_position((0, 8 + row * (box.height * 72 / fig.dpi + 2)))


def draw(timeline: "Timeline", path: str, title: str | None = None) -> None:
    """Write ``timeline`` as a PNG of WIDTH_IN x HEIGHT_IN inches at DPI."""
    plt = _pyplot()
    fig = figure(timeline, title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def figure(timeline: "Timeline", title: str | None = None):
    """The matplotlib figure (the caller closes it)."""
    plt = _pyplot()
    fig, (ax_loss, ax_grad, ax_lr) = plt.subplots(
        3,
        1,
        figsize=(WIDTH_IN, HEIGHT_IN),
        dpi=DPI,
        sharex=True,
        gridspec_kw={"height_ratios": [3, 2, 1.3]},
    )
    points = timeline.steps
    lo, hi = _ceiling([p.loss for p in points])
    labelled: set[str] = set()

    def label(name: str) -> str | None:
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for incident in timeline.incidents:
        ax_loss.axvspan(
            incident.first_step - 0.5,
            incident.last_step + 0.5,
            color=INCIDENT,
            alpha=0.6,
            zorder=0,
            label=label("incident"),
        )
    for segment in _segments(points):
        rerun = segment[0].rerun
        xs = [p.step for p in segment]
        ax_loss.plot(
            xs,
            [min(max(p.loss, lo), hi) if math.isfinite(p.loss) else float("nan") for p in segment],
            color=RERUN if rerun else FIRST,
            linewidth=1.2,
            linestyle="--" if rerun else "-",
            label=label("loss, re-run after rollback" if rerun else "loss"),
        )
        grads = [
            p.grad_norm
            if p.grad_norm is not None and math.isfinite(p.grad_norm) and p.grad_norm > 0
            else float("nan")
            for p in segment
        ]
        ax_grad.plot(
            xs,
            grads,
            color=RERUN if rerun else FIRST,
            linewidth=1.0,
            linestyle="--" if rerun else "-",
            label=label("grad norm, re-run" if rerun else "gradient norm"),
        )
    above = [p for p in points if math.isfinite(p.loss) and p.loss > hi]
    if above:  # the axis stops short of a huge spike: say so, and how high it went
        ax_loss.scatter(
            [p.step for p in above],
            [hi] * len(above),
            marker="^",
            color="grey",
            s=30,
            zorder=4,
            label=label("loss above the axis (value noted)"),
        )
        for p in sorted(above, key=lambda p: p.loss)[-3:]:
            ax_loss.annotate(
                f"{p.loss:.3g}",
                (p.step, hi),
                xytext=(4, -10),
                textcoords="offset points",
                fontsize=7,
                color="grey",
            )
    bad = [p.step for p in points if not math.isfinite(p.loss)]
    if bad:
        ax_loss.scatter(
            bad,
            [hi] * len(bad),
            marker="^",
            color="black",
            s=30,
            zorder=4,
            label=label("non-finite loss (drawn at the top)"),
        )
    loss_at = {(p.epoch, p.step): p.loss for p in points}
    xs, ys = [], []
    for step, epoch, _ in timeline.anomalies:
        value = loss_at.get((epoch, step))
        if value is not None:
            xs.append(step)
            ys.append(min(max(value, lo), hi) if math.isfinite(value) else hi)
    if xs:
        ax_loss.scatter(
            xs, ys, marker="x", color=ANOMALY, s=28, zorder=5, label=label("anomalous step")
        )
    marks = action_marks(timeline)
    if marks:
        ax_loss.scatter(
            [m.step for m in marks],
            [lo] * len(marks),
            marker="v",
            color=ACTION,
            s=50,
            zorder=6,
            clip_on=False,
            label=label("action applied"),
        )
    for start, target, epoch in timeline.rollbacks:
        y = hi - 0.08 * (hi - lo)
        ax_loss.annotate(
            "",
            xy=(target, y),
            xytext=(start, y),
            arrowprops={"arrowstyle": "->", "color": ROLLBACK, "lw": 1.5},
        )
        ax_loss.axvline(
            start,
            color=ROLLBACK,
            linewidth=1.0,
            linestyle=":",
            label=label("rollback (arrow: to its checkpoint)"),
        )
        ax_loss.text(
            (start + target) / 2,
            y,
            f"rollback -> step {target} (epoch {epoch})",
            fontsize=7,
            color=ROLLBACK,
            ha="center",
            va="bottom",
        )
    ax_loss.set_ylim(lo, hi)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title or f"spikeguard: run {timeline.run_id}")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax_grad.set_ylabel("gradient norm (log)")
    _changes(timeline, ax_lr, label)
    ax_lr.set_xlabel("optimizer step")
    ax_grad.grid(True, alpha=0.3, which="both")
    if any(
        p.grad_norm is not None and math.isfinite(p.grad_norm) and p.grad_norm > 0 for p in points
    ):
        ax_grad.set_yscale("log")  # only with something positive to scale
        ax_grad.legend(loc="upper right", fontsize=8)
    else:
        ax_grad.text(
            0.5,
            0.5,
            "no gradient norms recorded",
            transform=ax_grad.transAxes,
            ha="center",
            va="center",
            color="grey",
        )
    fig.tight_layout()
    _label_actions(fig, ax_loss, marks, lo)  # after the layout: it measures the labels in pixels
    return fig
