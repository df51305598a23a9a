"""`rlbus trace RUN_DIR -o trace.json`: the whole run as a Chrome trace, to open in Perfetto (ui.perfetto.dev)
or chrome://tracing and see, side by side, why each component was busy or idle.

Built from the components' logs (`RUN_DIR/logs/*.jsonl`), the same events the
timeline draws. One process per component (the broker, the trainer, each
explorer by its peer name), with these tracks:

- explorer `rollout`: each batch (`explorer_batch`) or set of groups
  (`explorer_groups`), lasting its `rollout_s`; `put`: each PUT from its send
  to its ACK (`put_acked`); `weights`: each load (`weights_loaded`) and each
  wait for a version (`waiting_for_weights` .. `weights_wait_over`); `eval`:
  held-out evaluations;
- trainer `step`: each step, with its FETCH wait, compute and publishing
  inside it (`train_step`); `publish`: each version written (or broadcast)
  and announced, on the publishing thread (`weights_published`);
- broker `requests`: batches delivered, redelivered and committed, groups
  retired, leases granted and refused, weights announced, peers joining and
  leaving (instants); counters: the buffer's depth, and each explorer's
  idle share (`explorer_activity`).

Times are microseconds since the run's first event.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbus.logview import read_events

BROKER_INSTANTS = ("batch_delivered", "batch_redelivered", "batch_committed", "groups_retired", "tasks_leased",
                   "lease_wait", "weights_published", "peer_joined", "peer_left", "swap_granted", "swap_released")
_SKIP = {"ts", "level", "event", "component", "peer", "step_s", "wait_s", "compute_s", "publish_s"}


class Trace:
    def __init__(self, t0: float):
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, str], int] = {}

    def _ids(self, process: str, track: str) -> tuple[int, int]:
        pid = self._pids.get(process)
        if pid is None:
            pid = self._pids[process] = len(self._pids) + 1
            self.events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}})
            self.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                                "args": {"sort_index": _order(process)}})
        tid = self._tids.get((pid, track))
        if tid is None:
            tid = self._tids[(pid, track)] = len([k for k in self._tids if k[0] == pid]) + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        return pid, tid

    def _us(self, t: float) -> int:
        return round((t - self.t0) * 1e6)

    def span(self, process: str, track: str, name: str, start: float, end: float, args: dict | None = None) -> None:
        pid, tid = self._ids(process, track)
        self.events.append({"name": name, "cat": track, "ph": "X", "ts": self._us(start),
                            "dur": max(0, round((end - start) * 1e6)),
                            "pid": pid, "tid": tid, "args": args or {}})

    def instant(self, process: str, track: str, name: str, t: float, args: dict | None = None) -> None:
        pid, tid = self._ids(process, track)
        self.events.append({"name": name, "cat": track, "ph": "i", "s": "t", "ts": self._us(t), "pid": pid,
                            "tid": tid, "args": args or {}})

    def counter(self, process: str, name: str, t: float, values: dict[str, float]) -> None:
        pid, _ = self._ids(process, "counters")
        self.events.append({"name": name, "ph": "C", "ts": self._us(t), "pid": pid, "tid": 0, "args": values})


def _order(process: str) -> int:
    return {"broker": 0, "trainer": 1}.get(process, 2)


def _lasted(event: dict) -> float:
    """How long before its time an event's span began (0 for an instant)."""
    return max((v for k in ("rollout_s", "step_s", "seconds") if isinstance(v := event.get(k), (int, float))),
               default=0.0)


def _args(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in _SKIP}


def build(run_dir: str | Path) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of a run's logs."""
    events = read_events(run_dir)
    if not events:
        raise ValueError(f"no events in {run_dir}/logs")
    trace = Trace(min(e["ts"] - _lasted(e) for e in events))  # no span starts before the origin
    waiting: dict[str, float] = {}
    for e in events:
        t, name, component = e["ts"], e["event"], e.get("component", "?")
        who = e.get("peer") or component
        if component == "explorer":
            if name in ("explorer_batch", "explorer_groups"):
                trace.span(who, "rollout", "rollout", t - e["rollout_s"], t, _args(e))
            elif name == "put_acked":
                trace.span(who, "put", "put", t - e["seconds"], t, _args(e))
            elif name == "weights_loaded":
                trace.span(who, "weights", f"load v{e['policy_version']}", t - e["seconds"], t, _args(e))
            elif name == "waiting_for_weights":
                waiting[who] = t
            elif name == "weights_wait_over" and who in waiting:
                trace.span(who, "weights", f"wait for v{e['need_version']}", waiting.pop(who), t, _args(e))
            elif name == "eval":
                trace.span(who, "eval", f"eval v{e['policy_version']}", t - e["seconds"], t, _args(e))
            elif name == "explorer_activity":
                trace.counter(who, "idle share", t, {"idle_share": e["idle_share"]})
        elif component == "trainer":
            if name == "train_step":
                start = t - e["step_s"]
                trace.span("trainer", "step", f"step {e['step']}", start, t, _args(e))
                trace.span("trainer", "step", "fetch (waiting for data)", start, start + e["wait_s"])
                trace.span("trainer", "step", "compute", start + e["wait_s"], t - e["publish_s"])
                trace.span("trainer", "step", "publish and commit", t - e["publish_s"], t)
            elif name == "weights_published":
                trace.span("trainer", "publish", f"publish v{e['policy_version']}", t - e.get("seconds", 0.0), t,
                           _args(e))
        elif component == "broker":
            if name in BROKER_INSTANTS:
                trace.instant("broker", "requests", name, t, _args(e))
            if isinstance(e.get("depth"), int):
                trace.counter("broker", "buffer depth", t, {"depth": e["depth"]})
    return {"traceEvents": trace.events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(run_dir), "origin_unix_s": trace.t0}}


def write(run_dir: str | Path, output: str | Path) -> int:
    """Write the trace; returns how many trace events it holds."""
    trace = build(run_dir)
    Path(output).write_text(json.dumps(trace))
    return len(trace["traceEvents"])
