"""`loraplex serve` started by the serving benchmark: a free loopback port, a fresh data
folder, the tenants a scenario needs (their keys read from the CLI's output)."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serving_plan import Target

KEY_PATTERN = re.compile(r"\b(lpx_[0-9a-f]{12}_\S+)")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", *args]


class ServeProcess:
    """`loraplex serve` on a free loopback port, in a fresh data folder, with these tenants."""

    def __init__(self, model: str, tenants: dict[str, str], extra: list[str], reported_lanes: dict[str, str],
                 timeout: float = 600) -> None:
        self.model, self.tenants, self.extra, self.timeout = model, tenants, extra, timeout
        self.reported_lanes = reported_lanes
        self.tmp = tempfile.TemporaryDirectory(prefix="bench_serving_")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Target:
        data = self.tmp.name
        keys = self._create_tenants(data)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log = open(Path(data) / "serve.log", "w+")
        # --metrics-port 0: /metrics on the main port, read there; no two servers share one
        self.proc = subprocess.Popen(_cli("serve", "--model", self.model, "--data-dir", data, "--port", str(port),
                                          "--no-demo", "--metrics-port", "0", *self.extra),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        target = Target(f"http://127.0.0.1:{port}", keys, lanes=self.reported_lanes)
        self._wait(target)
        return target

    def _create_tenants(self, data: str) -> dict[str, str]:
        # One interpreter runs every `tenant create` and `key create` (each start costs seconds).
        commands = [[c, *args, "--data-dir", data] for name, lane in self.tenants.items()
                    for c, args in (("tenant", ["create", name, "--lane", lane]), ("key", ["create", name]))]
        script = ("import sys, json\nfrom loraplex.platform.cli.main import main\n"
                  "for argv in json.loads(sys.argv[1]):\n"
                  "    print('@@', argv[2], flush=True)\n"
                  "    try:\n        main(argv)\n"
                  "    except SystemExit as e:\n        assert not e.code, f'{argv}: exit {e.code}'\n")
        out = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"bench_serving: creating tenants failed:\n{out.stdout}{out.stderr}")
        keys, tenant = {}, None
        for line in out.stdout.splitlines():
            if line.startswith("@@ "):
                tenant = line[3:]
            elif m := KEY_PATTERN.search(line):
                keys[tenant] = m.group(1)
        assert keys.keys() == self.tenants.keys(), out.stdout
        return keys

    def _wait(self, target: Target) -> None:
        import httpx

        deadline = time.monotonic() + self.timeout
        key = next(iter(target.keys.values()))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"bench_serving: loraplex serve exited:\n{self.log.read()[-3000:]}")
            try:
                r = httpx.get(f"{target.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5)
                if r.status_code == 200:
                    fill_models(target, [m["id"] for m in r.json()["data"]], Path(self.model).name)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("bench_serving: loraplex serve did not come up in time")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.tmp.cleanup()


def fill_models(target: Target, ids: list[str], base: str | None) -> None:
    target.model = base if base in ids else target.model or ids[0]
    target.adapters = [i for i in ids if i != target.model]


# -- reporting ------------------------------------------------------------------------
