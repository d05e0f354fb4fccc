"""The `asyncps` command: one subcommand per role, plus the local launcher and tools."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncps.cluster import ClusterConfigError, TFConfig, parse_tf_config
from asyncps.config import RunConfig
from asyncps.rules import MODES, POLICIES
from asyncps.rules.modes import MODE_ALIASES
from asyncps.security import SecurityConfig

ENV_PREFIX = "ASYNCPS_"
DEFAULT_PORT = 8470


def _env_default(dest: str, default: Any) -> Any:
    """A flag's default: ASYNCPS_<FLAG> from the environment if set, else the built-in one."""
    return os.environ.get(ENV_PREFIX + dest.upper(), default)


def _env_flag(dest: str) -> bool:
    """A boolean flag's default from ASYNCPS_<FLAG> (1/true/yes)."""
    return str(_env_default(dest, "")).strip().lower() in ("1", "true", "yes")


def _add(parser: argparse._ActionsContainer, flag: str, default: Any, help: str, **kwargs: Any) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    env = ENV_PREFIX + dest.upper()
    parser.add_argument(flag, dest=dest, default=_env_default(dest, default),
                        help=f"{help} (env {env}; default: %(default)s)", **kwargs)


def _opt_params(items: Sequence[str] | str) -> dict[str, float]:
    if isinstance(items, str):
        items = [i for i in items.replace(",", " ").split() if i]
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"--opt-param wants KEY=NUMBER, got {item!r}")
    return out


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Flags that define a training run (chief and local)."""
    d = RunConfig()
    g = p.add_argument_group("training run")
    _add(g, "--run-config", "", "JSON file with a RunConfig (flags given explicitly override it)")
    _add(g, "--model", d.model, "logreg | mlp | mlp:H1,H2,... | cnn | embedding")
    _add(g, "--dataset", d.dataset, "digits | mnist | fashion_mnist | npz:PATH | synthetic-logreg")
    _add(g, "--batch-size", d.batch_size, "examples per worker step", type=int)
    _add(g, "--optimizer", d.optimizer, "sgd | momentum | nesterov | adam | adagrad")
    _add(g, "--lr", d.learning_rate, "learning rate", type=float)
    _add(g, "--opt-param", [], "optimizer hyperparameter KEY=VALUE (repeatable), e.g. beta_1=0.9",
         action="append")
    _add(g, "--mode", d.mode, f"consistency mode spec: {MODES.usage()}")
    _add(g, "--staleness-policy", d.staleness_policy, f"staleness policy spec: {POLICIES.usage()}")
    _add(g, "--max-updates", d.max_updates, "stop after this many updates (0: no limit)", type=int)
    _add(g, "--epochs", None, f"stop after this many passes over the training data (0: no limit; "
         f"{d.epochs:g} unless --max-updates or --max-seconds is given)", type=float)
    _add(g, "--max-seconds", d.max_seconds, "stop after this much training time (0: no limit)", type=float)
    _add(g, "--eval-every", d.eval_every_s, "seconds between evaluations", type=float)
    _add(g, "--seed", d.seed, "seed of model init, data order and injected delays", type=int)
    _add(g, "--compute-delay", d.compute_delay,
         "injected delay per step: none | const:S | uniform:A,B | exp:MEAN")
    _add(g, "--stragglers", d.stragglers, "permanent slow workers, e.g. 0:4x,3:2x (seeded experiments)")
    _add(g, "--slowdown", d.slowdown, "random slowdowns P:F: with probability P a step is F times slower")
    _add(g, "--rpc-latency", d.rpc_latency_s, "seconds added before every worker round trip", type=float)
    _add(g, "--read-wait", d.read_wait_s, "longest a shard holds a sync/ssp worker before answering", type=float)
    _add(g, "--backup-workers", d.backup_workers, "same as --mode sync:backup=B", type=int)
    _add(g, "--staleness-bound", d.staleness_bound, "same as --mode ssp:bound=S", type=int)
    _add(g, "--checkpoint-every", "0", "checkpoint every N updates, or every Ns seconds with a trailing s (0: off)")
    _add(g, "--keep-checkpoints", d.keep_checkpoints, "how many checkpoints to keep", type=int)
    _add(g, "--slice-threshold", d.slice_threshold_bytes,
         "variables larger than this many bytes are sliced over shards", type=int)
    _add(g, "--chunk-bytes", d.chunk_bytes, "bytes per streamed tensor chunk", type=int)
    _add(g, "--heartbeat-interval", d.heartbeat_interval_s, "seconds between worker heartbeats", type=float)
    _add(g, "--heartbeat-timeout", d.heartbeat_timeout_s, "silence after which a worker is dead", type=float)
    _add(g, "--rpc-deadline", d.rpc_deadline_s, "seconds to keep retrying an unreachable peer", type=float)
    _add(g, "--tf-threads", d.tf_threads, "TensorFlow intra/inter-op threads per process (0: TF default)", type=int)


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """Authentication and encryption flags (every role; the token itself never goes on a command line)."""
    g = p.add_argument_group("security")
    _add(g, "--token-file", "", "file holding the shared token required on every RPC (else env ASYNCPS_TOKEN)")
    _add(g, "--tls-cert", "", "PEM certificate: served by servers, presented as client certificate by clients")
    _add(g, "--tls-key", "", "PEM private key of --tls-cert")
    _add(g, "--tls-ca", "", "PEM CA: clients verify servers with it; servers with a cert require client certs (mTLS)")
    _add(g, "--tls-server-name", "", "host name to check in the server certificate instead of the address's")
    g.add_argument("--tls-no-client-auth", action="store_true", default=_env_flag("tls_no_client_auth"),
                   help="servers with --tls-ca do not require client certificates: TLS, not mTLS "
                        "(env ASYNCPS_TLS_NO_CLIENT_AUTH=1)")


def security_from(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig of the security flags."""
    return SecurityConfig.from_flags(args.token_file, args.tls_cert, args.tls_key, args.tls_ca,
                                     args.tls_server_name, require_client_cert=not args.tls_no_client_auth)


def run_config_from(args: argparse.Namespace, num_workers: int, num_ps: int) -> RunConfig:
    """Resolve the RunConfig from a --run-config file, then flags."""
    base: dict[str, Any] = {}
    if args.run_config:
        base = json.loads(Path(args.run_config).read_text())
    fields = {
        "model": args.model, "dataset": args.dataset, "batch_size": int(args.batch_size),
        "optimizer": args.optimizer, "learning_rate": float(args.lr),
        "optimizer_params": _opt_params(args.opt_param), "mode": args.mode,
        "staleness_policy": args.staleness_policy, "max_updates": int(args.max_updates),
        "epochs": _epochs(args), "max_seconds": float(args.max_seconds),
        "eval_every_s": float(args.eval_every), "seed": int(args.seed),
        "compute_delay": args.compute_delay, "stragglers": args.stragglers, "slowdown": args.slowdown,
        "rpc_latency_s": float(args.rpc_latency), "read_wait_s": float(args.read_wait),
        "backup_workers": int(args.backup_workers), "staleness_bound": int(args.staleness_bound),
        "slice_threshold_bytes": int(args.slice_threshold),
        "chunk_bytes": int(args.chunk_bytes), "heartbeat_interval_s": float(args.heartbeat_interval),
        "heartbeat_timeout_s": float(args.heartbeat_timeout), "rpc_deadline_s": float(args.rpc_deadline),
        "tf_threads": int(args.tf_threads), "num_workers": num_workers, "num_ps": num_ps,
        **_checkpoint_every(str(args.checkpoint_every)), "keep_checkpoints": int(args.keep_checkpoints),
    }
    if base:  # a config file wins over built-in defaults, explicit flags win over the file
        explicit = {k for k, v in fields.items() if v != getattr(RunConfig(), k, None)}
        fields = {**fields, **{k: v for k, v in base.items() if k not in explicit}}
        fields = _mode_from_flags_over_file(fields, explicit)
    return RunConfig(**fields)


def _mode_from_flags_over_file(fields: dict[str, Any], explicit: set[str]) -> dict[str, Any]:
    """The file's mode and its mirrored per-mode fields give way to the mode flags given.

    An explicit --mode replaces the file's mode with its parameters; an explicit --backup-workers or
    --staleness-bound replaces that one parameter of the file's mode.
    """
    fields = dict(fields)
    if "mode" in explicit:
        for alias in MODE_ALIASES:
            if alias not in explicit:
                fields[alias] = 0
        return fields
    given = [alias for alias in MODE_ALIASES if alias in explicit]
    if given:
        name, params = MODES.split(str(fields["mode"]))
        for alias in MODE_ALIASES:
            if alias not in given:
                fields[alias] = 0
            elif MODE_ALIASES[alias][0] == name:
                params.pop(MODE_ALIASES[alias][1], None)
        fields["mode"] = name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
    return fields


def _checkpoint_every(text: str) -> dict[str, Any]:
    """`500` -> every 500 updates; `30s` -> every 30 seconds."""
    try:
        if text.endswith("s"):
            return {"checkpoint_every_s": float(text[:-1]), "checkpoint_every_updates": 0}
        return {"checkpoint_every_updates": int(text), "checkpoint_every_s": 0.0}
    except ValueError:
        raise ValueError(f"--checkpoint-every wants N (updates) or Ns (seconds), got {text!r}") from None


def _epochs(args: argparse.Namespace) -> float:
    """--epochs, or the default unless another stop condition was given."""
    if args.epochs is not None:
        return float(args.epochs)
    other = float(args.max_updates) > 0 or float(args.max_seconds) > 0
    return 0.0 if other else RunConfig.epochs


def _tf_config() -> TFConfig | None:
    text = os.environ.get("TF_CONFIG", "").strip()
    return parse_tf_config(text) if text else None


def _port(args: argparse.Namespace, tf: TFConfig | None, role: str) -> int:
    """--port if given, else this task's port in TF_CONFIG, else the default port."""
    if args.port is not None:
        return int(args.port)
    if tf is not None and tf.task_type == role:
        return tf.own_port
    return DEFAULT_PORT


def _install_signals(event: threading.Event) -> None:
    def handler(signum: int, frame: Any) -> None:
        event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def cmd_ps(args: argparse.Namespace) -> int:
    """asyncps ps."""
    from asyncps.ps.main import PsConfig, run_ps

    tf = _tf_config()
    port, index = _port(args, tf, "ps"), int(args.index)
    if tf is not None and tf.task_type == "ps":
        index = tf.task_index
    config = PsConfig(host=args.host, port=port, index=index, port_file=args.port_file,
                      chunk_bytes=int(args.chunk_bytes), security=security_from(args))
    _setup_logging(args.log_level, f"ps-{index}")
    stop = threading.Event()
    _install_signals(stop)
    return run_ps(config, stop)


def cmd_worker(args: argparse.Namespace) -> int:
    """asyncps worker."""
    from asyncps.worker.main import WorkerConfig, run_worker

    chief, index = args.chief, int(args.index)
    tf = _tf_config()
    if tf is not None:
        chief = chief or tf.chief[0]
        if tf.task_type == "worker" and index < 0:
            index = tf.task_index
    config = WorkerConfig(chief=chief, index=index, deadline_s=float(args.deadline),
                          max_steps=int(args.max_steps), security=security_from(args))
    _setup_logging(args.log_level, "worker" if index < 0 else f"worker-{index}")
    stop = threading.Event()
    _install_signals(stop)
    return run_worker(config, stop)


def cmd_chief(args: argparse.Namespace) -> int:
    """asyncps chief."""
    from asyncps.chief.main import ChiefConfig, run_chief

    ps = tuple(a for a in args.ps.split(",") if a)
    workers = int(args.workers)
    tf = _tf_config()
    port = _port(args, tf, "chief")
    if tf is not None:
        ps = ps or tf.ps
        workers = workers if args.workers_set else len(tf.worker)
    run = run_config_from(args, workers, len(ps))
    config = ChiefConfig(ps=ps, run=run, run_dir=Path(args.run_dir), host=args.host, port=port,
                         port_file=args.port_file, resume=bool(args.resume), security=security_from(args),
                         checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None)
    _setup_logging(args.log_level, "chief")
    stop = threading.Event()
    _install_signals(stop)
    return run_chief(config, stop)


def cmd_local(args: argparse.Namespace) -> int:
    """asyncps local."""
    from asyncps.tools.local import default_run_dir, run_local

    run = run_config_from(args, int(args.workers), int(args.ps))
    if args.resume and not args.run_dir:
        raise ValueError("--resume needs the --run-dir of the run to continue")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    return run_local(run, run_dir, progress=not args.quiet, resume=bool(args.resume), secure=bool(args.secure),
                     client_auth=not args.tls_no_client_auth)


def cmd_health(args: argparse.Namespace) -> int:
    """asyncps health ADDR."""
    from asyncps.security import check_health

    if check_health(args.address, security_from(args), float(args.timeout)):
        print(f"{args.address}: SERVING")
        return 0
    print(f"{args.address}: not serving (unreachable or unhealthy within {args.timeout}s)", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The full command-line interface."""
    parser = argparse.ArgumentParser(prog="asyncps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, role_port: bool) -> None:
        _add(p, "--log-level", "INFO", "DEBUG | INFO | WARNING | ERROR")
        if role_port:
            _add(p, "--host", "0.0.0.0", "interface to bind")
            _add(p, "--port", None, f"port to bind (0: any free port; default: TF_CONFIG's, else {DEFAULT_PORT})",
                 type=int)
            _add(p, "--port-file", "", "write the bound port to this file (for --port 0)")

    p = sub.add_parser("ps", help="run one parameter-server shard")
    common(p, True)
    _add(p, "--index", 0, "shard index (TF_CONFIG task.index wins)", type=int)
    _add(p, "--chunk-bytes", RunConfig().chunk_bytes, "bytes per streamed chunk", type=int)
    add_security_flags(p)
    p.set_defaults(fn=cmd_ps)

    p = sub.add_parser("worker", help="run one worker")
    common(p, False)
    _add(p, "--chief", "", "the chief's HOST:PORT (or TF_CONFIG cluster.chief)")
    _add(p, "--index", -1, "worker index (-1: assigned by the chief)", type=int)
    _add(p, "--deadline", 60.0, "seconds to keep retrying an unreachable chief or shard", type=float)
    _add(p, "--max-steps", 0, "stop after this many steps (0: when the chief says)", type=int)
    add_security_flags(p)
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("chief", help="run the chief (coordinator, evaluation, run directory)")
    common(p, True)
    _add(p, "--ps", "", "comma-separated shard addresses (or TF_CONFIG cluster.ps)")
    _add(p, "--workers", 2, "number of workers (or len(TF_CONFIG cluster.worker))", type=int)
    _add(p, "--run-dir", "runs/chief", "run directory")
    _add(p, "--checkpoint-dir", "", "checkpoint directory (default: RUN_DIR/ckpt)")
    p.add_argument("--resume", action="store_true", default=_env_flag("resume"),
                   help="continue from the latest checkpoint (env ASYNCPS_RESUME=1)")
    add_run_flags(p)
    add_security_flags(p)
    p.set_defaults(fn=cmd_chief)

    p = sub.add_parser("local", help="run a whole cluster as local processes, with progress")
    _add(p, "--ps", 2, "number of parameter-server shards", type=int)
    _add(p, "--workers", 2, "number of workers", type=int)
    _add(p, "--run-dir", "", "run directory (default: runs/<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--secure", action="store_true",
                   help="mutual TLS and a token on every RPC (development CA and token made in RUN_DIR/secrets)")
    p.add_argument("--tls-no-client-auth", action="store_true",
                   help="with --secure: servers do not require client certificates (TLS instead of mTLS)")
    add_run_flags(p)
    p.set_defaults(fn=cmd_local)

    p = sub.add_parser("health", help="check a server through the standard gRPC health service")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--timeout", default=3.0, type=float, help="seconds (default: %(default)s)")
    add_security_flags(p)
    p.set_defaults(fn=cmd_health)

    from asyncps.tools import experiment, report  # cheap: matplotlib and the cluster load only when run

    p = sub.add_parser("experiment", help="run a sweep of local clusters from a YAML/TOML spec and check its outcome")
    experiment.add_arguments(p)
    p.set_defaults(fn=experiment.cmd_experiment)

    p = sub.add_parser("report", help="figures and report.md for a run directory or a sweep directory")
    report.add_arguments(p)
    p.set_defaults(fn=report.cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn configuration errors into one clear line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.workers_set = ENV_PREFIX + "WORKERS" in os.environ or any(
        a == "--workers" or a.startswith("--workers=") for a in (argv if argv is not None else sys.argv))
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except (ValueError, ClusterConfigError, FileNotFoundError) as exc:
        print(f"asyncps {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
