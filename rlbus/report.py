"""`rlbus report RUN_DIR -o report.html`: one self-contained HTML page of a run.

Read from the run's logs and config, with every plot inline (SVG, the
timeline as PNG), so the page opens anywhere without the run directory or a
network:

- a summary: steps, wall time, samples, first and last reward and accuracy;
- `reward`: the trainer's batch reward and the held-out accuracy over steps
  (accuracy at the policy version evaluated) and over time;
- `staleness`: the samples trained on, by staleness (step - policy version);
- `throughput`: tokens per second of each component, and idle shares (the
  trainer's share of step time spent waiting for data; each explorer's
  engine idle share from `explorer_activity`);
- `timeline`: the seed-diagram timeline (rlbus timeline);
- the config the run used.

Each figure is a `<figure id="...">` with a caption, so a browser test can
check that every plot is there.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from rlbus.logview import read_events
from rlbus.timeline import render

FIGURES = ("reward", "staleness", "throughput", "timeline")


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: without the XML prologue


def _figure(name: str, caption: str, body: str) -> str:
    return f'<figure id="{name}">{body}<figcaption>{html.escape(caption)}</figcaption></figure>'


class Run:
    def __init__(self, run_dir: Path):
        self.dir = run_dir
        events = read_events(run_dir)
        if not events:
            raise ValueError(f"no events in {run_dir}/logs")
        self.t0 = min(e["ts"] for e in events)
        self.steps = [e for e in events if e["event"] == "train_step"]
        self.evals = [e for e in events if e["event"] == "eval"]
        self.rollouts = [e for e in events if e["event"] in ("explorer_batch", "explorer_groups")]
        self.activity: dict[str, dict] = {}
        for e in events:
            if e["event"] == "explorer_activity":
                self.activity[e.get("peer", "?")] = e  # the last line is cumulative
        self.wall_s = max(e["ts"] for e in events) - self.t0


def _reward(run: Run) -> str:
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 3.6))
    rewarded = [s for s in run.steps if s.get("reward_mean") is not None]
    for ax, x_step, x_eval, label in (
            (by_step, [s["step"] for s in rewarded], [e["policy_version"] for e in run.evals], "trainer step"),
            (by_time, [s["ts"] - run.t0 for s in rewarded], [e["ts"] - run.t0 for e in run.evals],
             "seconds since the run's first event")):
        ax.plot(x_step, [s["reward_mean"] for s in rewarded], color="#4C72B0", label="batch reward")
        if run.evals:
            ax.plot(x_eval, [e["accuracy"] for e in run.evals], "o-", color="#DD8452", label="held-out accuracy")
        ax.set_xlabel(label)
        if all(0 <= s["reward_mean"] <= 1 for s in rewarded):
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    by_step.legend(loc="lower right", fontsize="small")
    return _svg(fig)


def _staleness(run: Run) -> str:
    import matplotlib.pyplot as plt

    counts: Counter[int] = Counter()
    for s in run.steps:
        for lag, n in (s.get("staleness") or {}).items():
            counts[int(lag)] += n
    lags = sorted(counts)
    fig, ax = plt.subplots(figsize=(min(5.5, 2 + 0.5 * len(lags)), 3.2))
    ax.bar([str(k) for k in lags], [counts[k] for k in lags], color="#55A868")
    ax.set_xlabel("staleness (step - policy version)")
    ax.set_ylabel("samples trained")
    return _svg(fig)


def _throughput(run: Run) -> tuple[str, dict[str, float]]:
    import matplotlib.pyplot as plt

    tokens: dict[str, float] = {}
    idle: dict[str, float] = {}
    if run.steps:
        tokens["trainer"] = statistics.median(s.get("tokens_per_s", 0.0) for s in run.steps)
        total = sum(s["step_s"] for s in run.steps)
        idle["trainer"] = sum(s["wait_s"] for s in run.steps) / total if total else 0.0
    by_peer: dict[str, list[dict]] = {}
    for r in run.rollouts:
        by_peer.setdefault(r.get("peer", "?"), []).append(r)
    for peer, rs in sorted(by_peer.items()):
        seconds = sum(r["rollout_s"] for r in rs)
        tokens[peer] = sum(r.get("tokens", 0) for r in rs) / seconds if seconds else 0.0
        if peer in run.activity:
            idle[peer] = run.activity[peer]["idle_share"]
    fig, (ax_tok, ax_idle) = plt.subplots(1, 2, figsize=(11, 3.2))
    ax_tok.barh(list(tokens), list(tokens.values()), color="#4C72B0")
    ax_tok.set_xlabel("tokens / s (trainer: trained, median step;\nexplorers: generated)")
    ax_idle.barh(list(idle), list(idle.values()), color="#BBBBBB")
    ax_idle.set_xlim(0, 1)
    ax_idle.set_xlabel("idle share (trainer: waiting for data;\nexplorers: engine not stepping)")
    for ax in (ax_tok, ax_idle):
        ax.invert_yaxis()
    return _svg(fig), idle


def _timeline(run_dir: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "timeline.png"
        render(run_dir, png)
        data = base64.b64encode(png.read_bytes()).decode()
    return f'<img alt="timeline" src="data:image/png;base64,{data}" style="max-width:100%">'


def build(run_dir: str | Path) -> str:
    """The page's HTML."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    run = Run(run_dir)
    throughput, idle = _throughput(run)
    rewards = [s["reward_mean"] for s in run.steps if s.get("reward_mean") is not None]
    summary = {
        "run directory": str(run_dir.resolve()),
        "trainer steps": len(run.steps),
        "wall time": f"{run.wall_s:.0f} s",
        "samples trained (all-equal groups left out)": sum(s.get("samples", 0) for s in run.steps),
        "batch reward, first → last": f"{rewards[0]:.3f} → {rewards[-1]:.3f}" if rewards else "–",
        "held-out accuracy, first → last": (f"{run.evals[0]['accuracy']:.3f} (v{run.evals[0]['policy_version']}) → "
                                            f"{run.evals[-1]['accuracy']:.3f} (v{run.evals[-1]['policy_version']})"
                                            if run.evals else "no evaluations"),
        "idle shares": ", ".join(f"{k} {v:.3f}" for k, v in idle.items()) or "–",
    }
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    config = run_dir / "config.yaml"
    config_text = config.read_text() if config.exists() else "(no config.yaml in the run directory)"
    figures = [
        _figure("reward", "Batch reward (trainer) and held-out greedy accuracy, over steps and over time.",
                _reward(run)),
        _figure("staleness", "Samples trained on, by staleness.", _staleness(run)),
        _figure("throughput", "Tokens per second and idle share per component.", throughput),
        _figure("timeline", "Rollouts, training, weight sync and waiting per component; the buffer's depth.",
                _timeline(run_dir)),
    ]
    style = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}"
             "table{border-collapse:collapse}th,td{text-align:left;padding:2px 12px 2px 0}"
             "figure{margin:1.5em 0}figcaption{color:#555;font-size:90%}svg{max-width:100%;height:auto}"
             "pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:85%}")
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>rlbus run: "
            f"{html.escape(run_dir.name)}</title><style>{style}</style></head><body>"
            f"<h1>rlbus run {html.escape(run_dir.name)}</h1><table id=\"summary\">{rows}</table>"
            + "".join(figures)
            + f"<h2>Config</h2><pre id=\"config\">{html.escape(config_text)}</pre></body></html>")


def write(run_dir: str | Path, output: str | Path) -> Path:
    Path(output).write_text(build(run_dir))
    return Path(output)
