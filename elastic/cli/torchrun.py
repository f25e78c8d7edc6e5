"""``torchrun``'s command line under ``elastic-run``: change one word of the launch command.

    torchrun    --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=job42 train.py
    elastic-run --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=job42 train.py

is read as ``elastic-run --min-np 2 --max-np 4 --nproc-per-node 2 --rdzv-endpoint node0:29400
--job-id job42 train.py``: torchrun counts hosts (``--nnodes``), elastic-run workers.
``translate`` is a pure function of the command line (tested as a table); ``accept`` is
the hook ``launch.parse`` calls before horovodrun's (``horovodrun.py``).

Every option of torchrun's parser is in ``TABLE``: translated with its meaning kept,
accepted with no effect where elastic-run already does what it asks (a logged note
says so), or refused in one line that names what to use instead (exit status 2).
Options elastic-run shares with torchrun keep their spelling; ``_`` spellings are read
as ``-``. ``--max-restarts`` passes through: for a torchrun-style script (no elastic
API) a failure restarts every worker of the job and is counted once per agent, and
joins and leaves are not counted, which is torchrun's meaning.

The endpoint of ``--rdzv-endpoint`` is an etcd v3 whatever ``--rdzv-backend`` says. With
``c10d`` or ``static`` it is served as torchrun's c10d store is: by the first agent that finds
the port free on the endpoint's host, a loopback endpoint (``localhost:29400``) included,
every other agent using it (``--rdzv-backend c10d`` of elastic-run, bare_metal.py); without
``--rdzv-id`` the job is torchrun's default id, ``none``. With ``etcd`` or ``etcd-v2`` an etcd
must answer at a loopback endpoint (another host's: until that host serves one itself).
``docs/torchrun.md`` holds ``markdown_table()``'s output (a test keeps them equal).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from elastic.rendezvous import ConfigError

from . import horovodrun

log = logging.getLogger(__name__)

SAME, TRANSLATED, NO_EFFECT, REFUSED = "same", "translated", "no effect", "refused"


@dataclass(frozen=True)
class Rule:
    kind: str  # SAME, TRANSLATED, NO_EFFECT or REFUSED (for some values only, where the text says so)
    text: str  # what it becomes, or why it is refused and what to use instead


_NO_NUMA = "no NUMA binding in elastic-run: bind in the script (os.sched_setaffinity by LOCAL_RANK)"
_LOGS = "every worker's output goes to the console, prefixed [rankN], and with --log-dir to a file per worker"
TABLE: dict[str, Rule] = {
    "--help": Rule(SAME, "elastic-run's own help"),
    "--nnodes": Rule(TRANSLATED, "hosts -> workers: `--nnodes MIN:MAX` is `--min-np MIN*P --max-np MAX*P` "
                                 "(and torchrun's last call, `--rdzv-settle 30`, unless --rdzv-conf's "
                                 "last_call_timeout or --rdzv-settle says otherwise), "
                                 "`--nnodes N` is `--np N*P`, P being --nproc-per-node (default 1); refused with "
                                 "--np/--min-np/--max-np"),
    "--nproc-per-node": Rule(TRANSLATED, "workers this host runs: N; `gpu` (the CUDA GPUs, refused without one), "
                                         "`cpu` (the CPUs) or `auto` (the GPUs, else the CPUs) become that number"),
    "--rdzv-backend": Rule(TRANSLATED, "`c10d`, `static`: `--rdzv-backend c10d`, the endpoint's host serves the "
                                       "rendezvous (an etcd v3), a loopback endpoint included, as torchrun's c10d store "
                                       "is: the first agent that finds the port free; `etcd`, `etcd-v2`: an etcd v3 "
                                       "must answer at the endpoint (an endpoint without a port gets the backend's "
                                       "default, 29400 or 2379); any other backend is refused"),
    "--rdzv-endpoint": Rule(SAME, "the rendezvous' etcd v3 endpoint(s) HOST:PORT; none: the embedded etcd "
                                  "(one host, others join with the printed command)"),
    "--rdzv-id": Rule(TRANSLATED, "`--job-id`"),
    "--rdzv-conf": Rule(TRANSLATED, "`join_timeout` (or `timeout`) -> `--rdzv-timeout`, `last_call_timeout` -> "
                                    "`--rdzv-settle`, `heartbeat_timeout` -> `--rdzv-ttl`, `ca_cert`/`ssl_cert`/"
                                    "`ssl_cert_key` -> `--etcd-ca`/`--etcd-cert`/`--etcd-key`; the c10d store's own "
                                    "keys have no effect; any other key is refused"),
    "--standalone": Rule(TRANSLATED, "elastic-run's default: an embedded etcd on this host (a --rdzv-endpoint, "
                                     "--rdzv-backend or --rdzv-id given too is dropped, as torchrun does)"),
    "--max-restarts": Rule(SAME, "torchrun's meaning for a torchrun-style script: a failure restarts every "
                                 "worker, counted once per agent, joins and leaves not counted (an elastic-API "
                                 "script: crashed workers this agent replaces)"),
    "--monitor-interval": Rule(NO_EFFECT, "the agent learns of a worker's exit at once"),
    "--start-method": Rule(NO_EFFECT, "workers are fresh processes, as torchrun starts a script under any "
                                      "start method"),
    "--event-log-handler": Rule(NO_EFFECT, "`null` only (the default); events are in --log-dir/events.jsonl, "
                                           "so any other handler is refused"),
    "--role": Rule(NO_EFFECT, "`default` only (ROLE_NAME is `default`); any other role is refused"),
    "--module": Rule(SAME, "`-m`: run SCRIPT as a module"),
    "--no-python": Rule(REFUSED, "elastic-run runs SCRIPT with Python: give a Python script, or -m MODULE "
                                 "(a script can os.execv your program)"),
    "--run-path": Rule(NO_EFFECT, "SCRIPT runs as `python SCRIPT` would (as __main__)"),
    "--log-dir": Rule(SAME, "per-worker logs and events.jsonl"),
    "--redirects": Rule(NO_EFFECT, _LOGS),
    "--tee": Rule(NO_EFFECT, _LOGS),
    "--local-ranks-filter": Rule(NO_EFFECT, _LOGS + ": every rank is shown"),
    "--duplicate-stdout-filters": Rule(REFUSED, _LOGS + ": filter those files"),
    "--duplicate-stderr-filters": Rule(REFUSED, _LOGS + ": filter those files"),
    "--node-rank": Rule(NO_EFFECT, "ranks come from the rendezvous: the hosts' order is the order they joined in "
                                   "(GROUP_RANK), no host is special"),
    "--master-addr": Rule(TRANSLATED, "with the static backend, no --rdzv-endpoint and --nnodes above 1: the "
                                      "rendezvous endpoint MASTER_ADDR:MASTER_PORT; otherwise no effect (elastic-run "
                                      "gives the workers MASTER_ADDR/MASTER_PORT itself)"),
    "--master-port": Rule(TRANSLATED, "as --master-addr (default 29500)"),
    "--local-addr": Rule(TRANSLATED, "`--host-addr`"),
    "--logs-specs": Rule(REFUSED, "no log plugins: " + _LOGS),
    "--numa-binding": Rule(REFUSED, _NO_NUMA),
    "--signals-to-handle": Rule(REFUSED, "elastic-run handles SIGTERM and SIGINT: the host leaves the job "
                                         "gracefully within --grace-period"),
    "--shutdown-timeout": Rule(TRANSLATED, "`--grace-period`: seconds workers get to stop after SIGTERM"),
    "--virtual-local-rank": Rule(REFUSED, "LOCAL_RANK is the worker's index on its host: pick the GPU by it"),
}
# torchrun's spellings -> TABLE's key (the `_` forms, -m, -r, -t, -h).
SPELLINGS: dict[str, str] = {"-h": "--help", "-m": "--module", "-r": "--redirects", "-t": "--tee"}
for _flag in TABLE:
    SPELLINGS[_flag] = _flag
    SPELLINGS["--" + _flag[2:].replace("-", "_")] = _flag
PASSED_ON = frozenset({"--max-restarts", "--log-dir"})  # same name, same meaning: left in place
TAKES_VALUE = frozenset(set(TABLE) - {"--help", "--standalone", "--module", "--no-python", "--run-path",
                                      "--virtual-local-rank"})

BACKENDS = {"c10d": 29400, "static": 29400, "etcd": 2379, "etcd-v2": 2379}
# torchrun's backends whose store the endpoint's host serves itself (c10d's TCPStore, static's master).
SERVED_BACKENDS = ("c10d", "static")
TORCHRUN_DEFAULT_ID = "none"  # torchrun's --rdzv-id when none is given
LAST_CALL_S = "30"  # torchrun's default last_call_timeout: `--nnodes MIN:MAX` waits this long for MAX
_CONF_OPTIONS = {"join_timeout": "--rdzv-timeout", "timeout": "--rdzv-timeout", "last_call_timeout": "--rdzv-settle",
                 "heartbeat_timeout": "--rdzv-ttl", "ca_cert": "--etcd-ca", "ssl_cert": "--etcd-cert",
                 "ssl_cert_key": "--etcd-key"}
# torch's c10d/etcd rendezvous tuning: elastic-run's etcd rendezvous has no such knob.
_CONF_NO_EFFECT = ("close_timeout", "read_timeout", "keep_alive_interval", "keep_alive_max_attempt", "is_host",
                   "use_agent_store", "store_type", "protocol", "etcd_prefix")
# elastic-run's (and horovodrun's) spellings of the world size: --nnodes may not be given with them.
_SIZE_FLAGS = ("--np", "-np", "--num-proc", "--min-np", "--max-np", "--min-num-proc", "--max-num-proc")
_SIZE_ENV = ("ELASTIC_NP", "ELASTIC_MIN_NP", "ELASTIC_MAX_NP")
_HAS_PORT = re.compile(r"(?::\d+|\]:\d+)/?$")


@dataclass(frozen=True)
class Translation:
    argv: list[str]  # elastic-run's own spelling (horovodrun's spellings left for horovodrun.py)
    notes: tuple[str, ...] = ()  # options accepted with no effect, or read differently: logged


@dataclass(frozen=True)
class Devices:
    """What ``--nproc-per-node gpu|cpu|auto`` counts (``accept`` asks torch; tests give numbers)."""
    gpus: int
    cpus: int


def translate(argv: Sequence[str], value_flags: frozenset[str], environ: Mapping[str, str] = {},
              devices: Callable[[], Devices] = lambda: Devices(0, os.cpu_count() or 1)) -> Translation:
    """``argv`` with torchrun's spellings turned into elastic-run's (up to SCRIPT).

    ``value_flags``: the other options that take a value (their values are passed
    through, never read as SCRIPT). Raises ConfigError naming the option as typed."""
    out: list[str] = []
    given: dict[str, tuple[str, Optional[str]]] = {}  # TABLE key -> (as typed, value)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        typed, inline = token.split("=", 1) if "=" in token else (token, None)
        key = SPELLINGS.get(typed)
        if key is None or key == "--help":  # elastic-run's own option (or horovodrun's, or one argparse refuses)
            out.append(token)
            if inline is None and horovodrun._takes_value(typed, value_flags) and i + 1 < len(argv):
                i += 1
                out.append(argv[i])
            i += 1
            continue
        value = None
        if key in TAKES_VALUE:
            if inline is None:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{typed} needs a value")
                i += 1
                inline = argv[i]
            value = inline
        elif inline is not None:
            raise ConfigError(f"{typed} takes no value")
        if TABLE[key].kind == REFUSED:
            raise ConfigError(f"torchrun's {typed} is not supported by elastic-run: {TABLE[key].text}")
        if key in PASSED_ON:  # elastic-run's own option, maybe in its `_` spelling
            out += [key, value]
        else:  # given twice: the last one counts, as under argparse
            given[key] = (typed, value)
        i += 1
    front, notes = _apply(given, out, environ, devices)
    return Translation(front + out + list(argv[i:]), tuple(notes))


def _apply(given: dict, rest: list[str], environ: Mapping[str, str], devices) -> tuple[list[str], list[str]]:
    """The elastic-run options the torchrun options ``given`` stand for, and notes."""
    out: list[str] = []
    notes: list[str] = []

    def typed(key: str) -> str:
        return given[key][0]

    def value(key: str, default=None):
        return given[key][1] if key in given else default

    for key in ("--monitor-interval", "--start-method", "--run-path", "--redirects", "--tee",
                "--local-ranks-filter", "--node-rank"):
        if key in given:
            notes.append(f"{typed(key)} has no effect here: {TABLE[key].text}")
    if value("--event-log-handler", "null") != "null":
        raise ConfigError(f"{typed('--event-log-handler')} {value('--event-log-handler')}: only null here "
                          "(events are in --log-dir/events.jsonl)")
    if value("--role", "default") != "default":
        raise ConfigError(f"{typed('--role')} {value('--role')}: one role per job here (ROLE_NAME=default)")
    if "--module" in given:
        out.append("-m")
    if "--local-addr" in given:
        out += ["--host-addr", value("--local-addr")]
    if "--shutdown-timeout" in given:
        out += ["--grace-period", value("--shutdown-timeout")]

    nproc = None
    if "--nproc-per-node" in given:
        nproc = _local_world_size(typed("--nproc-per-node"), value("--nproc-per-node"), devices)
        out += ["--nproc-per-node", str(nproc)]
    if "--nnodes" in given:
        size = [f for f in _SIZE_FLAGS if any(t == f or t.startswith(f + "=") for t in rest)]
        size += [v for v in _SIZE_ENV if environ.get(v)]
        if size:
            raise ConfigError(f"{typed('--nnodes')} counts hosts and {size[0]} workers: give one of them")
        low, high = _nodes(typed("--nnodes"), value("--nnodes"))
        per = nproc or 1
        out += ["--np", str(low * per)] if low == high else ["--min-np", str(low * per), "--max-np", str(high * per)]
    elif nproc is not None and not any(t.split("=")[0] in _SIZE_FLAGS for t in rest) \
            and not any(environ.get(v) for v in _SIZE_ENV):
        out += ["--np", str(nproc)]  # torchrun's default --nnodes 1:1

    conf = _conf(typed("--rdzv-conf"), value("--rdzv-conf")) if "--rdzv-conf" in given else {}
    if "join_timeout" in conf:
        conf.pop("timeout", None)  # the etcd backend's name for it
    if "--nnodes" in given and low < high and "last_call_timeout" not in conf \
            and not any(t.split("=")[0] == "--rdzv-settle" for t in rest):
        # torchrun's last call: once MIN hosts are in, the first round waits this long for more.
        out += ["--rdzv-settle", LAST_CALL_S]
    for key, setting in conf.items():
        if setting is None:
            notes.append(f"{typed('--rdzv-conf')} {key}: no effect on elastic-run's etcd rendezvous")
        else:
            out += [_CONF_OPTIONS[key], setting]

    if "--standalone" in given:
        dropped = [typed(k) for k in ("--rdzv-endpoint", "--rdzv-backend", "--rdzv-id") if k in given]
        dropped += [t.split("=")[0] for t in rest if t.split("=")[0] in ("--rdzv-endpoint", "--job-id")]
        if dropped:
            raise ConfigError(f"{typed('--standalone')} runs on this host alone: drop {', '.join(dropped)}")
        return out, notes
    backend = value("--rdzv-backend", "static")
    if backend not in BACKENDS:
        raise ConfigError(f"{typed('--rdzv-backend')} {backend}: elastic-run's rendezvous is etcd v3; "
                          f"give c10d, static, etcd or etcd-v2 (or leave it out) with --rdzv-endpoint HOST:PORT")
    endpoint = value("--rdzv-endpoint")
    if "--rdzv-backend" in given and endpoint:
        endpoint = ",".join(e if _HAS_PORT.search(e) else f"{e}:{BACKENDS[backend]}" for e in endpoint.split(","))
    masters = [k for k in ("--master-addr", "--master-port") if k in given]
    if masters and backend == "static" and not endpoint and "--nnodes" in given \
            and _nodes(typed("--nnodes"), value("--nnodes"))[1] > 1:
        endpoint = f"{value('--master-addr', '127.0.0.1')}:{value('--master-port', '29500')}"
    elif masters:
        notes.append(f"{typed(masters[0])} has no effect here: elastic-run gives the workers MASTER_ADDR/MASTER_PORT")
    if endpoint:
        out += ["--rdzv-endpoint", endpoint]
    job_id_given = any(t.split("=")[0] == "--job-id" for t in rest)
    if "--rdzv-id" in given:
        if job_id_given:
            raise ConfigError(f"{typed('--rdzv-id')} is --job-id: give one of them")
        out += ["--job-id", value("--rdzv-id")]
    if endpoint and "--rdzv-backend" in given and backend in SERVED_BACKENDS:
        out += ["--rdzv-backend", "c10d"]  # the endpoint's host serves it, loopback included
        if "--rdzv-id" not in given and not job_id_given:
            out += ["--job-id", TORCHRUN_DEFAULT_ID]
    return out, notes


def _nodes(typed: str, text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise ConfigError(f"{typed} {text}: expected N or MIN:MAX hosts, 1 <= MIN <= MAX")
    return low, high


def _local_world_size(typed: str, text: str, devices: Callable[[], Devices]) -> int:
    """torchrun's ``--nproc-per-node N|gpu|cpu|auto`` as a number of workers."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text not in ("gpu", "cpu", "auto"):
        raise ConfigError(f"{typed} {text}: expected a positive number, gpu, cpu or auto")
    found = devices()
    if text == "gpu" and not found.gpus:
        raise ConfigError(f"{typed} gpu: this host has no CUDA GPU (cpu or a number runs on CPUs)")
    return found.cpus if text == "cpu" or not found.gpus else found.gpus


def _conf(typed: str, text: str) -> dict[str, Optional[str]]:
    """``--rdzv-conf k=v,k=v``: key -> value for the keys elastic-run uses, None for the others."""
    settings: dict[str, Optional[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, setting = item.partition("=")
        key = key.strip()
        if not sep or not setting.strip():
            raise ConfigError(f"{typed} {item}: expected KEY=VALUE[,KEY=VALUE...]")
        if key in _CONF_OPTIONS:
            settings[key] = setting.strip()
        elif key in _CONF_NO_EFFECT:
            settings[key] = None
        else:
            known = ", ".join(sorted(_CONF_OPTIONS))
            raise ConfigError(f"{typed} {key}: not a setting of elastic-run's rendezvous (it reads {known}; "
                              "its own options are listed by elastic-run --help)")
    return settings


def torch_devices() -> Devices:
    import torch  # only for gpu/cpu/auto: parsing stays fast without it

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Devices(gpus, os.cpu_count() or 1)


def value_flags(parser) -> frozenset[str]:
    """elastic-run's options that take a value, and horovodrun's (translated after this)."""
    hvd = {*horovodrun.RENAMED, *horovodrun.NETWORK_INTERFACE, "-H", "--hosts"}
    return horovodrun.value_flags_of(parser) | hvd


def accept(argv: Sequence[str], parser) -> list[str]:
    """The hook ``launch.parse`` calls: translate ``argv``, log the notes."""
    translation = translate(argv, value_flags(parser), os.environ, torch_devices)
    for note in translation.notes:
        log.info("%s", note)
    return translation.argv


def markdown_table() -> str:
    """``docs/torchrun.md``'s table: every torchrun option and what it becomes."""
    spellings: dict[str, list[str]] = {}
    for spelling, key in SPELLINGS.items():
        spellings.setdefault(key, []).append(spelling)
    lines = ["| torchrun option | under elastic-run | what it becomes |", "|---|---|---|"]
    for key, rule in TABLE.items():
        names = " ".join(f"`{s}`" for s in sorted(set(spellings[key]), key=lambda s: (len(s) > 2, s.count("_"))))
        lines.append(f"| {names} | {rule.kind} | {rule.text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
