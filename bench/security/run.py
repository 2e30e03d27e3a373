#!/usr/bin/env python3
"""Memory of the model server and the hub under the abusive inputs of issue 19.

Starts `agentstack model serve` (SmolLM2, with --api-key and --adapter-dir) and
`agentstack hub serve` (SQLite, a temp data directory), each on a free loopback port,
and throws at each what an attacker with no key or token would: adapters from
/dev/zero, 200 MB bodies without a key, 300 connections that never finish a request
head, a gzip bomb, an over-size upload. It reads the server's resident memory
(VmRSS now, VmHWM the peak) from /proc before and after, checks that the server
still answers normally and that nothing stored was lost, and prints a Markdown
report (append it to bench/RESULTS.md).

    bench/security/run.py [--agentstack target/debug/agentstack] [--model PATH]

Every connection goes to 127.0.0.1, bounded in count and time. Standard library only.
"""

import argparse
import gzip
import http.client
import io
import json
import os
import platform
import select
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request

MB = 1 << 20
# The attacks' sizes (issue 19).
BIG_BODY = 200 * MB
SLOW_CONNECTIONS = 300
CONCURRENT_BODIES = 3
# The servers' header-read timeout in these runs (the default).
HEADER_TIMEOUT_S = 10
API_KEY = "bench-key-" + os.urandom(8).hex()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory(pid):
    """(VmRSS, VmHWM) in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def request(port, method, path, body=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    hdrs = dict(headers or {})
    if isinstance(body, (dict, list)):
        hdrs.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=data, headers=hdrs)
    response = conn.getresponse()
    text = response.read()
    conn.close()
    return response.status, text


def wait_healthy(port, path, proc, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            if request(port, "GET", path, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"the server on {port} did not answer {path}")


def big_body(port, method, path, headers, size=BIG_BODY, chunk=MB):
    """Sends a request head declaring `size` bytes, then streams zeros until the server
    answers or closes. Returns (status or None, MiB the server let through, seconds)."""
    start = time.time()
    sent = 0
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {size}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    zeros = b"\0" * chunk
    status = None
    try:
        # A server that decides from the head answers at once: give it a moment before
        # the body starts, so that its answer is read rather than lost to a reset.
        select.select([sock], [], [], 0.2)
        while sent < size:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            sock.sendall(zeros)
            sent += chunk
        sock.settimeout(30)
        reply = sock.recv(4096)
        if reply.startswith(b"HTTP/1.1 "):
            status = int(reply[9:12])
    except OSError:
        pass
    finally:
        sock.close()
    return status, sent / MB, time.time() - start


def concurrent(fn, n):
    results = [None] * n

    def run(i):
        results[i] = fn()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def slow_connections(port, n=SLOW_CONNECTIONS):
    """Opens n connections that each send half a request head and stall; returns how
    many the server had closed after the header timeout (plus slack)."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: sl")
        socks.append(s)
    time.sleep(HEADER_TIMEOUT_S + 3)
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(4096)
            closed += data == b"" or data.startswith(b"HTTP/1.1 408")
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return closed


class Report:
    def __init__(self, name, pid):
        self.name, self.pid, self.rows = name, pid, []

    def row(self, what, outcome):
        rss, hwm = memory(self.pid)
        self.rows.append((what, outcome, rss, hwm))
        print(f"  {self.name}: {what}: {outcome} (RSS {rss:.0f} MiB, peak {hwm:.0f} MiB)", file=sys.stderr)

    def markdown(self):
        lines = [f"**{self.name}**", "", "| step | outcome | RSS after, MiB | peak RSS so far, MiB |", "|---|---|---|---|"]
        lines += [f"| {w} | {o} | {r:.0f} | {h:.0f} |" for w, o, r, h in self.rows]
        return "\n".join(lines)


def model_server(agentstack, model, work):
    adapters = os.path.join(work, "adapters")
    os.makedirs(adapters)
    port = free_port()
    log = open(os.path.join(work, "model.log"), "w")
    proc = subprocess.Popen(
        [agentstack, "model", "serve", model, "--port", str(port), "--threads", "1",
         "--api-key", API_KEY, "--adapter-dir", adapters],
        stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, "/health", proc)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        chat = {"messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 16, "temperature": 0}
        status, first = request(port, "POST", "/v1/chat/completions", chat, auth)
        assert status == 200, first
        first = json.loads(first)["choices"][0]["message"]["content"]
        report = Report("model serve (SmolLM2-135M Q4_1)", proc.pid)
        report.row("started, one chat completion answered", "200")

        statuses = [request(port, "POST", "/v1/adapters", {"name": "x", "path": "/dev/zero"})[0] for _ in range(20)]
        report.row("20 x POST /v1/adapters {path: /dev/zero}, no key", f"{statuses.count(401)}/20 answered 401")
        outcomes = set()
        for path in ["/dev/zero", "/etc/passwd", "/nonexistent", "/", "../../etc/shadow"]:
            status, text = request(port, "POST", "/v1/adapters", {"name": "x", "path": path}, auth)
            outcomes.add((status, json.loads(text)["error"]["message"]))
        codes = sorted({s for s, _ in outcomes})
        report.row("5 paths outside --adapter-dir (/dev/zero, /etc/passwd, missing, /, ../), with the key",
                   f"{codes}, {len({m for _, m in outcomes})} distinct error text(s)")

        results = concurrent(lambda: big_body(port, "POST", "/v1/chat/completions", {"Content-Type": "application/json"}), CONCURRENT_BODIES)
        report.row(f"{CONCURRENT_BODIES} x 200 MB POST /v1/chat/completions at once, no key",
                   ", ".join(f"{s or 'closed'} after {mb:.0f} MB sent, {t:.2f} s" for s, mb, t in results))

        closed = slow_connections(port)
        report.row(f"{SLOW_CONNECTIONS} connections stalled mid-header", f"{closed}/{SLOW_CONNECTIONS} closed by the server within {HEADER_TIMEOUT_S + 3} s")

        status, again = request(port, "POST", "/v1/chat/completions", chat, auth)
        again = json.loads(again)["choices"][0]["message"]["content"] if status == 200 else again
        health = request(port, "GET", "/health")[0]
        report.row("afterwards: /health, the same greedy chat completion", f"{health}; {status}, {'identical' if again == first else 'DIFFERENT'} answer")
        return report
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def package(work, name):
    """A minimal environment package directory (openenv.yaml + server)."""
    d = os.path.join(work, name)
    os.makedirs(os.path.join(d, "server"))
    with open(os.path.join(d, "openenv.yaml"), "w") as f:
        f.write(f"spec_version: 1\nname: {name}\ntype: space\nruntime: fastapi\napp: server.app:app\nport: 8000\nversion: 0.1.0\n")
    with open(os.path.join(d, "server", "app.py"), "w") as f:
        f.write("app = None\n")
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write(f"# {name}\n")
    return d


def gzip_bomb():
    """A tar.gz of about 0.5 MB that unpacks to 512 MiB + 1 MiB of zeros."""
    size = 513 * MB
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("openenv.yaml")
        info.size = size

        class Zeros(io.RawIOBase):
            left = size

            def readable(self):
                return True

            def readinto(self, b):
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros()))
    return gzip.compress(raw.getvalue(), 9)


def hub_server(agentstack, work):
    home = os.path.join(work, "hub-home")
    os.makedirs(home)
    env = dict(os.environ, AGENTSTACK_HOME=home)
    database = "sqlite://" + os.path.join(home, "hub.db")
    token = subprocess.run([agentstack, "hub", "user", "create", "alice", "--database", database],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    log = open(os.path.join(work, "hub.log"), "w")
    proc = subprocess.Popen(
        [agentstack, "hub", "serve", "--port", str(port), "--no-conformance", "--database", database],
        env=env, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, "/api/v1/health", proc)
        url = f"http://127.0.0.1:{port}"
        client_env = dict(env, AGENTSTACK_HUB_URL=url, AGENTSTACK_HUB_TOKEN=token)
        subprocess.run([agentstack, "hub", "push", package(work, "counter")], env=client_env,
                       capture_output=True, check=True)
        status, before = request(port, "GET", "/api/v1/envs/alice/counter/versions/0.1.0/package")
        assert status == 200, before
        report = Report("hub serve (SQLite)", proc.pid)
        report.row("started, one package pushed and pulled", "201, 200")

        path = "/api/v1/envs/alice/counter/versions/9.9.9"
        results = concurrent(lambda: big_body(port, "PUT", path, {"Content-Type": "application/gzip"}), CONCURRENT_BODIES)
        report.row(f"{CONCURRENT_BODIES} x 200 MB PUT at once, no token",
                   ", ".join(f"{s or 'closed'} after {mb:.0f} MB sent, {t:.2f} s" for s, mb, t in results))

        auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/gzip"}
        status, mb, took = big_body(port, "PUT", "/api/v1/envs/alice/counter/versions/9.9.8", auth, size=300 * MB)
        report.row("300 MB PUT with a token (cap 256 MiB), streamed", f"{status or 'closed'} after {mb:.0f} MB sent, {took:.2f} s")
        results = concurrent(lambda: big_body(port, "PUT", "/api/v1/envs/alice/counter/versions/9.9.7", auth, size=BIG_BODY), 6)
        report.row("6 x 200 MB PUT of zeros at once with a token (not a package)",
                   ", ".join(f"{s or 'closed'} after {mb:.0f} MB" for s, mb, _ in results))

        bomb = gzip_bomb()
        status, text = request(port, "PUT", "/api/v1/envs/alice/counter/versions/9.9.6", bomb, auth)
        report.row(f"gzip bomb: {len(bomb) / 1024:.0f} KB unpacking to 513 MiB, with a token", f"{status}")

        closed = slow_connections(port)
        report.row(f"{SLOW_CONNECTIONS} connections stalled mid-header", f"{closed}/{SLOW_CONNECTIONS} closed by the server within {HEADER_TIMEOUT_S + 3} s")

        status, after = request(port, "GET", "/api/v1/envs/alice/counter/versions/0.1.0/package")
        pushed = subprocess.run([agentstack, "hub", "push", package(work, "counter2")], env=client_env,
                                capture_output=True).returncode
        report.row("afterwards: the first package pulled again, a new push",
                   f"{status}, {'identical bytes' if after == before else 'DIFFERENT bytes'}; push exit {pushed}")
        return report
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agentstack", default="target/debug/agentstack")
    parser.add_argument("--model", default=None, help="the GGUF (default: scripts/fetch-model)")
    args = parser.parse_args()
    model = args.model or subprocess.run(["scripts/fetch-model"], capture_output=True, text=True, check=True).stdout.strip()
    agentstack = os.path.abspath(args.agentstack)
    work = tempfile.mkdtemp(prefix="agentstack-security-")
    try:
        reports = [model_server(agentstack, model, work), hub_server(agentstack, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    print(f"## Servers under abusive input (issue 19) — {date}\n")
    print(f"`bench/security/run.py --agentstack {args.agentstack}` at `{commit}`, {cpu}, {os.cpu_count()} cores. "
          "Every request to 127.0.0.1; RSS is the server process's VmRSS after each step, the peak its VmHWM.\n")
    for report in reports:
        print(report.markdown())
        print()


if __name__ == "__main__":
    main()
