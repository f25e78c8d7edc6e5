"""An agent's store server in a process of its own, for tests that talk to it with torch.

torch's Python bindings hold the GIL while some client calls wait for their answer
(``get``, ``add``, ``list_keys``, the queues: measured on torch 2.13), so a torch client
and our Python server in one process can deadlock. In a job they never share one (the
server is in the launcher, which never imports torch; the clients are workers), and
these tests keep it so. The process imports no torch: it starts in a tenth of a second.

``python -m tests.fakes.store_process ADDR`` prints the port, then answers lines on its
standard input: ``keys`` (the keys as JSON, what the agent's pruning sees), ``delete
KEY``, ``close``; it ends with its input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class StoreProcess:
    def __init__(self, addr: str = "127.0.0.1"):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.store_process", addr], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def keys(self) -> list[str]:
        return json.loads(self.ask("keys"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def main() -> None:
    from elastic.agent.store_server import StoreServer

    server = StoreServer(sys.argv[1], "test-store")
    print(server.port, flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "keys":
            print(json.dumps(sorted(server.list_keys())), flush=True)
        elif command == "delete":
            print(server.delete_key(arg), flush=True)
        elif command == "close":
            server.close()
            print("closed", flush=True)
    server.close()


if __name__ == "__main__":
    main()
