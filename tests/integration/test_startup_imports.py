"""The launcher and its agent never import torch: that import is most of a process's
start (3-4 s of CPU here), paid by every elastic-run and every joining host (issue 30).
The agent serves its stores in Python (elastic/agent/store_server.py), so no thread of
the launcher's process needs it either.

A real ``elastic-run --np 1`` runs with a test-only sitecustomize whose audit hook
records which process and thread imported torch. The launcher's own process (the agent
and the embedded etcd's keeper live in it) must not have, in any thread; its worker
does, as every training script does, and its store calls (torch's client against the
agent's Python server) must work: the worker reads back a key it set.
"""

from __future__ import annotations

import os
import subprocess
import textwrap

from tests.fakes.jobs import ELASTIC_RUN, REPO

AUDIT_SITE = textwrap.dedent("""
    import os, sys, threading

    def _record_torch(event, args, _out=os.environ["TORCH_IMPORTS_OUT"]):
        if event == "import" and args[0] == "torch":
            with open(_out, "a") as f:
                f.write(f"{os.getpid()} {threading.current_thread().name}\\n")

    sys.addaudithook(_record_torch)
""")


def test_elastic_run_imports_no_torch_in_its_own_process(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT_SITE)
    script = tmp_path / "noop.py"
    script.write_text(
        "import os, datetime, torch.distributed as dist  # the worker may: only the launcher's process is judged\n"
        "store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,\n"
        "                      wait_for_workers=False, timeout=datetime.timedelta(seconds=30))\n"
        "store.set('from-the-worker', 'ok')\n"
        "assert store.get('from-the-worker') == b'ok'\n")
    out = tmp_path / "torch_imports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), TORCH_IMPORTS_OUT=str(out))
    launcher = subprocess.Popen([*ELASTIC_RUN, "--np", "1", str(script)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-2000:]
    importers = [line.split(" ", 1) for line in out.read_text().splitlines()] if out.exists() else []
    assert any(int(pid) != launcher.pid for pid, _ in importers), \
        "the worker's import of torch was not recorded: the audit hook did not run"
    in_launcher = [thread for pid, thread in importers if int(pid) == launcher.pid]
    assert not in_launcher, f"elastic-run imported torch, in thread {in_launcher} (python -X importtime shows who)"
