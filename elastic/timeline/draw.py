"""Draw a ``Timeline`` (model.py) as a PNG with matplotlib.

Top: the world size of the training ring over time. Middle: one lane per worker,
a bar wherever it made commits, so every gap shows; a cross where it was killed or
died, a dot where it ended well. Red lines are failures, green ones hosts joining,
orange ones hosts leaving; each re-formation is a shaded band across both. A
re-formation lasts a fraction of a second in a job of minutes, too thin to read
at that scale: the bottom row zooms into each (up to ``MAX_ZOOMS``), one bar per
worker split into its phases.
"""

from __future__ import annotations

from .model import PHASES, Timeline

MAX_ZOOMS = 4
PHASE_COLOURS = dict(zip(PHASES, ("#d62728", "#9467bd", "#ff7f0e", "#1f77b4", "#2ca02c")))
STEP_COLOUR = "#4c72b0"
BAND_COLOUR = "#ffb000"


def render(timeline: Timeline, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    zooms = _zoomed(timeline)
    lanes = timeline.lanes
    lane_height = max(2.0, 0.38 * len(lanes) + 0.8)
    zoom_height = 1.0 + 0.28 * _zoom_rows(zooms) if zooms else 0.0
    fig = plt.figure(figsize=(13, 1.3 + lane_height + zoom_height + 1.6), dpi=110)
    outer = fig.add_gridspec(2 if zooms else 1, 1, height_ratios=[1.3 + lane_height] + ([zoom_height] if zooms else []),
                             hspace=0.35)
    main = outer[0].subgridspec(2, 1, height_ratios=[1.3, lane_height], hspace=0.08)
    world_ax = fig.add_subplot(main[0])
    lanes_ax = fig.add_subplot(main[1], sharex=world_ax)
    span = max(timeline.end, 1.0)

    _draw_world(world_ax, timeline, span)
    _draw_lanes(lanes_ax, timeline)
    for ax in (world_ax, lanes_ax):
        _draw_marks(ax, timeline, span, label=ax is world_ax)
    lanes_ax.set_xlim(-0.01 * span, span * 1.01)
    lanes_ax.set_xlabel("seconds since the job started")
    if zooms:
        row = outer[1].subgridspec(1, len(zooms), wspace=0.3)
        for i, reform in enumerate(zooms):
            _draw_zoom(fig.add_subplot(row[i]), timeline, reform, i + 1)
    fig.suptitle(timeline.headline(), fontsize=13, fontweight="bold")
    handles = _legend_handles(plt, bool(zooms))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.subplots_adjust(top=0.93, bottom=0.09, left=0.17, right=0.94)
    fig.savefig(path)
    plt.close(fig)


def _zoomed(timeline: Timeline):
    """The re-formations worth a zoom: the failures' first, then the slowest others."""
    reforms = timeline.reformations
    chosen = [r for r in reforms if r.failed][:MAX_ZOOMS]
    rest = sorted((r for r in reforms if r not in chosen), key=lambda r: -r.duration)
    chosen += rest[:MAX_ZOOMS - len(chosen)]
    return sorted(chosen, key=lambda r: r.start)


def _zoom_rows(zooms) -> int:
    return max(len(r.workers) for r in zooms)


def _draw_world(ax, timeline: Timeline, span: float) -> None:
    world = timeline.world
    if world:
        xs = [t for t, _ in world] + [timeline.end]
        ys = [w for _, w in world] + [world[-1][1]]
        ax.step(xs, ys, where="post", color="black", linewidth=2)
        top = max(ys)
        ax.set_ylim(0, top + 1)
        ax.set_yticks(range(0, top + 1, max(1, (top + 1) // 5)))
        for t, w in world:
            ax.annotate(str(w), (t, w), textcoords="offset points", xytext=(3, 3), fontsize=8)
    ax.set_ylabel("world size")
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(labelbottom=False)


def _draw_lanes(ax, timeline: Timeline) -> None:
    lanes = timeline.lanes
    failed = {f.worker for f in timeline.failures}  # not the workers stopped at the end
    for y, lane in enumerate(lanes):
        if lane.started is not None:
            end = lane.exited if lane.exited is not None else timeline.end
            ax.plot([lane.started, end], [y, y], color="#cccccc", linewidth=1, zorder=1)  # alive
        bars = [(s.start, max(s.end - s.start, 0.01)) for s in lane.spans]
        ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=STEP_COLOUR, zorder=2)
        if lane.exited is not None:
            bad = lane.worker in failed
            ax.plot(lane.exited, y, marker="x" if bad else "o", color="#d62728" if bad else "#555555",
                    markersize=11 if bad else 5, markeredgewidth=3, zorder=4)
        ax.annotate(f"{lane.steps} steps", (1.005, y), xycoords=("axes fraction", "data"),
                    va="center", fontsize=8, color="#555555")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(timeline.lane_labels(), fontsize=8)
    ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)


def _draw_marks(ax, timeline: Timeline, span: float, *, label: bool) -> None:
    """Failures, joins and leaves as lines; re-formations as bands (at least visible)."""
    min_width = span * 0.004
    for reform in timeline.reformations:
        ax.axvspan(reform.start, max(reform.end, reform.start + min_width),
                   color=BAND_COLOUR if reform.failed else "#8fd18f", alpha=0.45, zorder=0, linewidth=0)
    marks = [(f.time, "#d62728", f"{f.kind} {_short(f.worker)}") for f in timeline.failures]
    colours = {"joined": "#2ca02c", "left": "#ff7f0e", "leaving": "#ff7f0e"}
    marks += [(c.time, colours[c.kind], f"{c.host} {c.kind}") for c in timeline.changes]
    for t, colour, text in marks:
        ax.axvline(t, color=colour, linestyle="--", linewidth=1.3, zorder=3)
        if label:
            ax.annotate(text, (t, 1.0), xycoords=("data", "axes fraction"), textcoords="offset points",
                        xytext=(2, 3), fontsize=8, color=colour, rotation=0, ha="left", va="bottom")


def _draw_zoom(ax, timeline: Timeline, reform, number: int) -> None:
    """Seconds from the band's start (absolute times would need an offset label)."""
    workers = sorted(reform.workers, key=lambda w: (w.rank if w.rank is not None else 1 << 30))
    start = reform.start
    for y, w in enumerate(workers):
        t = w.detected - start
        segments = [("abort", w.abort), ("rendezvous", w.rendezvous), ("pg init", w.pg_init)]
        if t > 0:
            ax.barh(y, t, left=0, color=PHASE_COLOURS["detect"], height=0.6)
        for name, seconds in segments:
            ax.barh(y, seconds, left=t, color=PHASE_COLOURS[name], height=0.6)
            t += seconds
        # The rollback and the wait for the sync to start fall in the gap before sync.
        ax.barh(y, w.sync, left=w.done - start - w.sync, color=PHASE_COLOURS["sync"], height=0.6)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels([f"rank {w.rank}" for w in workers], fontsize=7)
    ax.set_ylim(len(workers) - 0.5, -0.5)
    pad = max(reform.duration * 0.08, 0.005)
    ax.set_xlim(-pad, reform.duration + pad)
    ax.tick_params(axis="x", labelsize=7)
    cause = f"{reform.cause.kind} {_short(reform.cause.worker)}" if reform.cause else (
        "failure" if reform.failed else "switch at a commit")
    ax.set_title(f"#{number} round {reform.round} at {start:.1f} s: {reform.duration:.2f} s\n"
                 f"{cause} -> {reform.world_size} workers", fontsize=8)
    ax.set_xlabel("s after the failure" if reform.failed else "s after the switch", fontsize=7, labelpad=1)


def _legend_handles(plt, phases: bool):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=STEP_COLOUR, label="steps"),
               Patch(color=BAND_COLOUR, alpha=0.45, label="re-formation after a failure"),
               Patch(color="#8fd18f", alpha=0.45, label="switch at a commit"),
               Line2D([], [], color="#d62728", marker="x", linestyle="--", label="failure"),
               Line2D([], [], color="#2ca02c", linestyle="--", label="host joined"),
               Line2D([], [], color="#ff7f0e", linestyle="--", label="host left")]
    if phases:
        handles += [Patch(color=PHASE_COLOURS[p], label=p) for p in PHASES]
    return handles


def _short(worker) -> str:
    return str(worker).rsplit(".", 1)[-1] if worker else ""
