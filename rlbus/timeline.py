"""`rlbus timeline RUN_DIR -o timeline.png`: the run drawn the way the reference diagrams are.

One lane per explorer and one for the trainer, plus the buffer's depth,
with rollout, training, weight-sync and waiting spans in their own colours,
all read from the components' logs:

- explorer rollout: `explorer_batch`, or a streaming explorer's
  `explorer_groups` (ends at its time, lasts `rollout_s`: of the groups it
  reports, the longest from submission to its last sample);
- explorer weight load: `weights_loaded` (lasts `seconds`);
- explorer waiting for weights: `waiting_for_weights` to `weights_wait_over`;
- trainer: `train_step` split into waiting for data, compute and publishing
  (`wait_s`, `compute_s`, `publish_s`, ending at its time);
- buffer depth: every broker event that carries `depth`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlbus.logview import read_events

COLOURS = {"rollout": "#4C72B0", "train": "#DD8452", "sync": "#55A868", "wait": "#BBBBBB", "publish": "#8172B3"}


@dataclass(frozen=True)
class Span:
    lane: str
    kind: str
    start: float
    end: float


def build(run_dir: str | Path) -> tuple[list[Span], list[tuple[float, int]], float]:
    """(spans, buffer depth points, time origin) from a run's logs; times are seconds from the origin."""
    events = read_events(run_dir)
    if not events:
        raise ValueError(f"no events in {run_dir}/logs")
    t0 = min(e["ts"] for e in events)
    spans: list[Span] = []
    depth: list[tuple[float, int]] = []
    waiting: dict[str, float] = {}
    for e in events:
        t, lane, name = e["ts"] - t0, e.get("peer") or e.get("component", "?"), e["event"]
        if name in ("explorer_batch", "explorer_groups"):
            spans.append(Span(lane, "rollout", t - e["rollout_s"], t))
        elif name == "weights_loaded" and e.get("component") == "explorer":
            spans.append(Span(lane, "sync", t - e["seconds"], t))
        elif name == "waiting_for_weights":
            waiting[lane] = t
        elif name == "weights_wait_over" and lane in waiting:
            spans.append(Span(lane, "wait", waiting.pop(lane), t))
        elif name == "train_step":
            start = t - e["step_s"]
            spans.append(Span("trainer", "wait", start, start + e["wait_s"]))
            spans.append(Span("trainer", "train", start + e["wait_s"], t - e["publish_s"]))
            spans.append(Span("trainer", "publish", t - e["publish_s"], t))
        if e.get("component") == "broker" and isinstance(e.get("depth"), int):
            depth.append((t, e["depth"]))
    return spans, depth, t0


def render(run_dir: str | Path, output: str | Path) -> list[Span]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans, depth, _ = build(run_dir)
    lanes = sorted({s.lane for s in spans if s.lane != "trainer"}) + ["trainer"]
    fig, (ax, ax_depth) = plt.subplots(2, 1, sharex=True, figsize=(12, 1.2 + 0.6 * len(lanes)),
                                       gridspec_kw={"height_ratios": [max(1, len(lanes)), 1]})
    for row, lane in enumerate(lanes):
        for s in (s for s in spans if s.lane == lane and s.end > s.start):
            ax.barh(row, s.end - s.start, left=s.start, height=0.6, color=COLOURS[s.kind], edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower left",
              bbox_to_anchor=(0, 1.0), ncols=5, fontsize="small", frameon=False)
    if depth:
        ax_depth.step([t for t, _ in depth], [d for _, d in depth], where="post", color="#333333")
    ax_depth.set_ylabel("buffer")
    ax_depth.set_xlabel("seconds since the run's first event")
    fig.tight_layout()
    # The format named, never guessed: given no suffix, matplotlib would write OUTPUT.png instead of OUTPUT.
    fig.savefig(output, dpi=110, format=Path(output).suffix[1:] or "png")
    plt.close(fig)
    return spans
