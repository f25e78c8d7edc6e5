"""``elastic-run [options] SCRIPT``: start (or join) a job on this host.

The launcher's options become an ``AgentConfig``, and the agent runs the host's
workers (``elastic/agent/``). Options are read as ``options.py`` says (each has an
environment form); bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Optional, Sequence

from elastic.checkpoint import owner
from elastic.rendezvous import (
    ConfigError,
    EmbeddedEtcd,
    Etcd,
    EtcdConfig,
    JobKeys,
    JobStatus,
    RUNNING,
    RendezvousError,
    RendezvousSettings,
    validate_job_id,
)
from elastic.rendezvous.member_sync import follow_members
from elastic.rendezvous.rounds import RECOVERY_HOLD_WARM_S
from elastic.rendezvous.served import MEMBER_SYNC_S, ServedRendezvous

from ..agent import addressing, job_backend
from . import bare_metal, horovodrun, no_effect
from .join_hint import join_hint
from . import torchrun
from . import slurm
from . import etcd_secrets
from . import versions
from .options import (
    ETCD_OPTIONS,
    JOB_OPTIONS,
    USAGE_ERROR,
    OptionParser,
    add_allow_insecure,
    add_option,
    add_switch,
    coerce_env_values,
    etcd_config,
    exit_code,
    group_options,
    hang_timeout,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    ratio_above_one,
    rdzv_backend,
)
from ..agent import Agent, AgentConfig
from ..contract.console import ConsoleFormatter
from ..contract.devices import BACKENDS, choose_backend, may_have_cuda
from ..contract.straggler_policy import StragglerOptions
from ..contract.timeouts import ERROR, review
from ..agent.chaos import ChaosConfig
from ..agent.output_pump import ConsoleRanks, console_ranks, end_open_bar
from ..contract.log_files import byte_size

HELP = """\
Start (or join) an elastic data-parallel job: run SCRIPT in --nproc-per-node worker
processes on this host, with ranks assigned by an etcd v3 rendezvous. Workers that use
the elastic API re-form their ring in-process when members come and go; plain torchrun
scripts are restarted together on any change. Every option can also be given as an
environment variable: --min-np is ELASTIC_MIN_NP, and so on.

Without --rdzv-endpoint an embedded etcd is started and all workers run on this host.
torchrun's options (--nnodes, --rdzv-id, --nproc_per_node gpu, ...) and horovodrun's are
read too, or refused with what to use instead: docs/torchrun.md lists them.
`elastic-run checkpoints DIR` lists and verifies the checkpoints in DIR.
`elastic-run status --rdzv-endpoint E --job-id J` shows what a job is doing (or how it ended).
`elastic-run timeline LOG_DIR -o FILE.png` draws what a job did."""


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="elastic-run", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)

    def opt(flag, kind=str, default=None, help=""):
        add_option(p, flag, kind, default, help)

    opt("--np", positive_int, help="workers to start with; without an endpoint, all on this host")
    opt("--min-np", positive_int, help="smallest world size the job runs with (default --np)")
    opt("--max-np", positive_int, help="largest world size; further workers wait as spares (default --np)")
    opt("--nproc-per-node", positive_int, help="workers this agent runs (default --np, else --min-np, without an endpoint; else 1)")
    for flag, text in JOB_OPTIONS:
        opt(flag, help=text)
    opt("--rdzv-backend", rdzv_backend, "etcd", "etcd: an etcd v3 answers at --rdzv-endpoint (or the endpoint's "
        "host serves one, when it is one of its own addresses); c10d (torchrun's): the endpoint's host serves "
        "the rendezvous, a loopback endpoint included, the first agent that finds the port free")
    opt("--host-id", help="this host's identity (default: the host name)")
    opt("--host-addr", help="address other hosts reach this host's workers at (default: this host's address "
                            "on the route to etcd; gloo/NCCL then use the interface holding it)")
    opt("--rdzv-ttl", positive_float, 10.0, "seconds after which a silent host is declared lost")
    opt("--rdzv-timeout", positive_float, 600.0, "seconds to wait for min-np workers before failing")
    opt("--rdzv-settle", non_negative_float, 0.5, "seconds to wait for more joiners once min-np are present")
    opt("--collective-timeout", positive_float, 60.0, "seconds a collective may block before it counts as failed")
    opt("--hang-timeout", hang_timeout, help="seconds without progress after which a worker is declared hung, "
        "killed (replaced within --max-restarts); 0 or off disables (default: 3x the slowest commit interval "
        "seen, at least 5; at least 1 for a process stopped by a signal)")
    opt("--max-resets", non_negative_int, 20, "re-formations of the ring a worker survives within --reset-window")
    opt("--reset-window", positive_float, 3600.0, "seconds over which --max-resets counts re-formations")
    opt("--max-restarts", non_negative_int, 0, "crashed workers this agent replaces (0: none, the job goes on "
        "without them while --min-np are left); a torchrun-style script: failures that restart every worker")
    opt("--backend", str, "auto", "auto (cpu:gloo,cuda:nccl when every worker of this host has a GPU, "
        "else gloo), gloo or nccl (one GPU per worker, else refused)")
    opt("--log-dir", help="per-worker logs and events.jsonl")
    opt("--log-max-bytes", byte_size, "100M", "events.jsonl and each worker log rotate at this size "
        "(NAME.1 to NAME.5 kept; 100M, 64KiB, ...; 0: never)")
    opt("--console-ranks", console_ranks, help="ranks whose output the console shows: all, or a list (0,2-3) "
        "(default: every rank's lines, only rank 0's progress-bar redraws)")
    opt("--health-port", port, help="serve GET /healthz (pod probes) and /metrics (Prometheus) on this port")
    opt("--health-addr", help="address the health/metrics server listens on (default: --host-addr; "
                              "0.0.0.0 for every interface)")
    opt("--grace-period", positive_float, 30.0, "seconds workers get to leave after SIGTERM/SIGINT")
    opt("--leave-exit-code", exit_code, 0, "exit status after leaving a job that goes on (SIGTERM/SIGINT); "
        "a Kubernetes Job sets one its podFailurePolicy ignores, so that a preempted pod is recreated")
    add_switch(p, "--cold-starts", "start every worker as a fresh interpreter; by default workers are forked "
               "from a process of this agent that has imported torch already (a replacement skips that import)")
    opt("--checkpoint-dir", help="durable checkpoints: written here, resumed from here")
    opt("--checkpoint-every", positive_int, help="write a durable checkpoint every N commits (100 when "
        "--checkpoint-dir is given with neither this nor --checkpoint-interval)")
    opt("--checkpoint-interval", positive_float, help="and/or every S seconds")
    opt("--checkpoint-keep", positive_int, 3, "durable checkpoints to keep")
    add_switch(p, "--checkpoint-allow-fresh-start", "resume from the newest checkpoint that can be read, or "
               "from the initial state, when checkpoints exist but cannot be read (EIO, ESTALE, permissions) "
               "after 31 s of retries (1+2+4+8+16 s); without it the job fails (exit 1) naming them")
    add_switch(p, "--checkpoint-take-over", "use a --checkpoint-dir that another job id claimed (its job.json): "
               "resume an ended job's checkpoints under a new --job-id; that job's writes are no longer published")
    opt("--final-checkpoint-timeout", positive_float, 600.0,
        "seconds rank 0 may go on writing the final checkpoint once the job has ended")
    opt("--shard-replicas", non_negative_int, 1,
        "ShardedState: other workers (on other hosts where there are) keeping a copy of each committed shard")
    opt("--straggler-ratio", ratio_above_one, 1.5,
        "report a worker whose compute time per step (outside collectives) stays above this many times "
        "the median of the ranks, in 3 windows of 10 commits in a row")

    add_switch(p, "--evict-stragglers", "a reported straggler's host leaves the job gracefully (as on SIGTERM; "
           "nothing rolled back), if the rest stays >= --min-np")
    opt("--chaos-kill-every", positive_float, help="test resilience: SIGKILL one of this agent's workers every "
        "SECONDS on average (uniform 0.5x-1.5x), print a recovery report at the end")
    opt("--chaos-seed", int, help="seed of --chaos-kill-every's choices (default: random)")
    for flag, text in ETCD_OPTIONS:
        opt(flag, help=text)
    add_allow_insecure(p)
    opt("--etcd-retry-deadline", positive_float, help="seconds an etcd request is retried while etcd is "
        "unavailable before it counts as failed (default 30); agent and workers ride out longer outages anyway")
    p.add_argument(horovodrun.SHIM_FLAG, action="store_true", help="let the script's `import horovod.torch` give "
                   "elastic.horovod (unless a real Horovod is installed) [env ELASTIC_HOROVOD_SHIM=1]")
    p.add_argument("--version", action="version", version=f"elastic-run {_version()}")
    p.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script (all of them: "
                   "options after SCRIPT are never taken for ours)")
    group_options(p)
    return p


def _version() -> str:
    try:
        return importlib.metadata.version("elastic-run")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _split_at_script(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher options, [SCRIPT, *its arguments]).

    Everything after SCRIPT belongs to the script, as under torchrun. argparse cannot
    be left to find SCRIPT: it matches abbreviations in the whole argv first, so a
    script's ``--checkpoint`` would be refused as ambiguous (or taken, if unique).
    """
    takes_value = {flag: action.nargs != 0 for action in parser._actions for flag in action.option_strings}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        flag, has_value = token.split("=", 1)[0], "=" in token
        # The flag itself, else every option it abbreviates (argparse reports ambiguity later).
        matches = [flag] if flag in takes_value else [f for f in takes_value if f.startswith(flag) and f[:2] == "--"]
        i += 1 if has_value or not any(takes_value[f] for f in matches) else 2
    return list(argv), []


def _check_writable_dir(path: str) -> None:
    """Create ``path`` and prove a file can be written and synced there, before any
    training: an unusable checkpoint directory must not be found only at the first write."""
    probe = os.path.join(path, f".elastic-run-probe-{os.getpid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # as its step directories (docs/failures.md)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {path} is not usable: {exc.strerror or exc}") from None


def _claim_checkpoint_dir(path: str, job_id: str, take_over: bool) -> None:
    """Make ``path`` this job's (checkpoint/owner.py): another job's directory is refused
    before anything starts, so that two jobs never supersede and prune each other's steps."""
    try:
        owner.claim(path, job_id, take_over=take_over)
    except owner.DirectoryTaken as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {path}: cannot record the job's claim: {exc.strerror or exc}") from None


def parse(argv: Sequence[str]) -> tuple[AgentConfig, argparse.Namespace]:
    parser = build_parser()
    argv = torchrun.accept(argv, parser)  # torchrun's spellings (--nnodes, --rdzv-id, --nproc_per_node ...)
    argv = horovodrun.accept(argv, parser)  # horovodrun's spellings (-np, --reset-limit, python ...)
    launcher, script = _split_at_script(parser, argv)
    # "--" ends the options, so a SCRIPT such as "-x.py" is not taken for one.
    if not script and not {"-h", "--help", "--version"} & set(launcher):
        raise ConfigError("no SCRIPT: elastic-run [options] SCRIPT [args] (elastic-run --help lists the options)")
    args = parser.parse_args([*launcher, "--", *script[:1]] if script else launcher)
    args.args = script[1:]
    given = no_effect.given_as(parser, args)
    coerce_env_values(parser, args)
    slurm.apply(args, os.environ)  # under srun: Slurm's job id, node name, rendezvous (explicit options win)
    etcd_secrets.apply_job_secret(args, os.environ)  # ELASTIC_JOB_SECRET with the user's endpoint
    etcd_secrets.resolve_password(args, argv)  # from its file; never to workers but as a 0600 file
    if args.backend not in BACKENDS:
        raise ConfigError(f"--backend must be auto, gloo or nccl (got {args.backend!r})")
    if not args.module and not os.path.isfile(args.script):
        raise ConfigError(f"script not found: {args.script}")
    if args.rdzv_endpoint and not args.job_id:
        raise ConfigError("--job-id is required with --rdzv-endpoint (torchrun's --rdzv-id)")
    np_ = args.np
    min_np = args.min_np or np_ or (args.max_np if args.max_np else None)
    max_np = args.max_np or np_ or min_np
    if min_np is None:
        raise ConfigError("give --np or --min-np")
    if np_ is not None and not (min_np <= np_ <= max_np) and args.min_np and args.max_np:
        raise ConfigError(f"--np {np_} must lie between --min-np {min_np} and --max-np {max_np}")
    if min_np > max_np:  # named as typed, not as RendezvousSettings' fields
        low = given.get("min_np") or given.get("np")
        high = given.get("max_np") or given.get("np")
        raise ConfigError(f"{low} {min_np} is above {high} {max_np}: the smallest world size must not "
                          "exceed the largest")
    if args.rdzv_settle < 0:
        raise ConfigError(f"{given.get('rdzv_settle', '--rdzv-settle')} must not be negative (got {args.rdzv_settle})")
    nproc = args.nproc_per_node
    if nproc is None:
        nproc = (np_ or min_np) if not args.rdzv_endpoint else 1
    settings = RendezvousSettings(
        min_np=min_np, max_np=max_np, settle=args.rdzv_settle, timeout=args.rdzv_timeout,
        **({} if args.cold_starts else {"recovery_hold": RECOVERY_HOLD_WARM_S}),
    )
    job_id = validate_job_id(args.job_id or "local")
    backend = args.backend
    if backend != "gloo":  # auto or nccl: is there a GPU for every worker of this host? (devices.py)
        cuda, count = False, 0
        if may_have_cuda():  # torch only where a GPU may be: importing it costs every start 1.4 s
            import torch

            cuda = torch.cuda.is_available()
            count = torch.cuda.device_count() if cuda else 0
        backend = choose_backend(backend, cuda_available=cuda, device_count=count, nproc_per_node=nproc)
    host_id = args.host_id or socket.gethostname()
    first_endpoint = EtcdConfig.from_string(args.rdzv_endpoint).endpoints[0] if args.rdzv_endpoint else None
    host_addr = args.host_addr or addressing.default_host_addr(first_endpoint, host_id)
    socket_ifname = addressing.interface_holding(host_addr)
    if socket_ifname is None:
        logging.getLogger(__name__).info(
            "no interface holds --host-addr %s (NAT?): gloo/NCCL pick their own interface", host_addr)
    command = ("-m", args.script, *args.args) if args.module else (args.script, *args.args)
    checkpoint = {}
    if args.checkpoint_dir:
        _check_writable_dir(os.path.abspath(args.checkpoint_dir))
        _claim_checkpoint_dir(os.path.abspath(args.checkpoint_dir), job_id, bool(args.checkpoint_take_over))
        checkpoint = dict(
            checkpoint_dir=os.path.abspath(args.checkpoint_dir),
            checkpoint_every=args.checkpoint_every,
            checkpoint_interval=args.checkpoint_interval,
            checkpoint_keep=args.checkpoint_keep,
            checkpoint_allow_fresh_start=bool(args.checkpoint_allow_fresh_start),
        )
        if args.checkpoint_every is None and args.checkpoint_interval is None:
            checkpoint["checkpoint_every"] = 100
    etcd_options = {
        k: getattr(args, k)
        for k in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file", "etcd_retry_deadline")
        if getattr(args, k)
    }
    config = AgentConfig(
        command=command,
        nproc_per_node=nproc,
        settings=settings,
        job_id=job_id,
        host_id=host_id,
        host_addr=host_addr,
        socket_ifname=socket_ifname,
        ttl=args.rdzv_ttl,
        collective_timeout=args.collective_timeout,
        max_resets=args.max_resets,
        reset_window=args.reset_window,
        max_restarts=args.max_restarts,
        backend=backend,
        grace_period=args.grace_period,
        log_dir=os.path.abspath(args.log_dir) if args.log_dir else None,
        health_port=args.health_port,
        health_addr=args.health_addr,
        checkpoint=checkpoint,
        etcd_options=etcd_options,
        final_checkpoint_timeout=args.final_checkpoint_timeout,
        hang_timeout=args.hang_timeout,
        stragglers=StragglerOptions(ratio=args.straggler_ratio, evict=bool(args.evict_stragglers)),
        chaos=ChaosConfig(args.chaos_kill_every, args.chaos_seed) if args.chaos_kill_every else None,
        leave_exit_code=args.leave_exit_code,
        shard_replicas=args.shard_replicas,
        console_ranks=args.console_ranks or ConsoleRanks(),
        log_max_bytes=args.log_max_bytes,
        warm_starts=not bool(args.cold_starts),
    )
    # The timeouts together (contract/timeouts.py): a combination that cannot work is refused here.
    findings = review(config.timeouts)
    for level, line in findings:
        if level == ERROR:
            raise ConfigError(line)
    suspicious = [line for level, line in findings if level != ERROR]
    for line in [*no_effect.warnings(given, vars(args)), *suspicious]:  # once the command is known to be good
        logging.getLogger(__name__).warning("%s", line)
    return config, args


def _outlast_other_agents(etcd: Etcd, keys: JobKeys, timeout: float) -> bool:
    """Keep the embedded etcd up until the job's other agents have left (bounded).

    They are still winding down (a joiner's worker may be writing the final
    checkpoint): stopping etcd under them would break their watches and leases and
    fill the end of their logs with warnings about an etcd that went away. A signal
    ends the wait at once. Whether the job has ended (False: it runs on without us).
    """
    interrupted = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: interrupted.set())
    deadline = time.monotonic() + timeout
    said = False
    try:
        status = etcd.get(keys.status, retry_deadline=2.0)
    except RendezvousError:
        return False
    if status is None or JobStatus.from_json(status.value).state == RUNNING:
        return False  # we left a running job: waiting would not keep it running for long
    while not interrupted.is_set() and time.monotonic() < deadline:
        try:
            others = len(etcd.get_prefix(keys.members, retry_deadline=2.0)[0])
        except RendezvousError:
            return True
        if not others:
            return True
        if not said:
            logging.getLogger(__name__).info(
                "keeping the embedded etcd up until the other %d agent(s) have left (at most %.0f s)", others, timeout)
            said = True
        interrupted.wait(0.5)
    return True


def main(argv: Sequence[str]) -> int:
    """``elastic-run [options] SCRIPT [args]``: run this host's part of the job; the exit status."""
    argv = list(argv)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(ConsoleFormatter("elastic-run: %(message)s"))  # a warning says so
    console.addFilter(end_open_bar)  # a worker's progress bar line ends before the agent's line
    logging.basicConfig(level=logging.INFO, handlers=[console])
    try:
        config, args = parse(argv)
    except (ConfigError, ValueError) as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    untested = versions.torch_warning()
    if untested:
        logging.getLogger(__name__).warning("%s", untested)
    embedded = None
    served = None
    try:
        embedded = slurm.serve_rendezvous(args)  # the first node of a Slurm job serves its rendezvous
        if args.rdzv_endpoint:
            config_of_etcd = etcd_config(args)
            endpoints = args.rdzv_endpoint
            if embedded is None:  # bare metal: the endpoint's host serves it (bare_metal.py)
                arrival = bare_metal.serve_or_wait(args, config_of_etcd, config.host_id, config.log_dir)
                embedded = arrival.member or arrival.local
                config, config_of_etcd = _follow_a_served_etcd(config, config_of_etcd, arrival, args)
        else:
            embedded = EmbeddedEtcd().start()
            endpoints = embedded.endpoint
            config_of_etcd = EtcdConfig.from_string(endpoints, retry_deadline=args.etcd_retry_deadline)
            logging.getLogger(__name__).info("%s", join_hint(
                endpoints, config.job_id, config.settings, config.command, config.nproc_per_node))
        etcd = follow_members(Etcd(config_of_etcd))
        etcd.check()
        # One backend for the whole job: the first host's choice (gpu review G7).
        config = dataclasses.replace(config, backend=job_backend.settle(etcd, JobKeys(config.job_id), config.backend,
                                                                        config.host_id))
        if config_of_etcd.member_sync:
            served = ServedRendezvous(etcd, config.host_id,
                                      embedded.host if embedded is not None else config.host_addr, config.ttl,
                                      member=embedded, log_dir=config.log_dir,
                                      security=getattr(args, "job_secret", None) if config_of_etcd.secure else None
                                      ).start()
            embedded = None  # stopped by `served` (removed from the cluster first where others keep it)
        code = Agent(config, etcd).run()
        if embedded is not None or (served is not None and served.member is not None):
            # A served member too: every member stays up until the job's agents have all left.
            ended = _outlast_other_agents(etcd, JobKeys(config.job_id), config.final_checkpoint_timeout + 30.0)
            if served is not None:
                served.leave_cluster = not ended  # leaving a running job: the others keep their quorum
        return code
    except ConfigError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except RendezvousError as exc:
        print(f"elastic-run: {in_users_words(str(exc), args.rdzv_backend)}", file=sys.stderr)
        return 1
    finally:
        if served is not None:
            served.stop()
        if embedded is not None:
            embedded.stop()


def in_users_words(message: str, rdzv_backend: str) -> str:
    """A rendezvous error as the user asked for it: with torchrun's ``--rdzv-backend c10d``
    they never asked for etcd, so its name is the rendezvous's (the message stays one line)."""
    if rdzv_backend != "c10d":
        return message
    return re.sub(r"\betcd(?! v3)\b", "the rendezvous", message).replace("the rendezvous's", "the rendezvous'")


def _follow_a_served_etcd(config: AgentConfig, config_of_etcd: EtcdConfig, arrival: bare_metal.Arrival,
                          args: argparse.Namespace) -> tuple[AgentConfig, EtcdConfig]:
    """Where the job's etcd is the one it serves itself (started here, or marked so by
    the host that did): the agent and its workers follow its member list."""
    with Etcd(config_of_etcd) as probe:
        if not bare_metal.served_here(probe, arrival):
            return config, config_of_etcd  # the user's own etcd
    if arrival.member is None:  # this host may be invited to hold a member: the same rule as the endpoint's
        security = bare_metal.served_security(config.host_addr, config_of_etcd.secure,
                                              bool(getattr(args, "allow_insecure", False)))
        if security.warning:
            logging.getLogger(__name__).warning("%s", security.warning)
    if arrival.member is not None:
        logging.getLogger(__name__).warning("%s", bare_metal.spof_note(arrival.member.endpoint))
        logging.getLogger(__name__).info("%s", join_hint(config_of_etcd.describe(), config.job_id, config.settings,
                                                         config.command, config.nproc_per_node,
                                                         secret=etcd_secrets.secret_source(args)))
    options = {**config.etcd_options, "etcd_member_sync": MEMBER_SYNC_S}
    return (dataclasses.replace(config, etcd_options=options),
            dataclasses.replace(config_of_etcd, member_sync=MEMBER_SYNC_S))
