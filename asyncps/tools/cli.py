"""The `asyncps` command: one subcommand per role, plus the local launcher and tools."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncps.cluster import (
    SLURM_PORT_BASE,
    ClusterConfigError,
    TFConfig,
    parse_slurm,
    parse_tf_config,
    tf_config_json,
)
from asyncps.config import (
    AUTO,
    ENV_PREFIX,
    OFF,
    RunConfig,
    env_name,
    flag_name,
    parse_setting,
    read_settings_file,
    resume_changes,
    resumed_layers,
    run_options,
    settings_from_env,
    shown_default,
)
from asyncps.ml.userfns import USER_PATH_ENV, add_user_path, user_path_from_env
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.rundir import wait_port_file
from asyncps.signals import SignalRoute
from asyncps.transport.registry import TRANSPORTS

DEFAULT_PORT = 8470


def _env_default(dest: str, default: Any) -> Any:
    """A flag's default: ASYNCPS_<FLAG> from the environment if set, else the built-in one."""
    return os.environ.get(ENV_PREFIX + dest.upper(), default)


def _env_flag(dest: str) -> bool:
    """A boolean flag's default from ASYNCPS_<FLAG> (1/true/yes)."""
    return str(_env_default(dest, "")).strip().lower() in ("1", "true", "yes")


def _add(parser: argparse._ActionsContainer, flag: str, default: Any, help: str, shown: str = "",
         **kwargs: Any) -> None:
    """A flag with its ASYNCPS_<FLAG> variable; the help shows `shown`, else the default (an empty one: none)."""
    dest = flag.lstrip("-").replace("-", "_")
    env = ENV_PREFIX + dest.upper()
    shown = shown or ("none" if default in ("", None) else str(default))
    parser.add_argument(flag, dest=dest, default=_env_default(dest, default),
                        help=f"{help} (env {env}; default: {shown})".replace("%", "%%"), **kwargs)


def port_or_off(text: str) -> int:
    """A port flag's value: a port number (0: any free port), or off (-1)."""
    if str(text).strip().lower() == OFF:
        return -1
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a port number or off, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"wants a port number (0-65535) or off, got {text!r}")
    return port


def int_or_word(word: str, value: int) -> Callable[[str], int]:
    """A flag's type: an integer, or `word` (off, auto) standing for `value`."""
    def parse(text: str) -> int:
        return value if str(text).strip().lower() == word else int(text)

    return parse


def _optional_port(port: int) -> int | None:
    """A port_or_off flag's value as the roles take it: None when off."""
    return None if port < 0 else port


def count_or_auto(text: str) -> int:
    """A count flag's value: a number >= 1, or auto (0: asyncps chooses, as the flag's help says)."""
    if str(text).strip().lower() == AUTO:
        return 0
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"wants a number >= 1 or auto, got {text!r}")
    return count


class _NotHere(argparse.Action):
    """A flag that means something else here: a clear error instead of a silent other meaning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} lists shard addresses (asyncps chief --ps HOST:PORT,...); "
                     "the number of shards is --num-ps N")


def add_run_flags(p: argparse.ArgumentParser, skip: Sequence[str] = (), only: Sequence[str] | None = None,
                  config_file: bool = True, title: str = "training run") -> None:
    """The flags of the RunConfig fields (all, or `only` these, less `skip`), generated from the fields'
    Options; see run_settings for how they combine with --run-config and the environment."""
    g = p.add_argument_group(title, "precedence: default < --run-config file < ASYNCPS_* environment "
                                              "< flag" if config_file else "precedence: default < environment < flag")
    if config_file:
        _add(g, "--run-config", "", "JSON, YAML or TOML file of RunConfig fields (e.g. a run's config.json)")
    names = []
    defaults = RunConfig()
    for name, option in run_options().items():
        if name in skip or (only is not None and name not in only):
            continue
        flag, switch = flag_name(name), isinstance(getattr(defaults, name), bool)
        kind: dict[str, Any] = ({"action": "store_const", "const": "true"} if switch  # --FLAG on, --no-FLAG off
                                else {"action": "append" if option.repeat else "store", "metavar": name.upper()})
        g.add_argument(flag, dest=name, default=argparse.SUPPRESS,
                       help=f"{option.help} (env {env_name(name)}; default: {shown_default(name)})".replace("%", "%%"),
                       **kind)
        if switch:
            g.add_argument("--no-" + flag.removeprefix("--"), dest=name, action="store_const", const="false",
                           default=argparse.SUPPRESS, help=f"turn {flag} off")
        names.append(name)
    p.set_defaults(run_fields=tuple(names))


def run_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The settings layers of the run flags, lowest precedence first: the --run-config file, the
    ASYNCPS_* environment, the flags given on the command line (even when equal to the default)."""
    names: tuple[str, ...] = args.run_fields
    file_layer = read_settings_file(Path(args.run_config)) if getattr(args, "run_config", "") else {}
    env_layer = settings_from_env(os.environ if environ is None else environ, names)
    flag_layer: dict[str, Any] = {}
    for name in names:
        if not hasattr(args, name):  # not given: argparse leaves SUPPRESSed flags out
            continue
        value = getattr(args, name)
        for text in value if isinstance(value, list) else [value]:
            try:
                parsed = parse_setting(name, text)
            except ValueError as exc:
                raise ValueError(f"{flag_name(name)} {text!r}: {exc}") from None
            if run_options()[name].repeat:  # repeated flags add to each other
                parsed = {k: {**flag_layer.get(k, {}), **v} for k, v in parsed.items()}
            flag_layer.update(parsed)
    return [file_layer, env_layer, flag_layer]


def run_config_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                    **forced: Any) -> RunConfig:
    """The RunConfig of the run flags: default < --run-config file < environment < flags < `forced`."""
    return RunConfig.from_layers(*run_settings(args, environ), forced)


def recorded_settings(run_dir: Path, resume: bool) -> dict[str, Any] | None:
    """The settings the run in `run_dir` recorded (its config.json's `run`) when this start resumes it
    (the directory has a manifest, or --resume), else None (a new run, or no config.json to go by)."""
    from asyncps.rundir import RunConfigRecord, RunManifest

    if not (resume or RunManifest.load(run_dir) is not None):
        return None
    record = RunConfigRecord.load_if_present(run_dir)
    return None if record is None else dict(record.run)


def resumable_config(run_dir: Path, resume: bool, *layers: Mapping[str, Any]) -> RunConfig:
    """The RunConfig of `layers`; on a resumed run over its recorded settings, refused (ValueError naming
    each flag with its old and new value) when they would change what the run is."""
    recorded = recorded_settings(run_dir, resume)
    if recorded is None:
        return RunConfig.from_layers(*layers)
    run = RunConfig.from_layers(*resumed_layers(recorded, *layers))
    changes = resume_changes(recorded, run)
    if changes.refused:
        from asyncps.rundir import RunDir

        raise ValueError(changes.refusal(run_dir, RunDir(run_dir).config))
    return run


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """Authentication and encryption flags (every role; the token itself never goes on a command line)."""
    g = p.add_argument_group("security")
    _add(g, "--token-file", "", "file holding the workers' token required on every RPC (else env ASYNCPS_TOKEN)")
    _add(g, "--chief-token-file", "", "file holding the chief's token: servers grant it the chief's methods, "
                                      "the chief sends it (else env ASYNCPS_CHIEF_TOKEN)")
    g.add_argument("--shared-token", action="store_true", default=_env_flag("shared_token"),
                   help="the one --token-file token acts as every role, chief included (compatibility; "
                        "env ASYNCPS_SHARED_TOKEN=1)")
    _add(g, "--chief-identity", "asyncps-chief", "comma-separated certificate names (CN or SAN) that are "
                                                "the chief's under mTLS; other client certificates are workers'")
    _add(g, "--tls-cert", "", "PEM certificate: served by servers, presented as client certificate by clients")
    _add(g, "--tls-key", "", "PEM private key of --tls-cert")
    _add(g, "--tls-ca", "", "PEM CA: clients verify servers with it; servers with a cert require client certs (mTLS)")
    _add(g, "--tls-server-name", "", "host name to check in the server certificate instead of the address's")
    g.add_argument("--tls-no-client-auth", action="store_true", default=_env_flag("tls_no_client_auth"),
                   help="servers with --tls-ca do not require client certificates: TLS, not mTLS "
                        "(env ASYNCPS_TLS_NO_CLIENT_AUTH=1)")


def security_from(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig of the security flags."""
    security = SecurityConfig.from_flags(
        args.token_file, args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name,
        require_client_cert=not args.tls_no_client_auth, chief_token_file=args.chief_token_file,
        shared_token=bool(args.shared_token),
        chief_identities=tuple(n.strip() for n in str(args.chief_identity).split(",") if n.strip()))
    if args.command in ("ps", "chief"):
        security.check_server()
    return security


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


def _install_signals(event: threading.Event, on_sigterm: threading.Event | None = None) -> None:
    """SIGINT sets `event`; SIGTERM sets `on_sigterm` when given (the chief's handover), else `event`; set by
    asyncps.signals' dispatch thread, never inside the handler (which could interrupt `event.wait()`)."""
    term = on_sigterm or event
    SignalRoute({signal.SIGTERM: lambda _: term.set(), signal.SIGINT: lambda _: event.set()}).install()


def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def require_module(module: str, command: str, install: str) -> None:
    """A clear error, before anything starts, when an optional dependency of `command` is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{command} needs {module}, which is not installed: {install}")


def require_tensorflow(command: str) -> None:
    """TensorFlow is an extra (the user picks the build): say how to get one."""
    require_module("tensorflow", command, "pip install 'asyncps[tf]' (or 'asyncps[cpu]' for the CPU-only "
                   "build), or install the TensorFlow build of your choice")


def cmd_ps(args: argparse.Namespace) -> int:
    """asyncps ps."""
    from asyncps.ps.main import EXIT_TERMINATED, PsConfig, run_ps

    tf = _tf_config()
    port, index = _port(args, tf, "ps"), int(args.index)
    if tf is not None and tf.task_type == "ps":
        index = tf.task_index
    run = run_config_from(args)
    config = PsConfig(host=args.host, port=port, index=index, port_file=args.port_file,
                      health_port=_optional_port(args.health_port), chunk_bytes=run.chunk_bytes,
                      security=security_from(args),
                      chief_timeout_s=run.chief_timeout_s,
                      handler_threads=int(args.handler_threads),
                      stream_idle_timeout_s=float(args.stream_idle_timeout_s),
                      max_streams_per_peer=int(args.max_streams_per_peer),
                      transport_settings={s.name: getattr(args, s.name) for _, s in TRANSPORTS.shard_settings()},
                      plugins=tuple(m.strip() for m in str(args.plugins).split(",") if m.strip()))
    replicas = int(args.replicas)
    if replicas not in (1, 2):
        raise ValueError(f"--replicas is 1 (the shard alone) or 2 (the shard and its backup), got {replicas}")
    _setup_logging(args.log_level, f"ps-{index}" if replicas == 1 else f"ps-{index} pair")
    stop, terminated = threading.Event(), threading.Event()

    def on_sigterm(_signum: int) -> None:
        terminated.set()
        stop.set()

    SignalRoute({signal.SIGTERM: on_sigterm, signal.SIGINT: lambda _: stop.set()}).install()
    if replicas == 2:
        from asyncps.tools.shardpair import ShardPair

        pair = ShardPair(args.argv, args.host, port, index, args.port_file, config.security,
                         data_port=int(getattr(args, "data_port", -1)))
        code = pair.run(stop)
    else:
        code = run_ps(config, stop)
    if code == 0 and terminated.is_set():
        # SIGTERM is an orchestrator replacing this task (unhealthy, drained, evicted), not the run's end (the
        # chief's Shutdown): exiting 0 would read as "complete" to swarm's or Kubeflow's on-failure restart policy,
        # which would then never bring the shard back
        logging.getLogger("asyncps.ps").info("shard %d: stopped by SIGTERM: exiting %d (the chief's Shutdown "
                                                "exits 0)", index, EXIT_TERMINATED)
        return EXIT_TERMINATED
    return code


def chief_beside(port_file: Path, timeout_s: float) -> str:
    """The address of a chief on this host that publishes its port in port_file, waited for only once
    TensorFlow is loaded: a worker started beside its chief loads it (most of a worker's start) while the
    chief loads its own, instead of after the chief serves. Importing runs no op, so the thread limits the
    worker sets later still apply."""
    from asyncps.ml.tfutil import quiet_tensorflow

    quiet_tensorflow()
    import keras  # noqa: F401 - loads tensorflow too (Keras 3's backend)
    import tensorflow  # noqa: F401

    return f"{LOOPBACK_HOST}:{wait_port_file(port_file, timeout_s)}"


def cmd_worker(args: argparse.Namespace) -> int:
    """asyncps worker."""
    require_tensorflow("asyncps worker")
    from asyncps.worker.config import WorkerConfig
    from asyncps.worker.main import run_worker

    chief, index = args.chief, int(args.index)
    tf = _tf_config()
    if tf is not None:
        chief = chief or tf.chief[0]
        if tf.task_type == "worker" and index < 0:
            index = tf.task_index
    deadline = run_config_from(args).chief_timeout_s or math.inf  # off: never give up on the chief
    if args.chief_port_file:
        chief = chief_beside(Path(args.chief_port_file), deadline)
    config = WorkerConfig(chief=chief, index=index, deadline_s=deadline,
                          max_steps=int(args.max_steps), security=security_from(args),
                          logical=int(args.logical))
    _setup_logging(args.log_level, "worker" if index < 0 else f"worker-{index}")
    stop = threading.Event()
    _install_signals(stop)
    return run_worker(config, stop)


def cmd_chief(args: argparse.Namespace) -> int:
    """asyncps chief."""
    ps = tuple(a for a in args.ps.split(",") if a)
    tf = _tf_config()
    port = _port(args, tf, "chief")
    file_layer, env_layer, flag_layer = run_settings(args)
    tf_layer = {}
    if tf is not None:  # TF_CONFIG's cluster wins over a file, --num-workers / ASYNCPS_NUM_WORKERS over it
        ps = ps or tf.ps
        tf_layer = {"num_workers": len(tf.worker)}
    if not ps:
        raise ValueError("the chief needs its shards' addresses: --ps HOST:PORT,HOST:PORT,... (or env ASYNCPS_PS, "
                         "or TF_CONFIG's cluster.ps)")
    run = resumable_config(Path(args.run_dir), bool(args.resume), file_layer, tf_layer, env_layer, flag_layer,
                           {"num_ps": len(ps)})
    require_tensorflow("asyncps chief")
    from asyncps.chief.main import ChiefConfig, run_chief

    config = ChiefConfig(ps=ps, run=run, run_dir=Path(args.run_dir), host=args.host, port=port,
                         port_file=args.port_file, health_port=_optional_port(args.health_port),
                         resume=bool(args.resume),
                         security=security_from(args),
                         checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
                         metrics_port=int(args.prometheus_port), metrics_port_file=args.prometheus_port_file)
    _setup_logging(args.log_level, "chief")
    stop, handover = threading.Event(), threading.Event()
    _install_signals(stop, handover if args.on_sigterm == "handover" else None)
    return run_chief(config, stop, handover)


def cmd_slurm(args: argparse.Namespace) -> int:
    """asyncps slurm: this task's role from the Slurm step (as TF_CONFIG, which the role then reads), run."""
    tf = parse_slurm(os.environ, int(args.num_ps), int(args.port_base))
    os.environ["TF_CONFIG"] = tf_config_json(tf)
    name = tf.task_type if tf.task_type == "chief" else f"{tf.task_type}-{tf.task_index}"
    print(f"asyncps slurm: rank {os.environ['SLURM_PROCID']} on {os.environ.get('SLURMD_NODENAME', '?')} is "
          f"{name} ({tf.own_address})", file=sys.stderr, flush=True)
    serves = ["--host", str(args.host), "--port", str(tf.own_port)] if tf.task_type != "worker" else []
    return main([tf.task_type, *serves])


def cmd_local(args: argparse.Namespace) -> int:
    """asyncps local."""
    require_tensorflow("asyncps local")
    from asyncps.tools.local import default_run_dir, holds_run, run_local

    if args.resume and not args.run_dir:
        raise ValueError("--resume needs the --run-dir of the run to continue")
    if args.run_dir and not args.resume and holds_run(Path(args.run_dir)):
        raise ValueError(f"--run-dir {args.run_dir} holds a run already: give --resume to continue it, or name a "
                         "new --run-dir")
    run = (resumable_config(Path(args.run_dir), bool(args.resume), *run_settings(args)) if args.run_dir
           else run_config_from(args))
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    return run_local(run, run_dir, progress=not args.quiet, resume=bool(args.resume), secure=bool(args.secure),
                     client_auth=not args.tls_no_client_auth, prometheus_port=int(args.prometheus_port),
                     max_restarts=int(args.max_restarts), fork=not args.exec_roles, replicas=int(args.replicas))


def cmd_health(args: argparse.Namespace) -> int:
    """asyncps health ADDR."""
    from asyncps.net.security import check_health

    if check_health(args.address, security_from(args), float(args.timeout_s)):
        print(f"{args.address}: SERVING")
        return 0
    print(f"{args.address}: not serving (unreachable or unhealthy within {args.timeout_s} s)", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    """asyncps status ADDR [--watch]."""
    from asyncps.tools.progress import watch

    return watch(args.address, security_from(args), bool(args.watch), float(args.interval_s), int(args.count),
                 timeout_s=float(args.timeout_s))


def cmd_export(args: argparse.Namespace) -> int:
    """asyncps export CKPT_DIR."""
    require_tensorflow("asyncps export")
    from asyncps.tools.export import export_checkpoint

    out = export_checkpoint(Path(args.checkpoint), Path(args.out) if args.out else None,
                            Path(args.run_config) if args.run_config else None)
    from asyncps.rundir import exported_model

    print(f"exported {exported_model(out)} and {out / 'saved_model'}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncps")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_prometheus_port(p: argparse.ArgumentParser) -> None:
    _add(p, "--prometheus-port", OFF, "serve the chief's Prometheus metrics on this port (0: any free port)",
         type=port_or_off)


def build_parser() -> argparse.ArgumentParser:
    """The full command-line interface."""
    parser = argparse.ArgumentParser(prog="asyncps", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"asyncps {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # no prefix of a flag stands for it: one spelling per flag (a dropped --eval-every must not mean --eval-every-s)
    add_parser = functools.partial(sub.add_parser, allow_abbrev=False)

    def common(p: argparse.ArgumentParser, role_port: bool) -> None:
        _add(p, "--log-level", "INFO", "DEBUG | INFO | WARNING | ERROR")
        add_user_path_flag(p)
        if role_port:
            _add(p, "--host", LOOPBACK_HOST, "interface to bind: this machine only by default; 0.0.0.0 (every "
                 "interface) for a container or a cluster, with a token or mTLS (env ASYNCPS_HOST)")
            _add(p, "--port", None, "port to bind (0: any free port)", shown=f"TF_CONFIG's, else {DEFAULT_PORT}",
                 type=int)
            _add(p, "--port-file", "", "write the bound port to this file (for --port 0)")
            _add(p, "--health-port", OFF, "also serve the gRPC health service on this port, in plaintext and "
                 "without a token, for probes that cannot do TLS (the kubelet's grpc probes)", type=port_or_off)

    p = add_parser("ps", help="run one parameter-server shard")
    common(p, True)
    _add(p, "--index", 0, "shard index (TF_CONFIG task.index wins)", type=int)
    add_run_flags(p, only=("chunk_bytes", "chief_timeout_s"), config_file=False, title="streaming and liveness")
    g = p.add_argument_group("limits", "stalled or slow clients cannot take the shard's threads")
    _add(g, "--handler-threads", 256, "RPC handler threads; a quarter (at least 4) are kept free of streams",
         type=int)
    _add(g, "--stream-idle-timeout-s", 30.0, "seconds a stream may wait on its client before it is ended",
         type=float)
    _add(g, "--max-streams-per-peer", AUTO, "streams one client connection may have open (auto: min(16, half of "
         "--handler-threads))", type=count_or_auto)
    for owner, setting in TRANSPORTS.shard_settings():  # the data connection's and each transport's, from the registry
        _add(g, setting.flag, setting.default, f"{setting.help} [{owner}]", type=type(setting.default))
    _add(p, "--replicas", 1, "2: this shard as a pair of processes, the shard and a backup that applies every push "
         "before the shard answers it and takes over the shard's port when the shard's process dies, nothing lost; "
         "a new backup is seeded from it (asyncps.tools.shardpair). The pair shares this container, pod or node: "
         "losing that still costs a restore from the latest checkpoint", type=int)
    _add(p, "--plugins", "", "comma-separated modules (package.module) whose rule plugins (package.module:Class "
         "specs) an Initialize may name; the shard imports no other module a request names (installed entry "
         "points of asyncps.optimizers, .policies, .modes are always allowed)")
    add_security_flags(p)
    p.set_defaults(fn=cmd_ps)

    p = add_parser("worker", help="run one worker")
    common(p, False)
    _add(p, "--chief", "", "the chief's HOST:PORT (or TF_CONFIG cluster.chief)")
    _add(p, "--chief-port-file", "", "instead of --chief: a chief on this host that writes its port to this file "
         "(its --port-file); the worker loads TensorFlow while it waits for it (asyncps local starts its workers "
         "beside the chief so)")
    _add(p, "--index", AUTO, "worker index (auto: assigned by the chief)", type=int_or_word(AUTO, -1))
    _add(p, "--max-steps", OFF, "stop after this many steps, else when the chief says (0: off)",
         type=int_or_word(OFF, 0))
    _add(p, "--logical", 1, "logical workers (threads) in this process, indices --index .. --index+N-1",
         type=int)
    add_run_flags(p, only=("chief_timeout_s",), config_file=False, title="liveness")
    add_security_flags(p)
    p.set_defaults(fn=cmd_worker)

    p = add_parser("chief", help="run the chief (coordinator, evaluation, run directory)")
    common(p, True)
    _add(p, "--ps", "", "comma-separated shard addresses (or TF_CONFIG cluster.ps)")
    _add(p, "--run-dir", "runs/chief", "run directory")
    _add(p, "--checkpoint-dir", "", "checkpoint directory (default: RUN_DIR/ckpt)")
    p.add_argument("--resume", action="store_true", default=_env_flag("resume"),
                   help="continue from the latest checkpoint (env ASYNCPS_RESUME=1)")
    _add_prometheus_port(p)
    _add(p, "--prometheus-port-file", "", "write the bound Prometheus port to this file (for --prometheus-port 0)")
    _add(p, "--on-sigterm", "finish", "finish: end the run on SIGTERM (evaluate, summary, shut the shards "
         "down); handover: exit 143 at once and leave shards and workers running for a replacement chief "
         "(an orchestrator replacing the task); SIGINT always finishes", choices=("finish", "handover"))
    add_run_flags(p, skip=("num_ps",))  # the number of shards is the number of --ps addresses
    add_security_flags(p)
    p.set_defaults(fn=cmd_chief)

    p = add_parser("slurm", help="run this Slurm task's role: rank 0 the chief, ranks 1..N the shards, the "
                   "rest workers (srun -n TASKS asyncps slurm --num-ps N); settings from ASYNCPS_* variables")
    _add(p, "--num-ps", 1, "how many tasks are shards (ranks 1..N)", type=int)
    _add(p, "--port-base", SLURM_PORT_BASE, "a node's tasks bind this port, the next, ... in rank order", type=int)
    _add(p, "--host", "0.0.0.0", "interface the chief and the shards bind (give the cluster a token or mTLS)")
    p.set_defaults(fn=cmd_slurm)

    p = add_parser("local", help="run a whole cluster as local processes, with progress")
    add_user_path_flag(p)
    _add(p, "--run-dir", "", "run directory; one that holds a run is refused unless --resume",
         shown="runs/<timestamp>")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--secure", action="store_true",
                   help="mutual TLS and a token on every RPC (development CA and token made in RUN_DIR/secrets)")
    p.add_argument("--tls-no-client-auth", action="store_true",
                   help="with --secure: servers do not require client certificates (TLS instead of mTLS)")
    _add(p, "--max-restarts", 5, "restarts of each process (a shard, a worker, the chief) after a crash; one more "
         "crash and the launcher gives up on it (a dead chief or shard ends the run)", type=int)
    _add(p, "--replicas", 1, "copies of each shard's state: 2 starts a backup per shard that applies every push "
         "before the shard answers it and takes over the shard's port when it dies, nothing lost (async and SSP "
         "runs; a new backup is seeded from the live shard); 1: none, a dead shard is restored from the latest "
         "checkpoint", type=int)
    p.add_argument("--exec-roles", action="store_true",
                   help="start the chief and each worker process as a fresh interpreter that loads TensorFlow "
                        "itself, instead of forking them from one process that loaded it once (the default)")
    _add_prometheus_port(p)
    add_run_flags(p)
    # --ps lists shard addresses (asyncps chief); before 0.2 `local --ps N` was the count
    p.add_argument("--ps", action=_NotHere, nargs="?", help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_local)

    p = add_parser("health", help="check a server through the standard gRPC health service")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--timeout-s", default=3.0, type=float, help="seconds to wait for an answer (default: %(default)s)")
    add_security_flags(p)
    p.set_defaults(fn=cmd_health)

    p = add_parser("status", help="a running cluster's progress, from its chief (GetStatus)")
    p.add_argument("address", help="the chief's HOST:PORT")
    p.add_argument("--watch", action="store_true", help="keep showing it (a progress bar on a terminal) until done")
    p.add_argument("--interval-s", default=2.0, type=float,
                   help="seconds between polls with --watch (default: %(default)s)")
    p.add_argument("--count", default=0, type=int,
                   help="with --watch: stop after this many polls (0: off, at the end; default: off)")
    p.add_argument("--timeout-s", default=5.0, type=float, help="seconds to wait for the chief (default: %(default)s)")
    add_security_flags(p)
    p.set_defaults(fn=cmd_status)

    p = add_parser("export", help="model.keras and a SavedModel from a checkpoint")
    p.add_argument("checkpoint", help="a checkpoint directory (ckpt-NNNNNNNN), a checkpoint root or a run directory "
                                      "(its latest checkpoint)")
    p.add_argument("--out", default="", help="where to write them (default: the checkpoint directory)")
    p.add_argument("--run-config", default="", help="a run configuration file (e.g. a run's config.json) instead "
                                                    "of the settings the checkpoint's manifest records")
    add_user_path_flag(p)
    p.set_defaults(fn=cmd_export)

    from asyncps.tools import (  # cheap: matplotlib and the cluster load only when run
        composerun,
        devcerts,
        experiment,
        report,
    )

    p = add_parser("compose-run", help="docker compose up -d, restart crashed or killed containers, "
                                           "exit with the chief's status")
    composerun.add_arguments(p)
    p.set_defaults(fn=composerun.cmd_compose_run)

    p = add_parser("experiment", help="run a sweep of local clusters from a YAML/TOML spec and check its outcome")
    experiment.add_arguments(p)
    p.set_defaults(fn=experiment.cmd_experiment)

    p = add_parser("report", help="figures and report.md for a run directory or a sweep directory")
    report.add_arguments(p)
    p.set_defaults(fn=report.cmd_report)

    p = add_parser("devcerts", help="development TLS certificates (a throwaway CA, server, chief and client)")
    devcerts.add_arguments(p)
    p.set_defaults(fn=devcerts.cmd_devcerts)
    return parser


def add_user_path_flag(p: argparse.ArgumentParser) -> None:
    """--user-path DIR (repeatable): where the user's models, datasets and rule plugins are imported from."""
    p.add_argument("--user-path", action="append", default=[], metavar="DIR",
                   help=f"directory put on the Python path for package.module:function models, datasets, losses "
                        f"and rule plugins; repeatable (also env {USER_PATH_ENV}, {os.pathsep}-separated)")


def apply_user_path(args: argparse.Namespace) -> None:
    """Put --user-path and ASYNCPS_USER_PATH on sys.path, and in the environment for child processes."""
    dirs = add_user_path([*user_path_from_env(), *getattr(args, "user_path", [])])
    if dirs:
        os.environ[USER_PATH_ENV] = os.pathsep.join(dict.fromkeys(dirs))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn configuration errors into one clear line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (asyncps ps --replicas 2 passes it on)
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        apply_user_path(args)
        return fn(args)
    except (ValueError, ClusterConfigError, FileNotFoundError) as exc:
        print(f"asyncps {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
