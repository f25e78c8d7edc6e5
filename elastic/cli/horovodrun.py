"""``horovodrun``'s spellings under ``elastic-run``: what they mean here, or why they are refused.

    elastic-run -np 4 --min-np 2 --max-np 8 --reset-limit 5 python train.py --epochs 10

is read as ``elastic-run --np 4 --min-np 2 --max-np 8 --max-resets 5 train.py --epochs 10``.
``translate`` is a pure function of the command line (tested as a table); ``accept``
applies its environment part (``--network-interface`` -> ``GLOO_SOCKET_IFNAME``, the
opt-in ``--horovod-shim``) and is the one hook ``launch.parse`` calls.

A Horovod option with no meaning here is refused with one line that names the
``elastic-run`` way to get what it asked for, where there is one (exit status 2).
Options that are ``elastic-run``'s own pass through untouched.

``--horovod-shim`` (env ``ELASTIC_HOROVOD_SHIM=1``) lets a script that still says
``import horovod.torch as hvd`` run unchanged: the workers' ``PYTHONPATH`` gets a
directory whose ``horovod.torch`` *is* ``elastic.horovod``. Only when ``import horovod``
would fail otherwise: a real Horovod installation is never shadowed.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from elastic.rendezvous import ConfigError

log = logging.getLogger(__name__)

SHIM_FLAG = "--horovod-shim"
SHIM_ENV = "ELASTIC_HOROVOD_SHIM"

# horovodrun option -> the elastic-run option taking the same value.
RENAMED = {
    "-np": "--np", "--num-proc": "--np",
    "--min-num-proc": "--min-np", "--max-num-proc": "--max-np",
    "--slots-per-host": "--nproc-per-node",
    "--reset-limit": "--max-resets",
    "--elastic-timeout": "--rdzv-timeout",
    "--start-timeout": "--rdzv-timeout",
    "--gloo-timeout-seconds": "--collective-timeout",
    "--output-filename": "--log-dir",
}
NOTES = {
    "--reset-limit": "--reset-limit N is read as --max-resets N: re-formations after failures, per worker, within "
                     "--reset-window; planned resizes (joins, graceful leaves) are not counted, as Horovod counts them",
    "--start-timeout": "--start-timeout is read as --rdzv-timeout, which bounds every wait for --min-np workers",
}
NETWORK_INTERFACE = ("--network-interface", "--network-interfaces")
NO_MEANING = ("--gloo",)  # what elastic-run does anyway (gloo on CPUs)

_PER_HOST = "start one elastic-run per host with --rdzv-endpoint and --job-id (--nproc-per-node N workers each)"
_TUNING = "Horovod's backend tuning has no meaning here (torch.distributed runs the collectives)"
# horovodrun option -> why it is refused: the elastic-run equivalent where there is one.
REFUSED = {
    "-H": _PER_HOST + "; -H localhost:N is --nproc-per-node N",
    "--hosts": _PER_HOST + "; --hosts localhost:N is --nproc-per-node N",
    "-hostfile": _PER_HOST, "--hostfile": _PER_HOST,
    "--host-discovery-script": "the members are the elastic-run agents registered in etcd: start an "
                                "elastic-run on a host to add it, send it SIGTERM to remove it",
    "--blacklist-cooldown-range": "no host blacklist here: a crashed worker is replaced (--max-restarts) and "
                                   "a user error fails the job",
    "--mpi": "elastic-run runs on torch.distributed: --backend gloo or nccl",
    "--jsrun": "elastic-run runs on torch.distributed: --backend gloo or nccl",
    "--mpi-args": "no MPI here: --backend gloo or nccl",
    "--tcp": "no MPI here: --backend gloo or nccl",
    "--binding-args": "no MPI here: --backend gloo or nccl",
    "-p": "no ssh: start elastic-run on each host", "--ssh-port": "no ssh: start elastic-run on each host",
    "-i": "no ssh: start elastic-run on each host",
    "--ssh-identity-file": "no ssh: start elastic-run on each host",
    "--config-file": "no config file: give the options, or their ELASTIC_* environment variables",
    "-cb": "elastic-run has no build check: python -c 'import elastic.horovod'",
    "--check-build": "elastic-run has no build check: python -c 'import elastic.horovod'",
    "--timeline-filename": "give --log-dir, then `elastic-run timeline LOG_DIR -o FILE.png`",
    "--timeline-mark-cycles": "give --log-dir, then `elastic-run timeline LOG_DIR -o FILE.png`",
    "--no-timeline-mark-cycles": "give --log-dir, then `elastic-run timeline LOG_DIR -o FILE.png`",
    "--verbose": "the per-worker logs are in --log-dir",
    "--log-level": "the per-worker logs are in --log-dir",
    "--disable-cache": _TUNING,
    "--no-stall-check": "a hung worker is found by --hang-timeout",
    "--stall-check": "a hung worker is found by --hang-timeout",
    "--stall-check-warning-time-seconds": "a hung worker is found by --hang-timeout",
    "--stall-check-shutdown-time-seconds": "a hung worker is found by --hang-timeout",
}
for _flag in ("--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--autotune-log-file",
              "--autotune-warmup-samples", "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
              "--autotune-gaussian-process-noise", "--num-nccl-streams", "--thread-affinity"):
    REFUSED[_flag] = _TUNING
for _flag in ("--hierarchical-allreduce", "--no-hierarchical-allreduce", "--hierarchical-allgather",
              "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce", "--autotune",
              "--no-autotune", "--mpi-threads-disable", "--no-mpi-threads-disable", "--log-with-timestamp",
              "--log-without-timestamp", "-prefix-timestamp", "--prefix-output-with-timestamp",
              "--log-hide-timestamp", "--no-log-hide-timestamp"):
    REFUSED[_flag] = _TUNING if "timestamp" not in _flag else "the per-worker logs are in --log-dir"

_LOCALHOST = re.compile(r"^(?:localhost|127\.0\.0\.1):(\d+)$")
_PYTHON = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)*)?$")


@dataclass(frozen=True)
class Translation:
    argv: list[str]  # elastic-run's own spelling
    env: dict[str, str] = field(default_factory=dict)  # for the agent and its workers
    shim: bool = False  # --horovod-shim: serve `import horovod.torch` from elastic.horovod
    notes: tuple[str, ...] = ()  # how a translated option differs from Horovod's


def translate(argv: Sequence[str], value_flags: frozenset[str], environ: Mapping[str, str] = {}) -> Translation:
    """``argv`` with horovodrun's spellings turned into elastic-run's (up to SCRIPT).

    ``value_flags``: elastic-run's options that take a value (their values are passed
    through, never read as SCRIPT). Raises ConfigError for a refused option."""
    out: list[str] = []
    env: dict[str, str] = {}
    notes: list[str] = []
    shim = environ.get(SHIM_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return Translation(out + list(argv[i:]), env, shim, tuple(notes))
        if not token.startswith("-") or token == "-":
            script = _script(list(argv[i:]))
            return Translation(out + script, env, shim, tuple(notes))
        flag, inline = (token.split("=", 1) + [None])[:2] if "=" in token else (token, None)

        def value() -> str:
            nonlocal i
            if inline is not None:
                return inline
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            i += 1
            return argv[i]

        if flag == SHIM_FLAG:
            shim = True
        elif flag in RENAMED:
            target = RENAMED[flag]
            if target == "--rdzv-timeout" and "--rdzv-timeout" in out and flag == "--start-timeout":
                value()  # --elastic-timeout (or --rdzv-timeout) given too: it bounds the waits
            else:
                out += [target, value()]
            if flag in NOTES:
                notes.append(NOTES[flag])
        elif flag in NETWORK_INTERFACE:
            names = value()
            env.update(GLOO_SOCKET_IFNAME=names, NCCL_SOCKET_IFNAME=names)
        elif flag in NO_MEANING:
            pass
        elif flag in ("-H", "--hosts") and _LOCALHOST.match(_peek(argv, i, inline) or ""):
            out += ["--nproc-per-node", _LOCALHOST.match(value()).group(1)]
        elif flag in REFUSED:
            raise ConfigError(f"horovodrun's {flag} is not supported by elastic-run: {REFUSED[flag]}")
        else:  # elastic-run's own option (or one argparse will refuse)
            out.append(token)
            if inline is None and _takes_value(flag, value_flags) and i + 1 < len(argv):
                i += 1
                out.append(argv[i])
        i += 1
    return Translation(out, env, shim, tuple(notes))


def _takes_value(flag: str, value_flags: frozenset[str]) -> bool:
    """The flag, or (argparse's abbreviations) an option it is a prefix of, takes a value."""
    return flag in value_flags or (flag[:2] == "--" and any(f.startswith(flag) for f in value_flags if f[:2] == "--"))


def _peek(argv: Sequence[str], i: int, inline: Optional[str]) -> Optional[str]:
    return inline if inline is not None else (argv[i + 1] if i + 1 < len(argv) else None)


def _script(command: list[str]) -> list[str]:
    """Horovod's command is a whole argv (``python train.py ...``); ours starts at SCRIPT."""
    if not _PYTHON.match(command[0]):
        return command
    rest = command[1:]
    if rest[:1] == ["-u"]:  # unbuffered: the workers' output is line-buffered anyway
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return ["-m", *rest[1:]]
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"{command[0]} {' '.join(rest[:1])}: give the script (or -m MODULE) after {command[0]}; "
                          "interpreter options are not passed on")
    return rest


def value_flags_of(parser) -> frozenset[str]:
    return frozenset(flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings)


def accept(argv: Sequence[str], parser) -> list[str]:
    """The hook ``launch.parse`` calls: translate ``argv`` and apply its environment part."""
    translation = translate(argv, value_flags_of(parser), os.environ)
    for note in translation.notes:
        log.info("%s", note)
    os.environ.update(translation.env)  # the workers inherit the agent's environment
    if translation.shim:
        install_shim(os.environ)
    return translation.argv


# -- --horovod-shim -------------------------------------------------------------------
SHIM_FILES = {
    "horovod/__init__.py": '"""elastic-run --horovod-shim: no Horovod is installed; horovod.torch is elastic.horovod."""\n',
    "horovod/torch/__init__.py": (
        '"""elastic-run --horovod-shim: ``import horovod.torch as hvd`` gives elastic.horovod."""\n'
        "import sys\n\nimport elastic.horovod\nimport elastic.horovod.elastic\n\n"
        'sys.modules["horovod.torch.elastic"] = elastic.horovod.elastic\n'
        "sys.modules[__name__] = elastic.horovod\n"
    ),
    "horovod/common/__init__.py": "",
    "horovod/common/exceptions.py": (
        "from elastic.horovod import HorovodInternalError  # noqa: F401\n"
        "from elastic.horovod.elastic import HostsUpdatedInterrupt  # noqa: F401\n"
    ),
    "horovod/common/elastic.py": "from elastic.horovod.elastic import ObjectState, State, run  # noqa: F401\n",
}


def horovod_importable() -> bool:
    return importlib.util.find_spec("horovod") is not None


def install_shim(environ, importable=horovod_importable) -> Optional[str]:
    """Put the shim on ``environ``'s PYTHONPATH, unless a real ``horovod`` imports; its directory."""
    if importable():
        log.info("--horovod-shim: a real Horovod is installed, so `import horovod` stays Horovod's")
        return None
    directory = tempfile.mkdtemp(prefix="elastic-run-horovod-shim-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for path, text in SHIM_FILES.items():
        os.makedirs(os.path.join(directory, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(directory, path), "w") as f:
            f.write(text)
    existing = environ.get("PYTHONPATH")
    environ["PYTHONPATH"] = directory + (os.pathsep + existing if existing else "")
    log.info("--horovod-shim: `import horovod.torch` gives elastic.horovod in the workers")
    return directory
