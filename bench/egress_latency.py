"""Egress proxy: latency an allowed plain-HTTP request gains by going through the proxy.

One sandbox whose policy allows `upstream.test`, which the server resolves to the host's
loopback (`serve --egress-allow-cidr 127.0.0.0/8 --egress-resolve upstream.test=127.0.0.1`).
A tiny stdlib HTTP/1.1 server (`TINY_HTTP_SERVER`, asyncio, 13-byte answer) runs on the host as
the upstream. A raw-socket client (`HTTP_CLIENT`, stdlib, /usr/bin/python3) times sequential
GETs with time.perf_counter, every mode interleaved request by request (ABCAB...):
- in the sandbox, through 127.0.0.1:3128: an absolute-URL GET on a new connection each time; the
  same on one kept-alive connection; a CONNECT tunnel per request with an origin-form GET in it;
  and, as a diagnostic, the kept-alive one with the client setting TCP_QUICKACK before each read
  (it acknowledges at once, so a sender that waits on Nagle for an ACK is not kept waiting);
- in the sandbox, without the proxy: the same client against the same server started inside the
  sandbox (what the sandbox itself costs the client: no proxy, no cross-namespace hop);
- floor, on the host (the sandbox has no route out): the same client and interpreter straight to
  the host's upstream, new connection each time and kept alive.
Sandbox and host runs alternate in blocks so drift hits both. "added p50" = proxied p50 - host
direct p50 for the same connection style (CONNECT: vs a new direct connection).

    .venv/bin/python bench/egress_latency.py [-n 500] [--blocks 10] [--profile] [--json out.json]
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_ADDED_P50_MS = 2.0
UPSTREAM_HOST = "upstream.test"
PROXY = ("127.0.0.1", 3128)
IN_SANDBOX_PORT = 18080
SANDBOX_DIR = "/tmp/agentbox-bench"
# The sandbox runs the distribution's python3 (its rootfs is the host's); the host floor must
# run the very same interpreter, not the venv's.
SANDBOX_PYTHON = "/usr/bin/python3"
SYSTEM_PYTHON = SANDBOX_PYTHON if Path(SANDBOX_PYTHON).exists() else sys.executable

# A minimal HTTP/1.1 server: keep-alive, Content-Length bodies, `Connection: close`, HTTP/1.0.
# argv: PORT (0 = any free one); prints the port it listens on, then serves until killed.
TINY_HTTP_SERVER = r'''
import asyncio, socket, sys

BODY = b"hello, world\n"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(BODY)
KEEP = HEAD + b"\r\n" + BODY
CLOSE = HEAD + b"Connection: close\r\n\r\n" + BODY


class Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        out = []
        close = False
        while not close:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end].lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                length = int(head[at + 17:].split(b"\r\n", 1)[0])
            if len(self.buf) < end + 4 + length:
                break
            self.buf = self.buf[end + 4 + length:]
            http10 = head.split(b"\r\n", 1)[0].endswith(b"http/1.0")
            close = b"\r\nconnection: close" in head or (
                http10 and b"\r\nconnection: keep-alive" not in head)
            out.append(CLOSE if close else KEEP)
        if out:
            self.transport.write(b"".join(out))  # one write per batch: no Nagle stalls
        if close:
            self.transport.close()


async def main(port):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Http, "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


asyncio.run(main(int(sys.argv[1])))
'''

# Times sequential requests, every mode in turn per iteration (the start rotating), on raw
# sockets so the client adds as little as possible. argv: a JSON config
# {"n", "warmup", "wait": [[host, port]...], "modes": [{"name", "host", "port", "request",
# "keepalive", "connect", "quickack"}]}; prints {"ms": {"name": [ms, ...]}, "failed": {"name":
# why}}: a mode whose request fails is dropped from then on, the others carry on.
HTTP_CLIENT = r'''
import json, socket, sys, time


def recv(sock):
    if QUICKACK.get(sock.fileno()):
        # Linux clears quick-ack mode as it pleases: set it before every read.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    return sock.recv(65536)


QUICKACK = {}


def read_head(sock, buf):
    while b"\r\n\r\n" not in buf:
        chunk = recv(sock)
        if not chunk:
            raise ConnectionError("closed before the response head: %r" % buf[:200])
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


def read_response(sock):
    status, head, rest = read_head(sock, b"")
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at >= 0:
        n = int(lower[at + 17:].split(b"\r\n", 1)[0])
        while len(rest) < n:
            chunk = recv(sock)
            if not chunk:
                raise ConnectionError("closed mid-body")
            rest += chunk
    elif b"\r\ntransfer-encoding: chunked" in lower:
        while not rest.endswith(b"0\r\n\r\n"):  # tiny bodies only
            chunk = recv(sock)
            if not chunk:
                raise ConnectionError("closed mid-body")
            rest += chunk
    else:
        raise ValueError("response without Content-Length: %r" % head)
    if status != 200:
        raise RuntimeError("HTTP %d: %r %r" % (status, head, rest[:500]))
    return b"\r\nconnection: close" in lower


def dial(mode):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect((mode["host"], mode["port"]))
    QUICKACK[s.fileno()] = mode.get("quickack", False)
    if mode.get("connect"):
        target = mode["connect"].encode()
        s.sendall(b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n\r\n")
        status, head, rest = read_head(s, b"")
        if status != 200 or rest:
            raise RuntimeError("CONNECT answered %r" % head)
    return s


def main(cfg):
    for host, port in cfg.get("wait", []):
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection((host, port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    modes = cfg["modes"]
    for m in modes:
        m["raw"] = m["request"].encode("latin-1")
    kept = {}
    out = {m["name"]: [] for m in modes}
    clock = time.perf_counter

    def once(m):
        if m["keepalive"]:
            s = kept.get(m["name"])
            t0 = clock()
            if s is None:
                s = kept[m["name"]] = dial(m)
            s.sendall(m["raw"])
            if read_response(s):
                s.close()
                del kept[m["name"]]
            return clock() - t0
        t0 = clock()
        s = dial(m)
        s.sendall(m["raw"])
        read_response(s)
        s.close()
        return clock() - t0

    failed = {}  # a mode that fails once is dropped (and reported), the others go on
    for i in range(cfg["warmup"] + cfg["n"]):
        k = i % len(modes)
        for m in modes[k:] + modes[:k]:
            if m["name"] in failed:
                continue
            try:
                dt = once(m)
            except Exception as e:
                failed[m["name"]] = "request %d: %r" % (i, e)
                s = kept.pop(m["name"], None)
                if s is not None:
                    s.close()
                continue
            if i >= cfg["warmup"]:
                out[m["name"]].append(dt * 1000)
    for s in kept.values():
        s.close()
    print(json.dumps({"ms": out, "failed": failed}))


main(json.loads(sys.argv[1]))
'''


def get_request(host: str, port: int, absolute: bool) -> str:
    target = f"http://{host}:{port}/" if absolute else "/"
    return f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: agentbox-bench\r\n\r\n"


def sandbox_modes(up_port: int) -> list[dict[str, Any]]:
    up = f"{UPSTREAM_HOST}:{up_port}"
    proxied = get_request(UPSTREAM_HOST, up_port, absolute=True)
    origin = get_request(UPSTREAM_HOST, up_port, absolute=False)
    local = get_request("127.0.0.1", IN_SANDBOX_PORT, absolute=False)
    px, pp = PROXY
    return [
        {"name": "proxy_new", "host": px, "port": pp, "request": proxied, "keepalive": False},
        {"name": "proxy_keepalive", "host": px, "port": pp, "request": proxied,
         "keepalive": True},
        {"name": "proxy_keepalive_quickack", "host": px, "port": pp, "request": proxied,
         "keepalive": True, "quickack": True},
        {"name": "connect_new", "host": px, "port": pp, "request": origin, "keepalive": False,
         "connect": up},
        {"name": "sandbox_local_new", "host": "127.0.0.1", "port": IN_SANDBOX_PORT,
         "request": local, "keepalive": False},
        {"name": "sandbox_local_keepalive", "host": "127.0.0.1", "port": IN_SANDBOX_PORT,
         "request": local, "keepalive": True},
    ]


def host_modes(up_port: int) -> list[dict[str, Any]]:
    req = get_request("127.0.0.1", up_port, absolute=False)
    return [
        {"name": "direct_new", "host": "127.0.0.1", "port": up_port, "request": req,
         "keepalive": False},
        {"name": "direct_keepalive", "host": "127.0.0.1", "port": up_port, "request": req,
         "keepalive": True},
    ]


MODE_TEXT = {
    "proxy_new": "sandbox -> proxy, absolute-URL GET, new connection per request",
    "proxy_keepalive": "sandbox -> proxy, absolute-URL GET, one kept-alive connection",
    "proxy_keepalive_quickack": "(diagnostic) the same, client sets TCP_QUICKACK before reads",
    "connect_new": "sandbox -> proxy, CONNECT tunnel + GET, new tunnel per request",
    "sandbox_local_new": "sandbox -> server in the sandbox, no proxy, new connection",
    "sandbox_local_keepalive": "sandbox -> server in the sandbox, no proxy, kept alive",
    "direct_new": "floor: host -> upstream directly, new connection per request",
    "direct_keepalive": "floor: host -> upstream directly, one kept-alive connection",
}
# proxied mode -> the host floor with the same connection style
FLOOR_OF = {"proxy_new": "direct_new", "proxy_keepalive": "direct_keepalive",
            "proxy_keepalive_quickack": "direct_keepalive",
            "connect_new": "direct_new", "sandbox_local_new": "direct_new",
            "sandbox_local_keepalive": "direct_keepalive"}


@contextmanager
def host_process(argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A helper process on the host and the first line it printed; killed on the way out."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"{argv} exited with {proc.wait(5)} before saying anything")
        yield proc, line
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def tiny_server_on_host(port: int = 0) -> Iterator[int]:
    """`TINY_HTTP_SERVER` on the host's loopback, in its own process (no GIL shared with the
    client); its port."""
    with tempfile.TemporaryDirectory(prefix="agentbox-bench-http-") as tmp:
        script = Path(tmp) / "tiny_http_server.py"
        script.write_text(TINY_HTTP_SERVER)
        with host_process([SYSTEM_PYTHON, str(script), str(port)]) as (_, line):
            yield int(line)


def put_file(c: Any, sid: str, path: str, text: str) -> None:
    r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=text.encode())
    if r.status_code >= 300:
        raise RuntimeError(f"writing {path} failed: {r.status_code} {r.text[:300]}")


def start_in_sandbox(c: Any, sid: str, cmd: str) -> None:
    # No time limit: a background command otherwise ends after the default 60 s.
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "background": True, "timeout": 0})
    if r.status_code != 201:
        raise RuntimeError(f"starting {cmd!r} failed: {r.status_code} {r.text[:300]}")


ClientResult = dict[str, dict[str, Any]]  # {"ms": {mode: [ms, ...]}, "failed": {mode: why}}


def run_client_in_sandbox(c: Any, sid: str, cfg: dict[str, Any]) -> ClientResult:
    cmd = f"{SANDBOX_PYTHON} {SANDBOX_DIR}/http_client.py {shlex.quote(json.dumps(cfg))} 2>&1"
    code, out = H.run_command(c, sid, cmd)
    if code != 0:
        raise RuntimeError(f"the client in the sandbox failed ({code}): {out[-2000:]}")
    return json.loads(out)


def run_client_on_host(script: Path, cfg: dict[str, Any]) -> ClientResult:
    p = subprocess.run([SYSTEM_PYTHON, str(script), json.dumps(cfg)], capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"the client on the host failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=500, help="timed requests per mode (default 500)")
    p.add_argument("--blocks", type=int, default=10,
                   help="alternate sandbox and host runs this many times (default 10)")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed requests per mode at the start of each block (default 20)")
    p.set_defaults(json=H.ROOT / "bench/results/egress_latency.json")
    args = p.parse_args()
    mach = H.print_header("Egress proxy: added latency of an allowed HTTP request")
    result: dict[str, Any] = {"name": "egress_latency", "machine": mach,
                              "command": " ".join(["bench/egress_latency.py", *sys.argv[1:]])}
    per_block = max(1, args.n // args.blocks)
    m: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    prof_rows: list[tuple[str, float, float]] = []
    network = {"egress_allow_cidrs": ("127.0.0.0/8",),
               "egress_resolve": (f"{UPSTREAM_HOST}=127.0.0.1",)}
    with tempfile.TemporaryDirectory(prefix="agentbox-bench-egress-") as tmp, \
            tiny_server_on_host() as up_port, \
            H.BenchServer("egress", network=network) as srv, srv.client() as c:
        client = Path(tmp) / "http_client.py"
        client.write_text(HTTP_CLIENT)
        sid = H.create_sandbox(c, timeout=3600,
                               network={"allow_out": [UPSTREAM_HOST]})["sandbox_id"]
        put_file(c, sid, f"{SANDBOX_DIR}/http_client.py", HTTP_CLIENT)
        put_file(c, sid, f"{SANDBOX_DIR}/tiny_http_server.py", TINY_HTTP_SERVER)
        start_in_sandbox(c, sid, f"exec {SANDBOX_PYTHON} {SANDBOX_DIR}/tiny_http_server.py "
                                 f"{IN_SANDBOX_PORT} >/dev/null")
        in_cfg = {"n": per_block, "warmup": args.warmup, "modes": sandbox_modes(up_port),
                  "wait": [["127.0.0.1", IN_SANDBOX_PORT]]}
        host_cfg = {"n": per_block, "warmup": args.warmup, "modes": host_modes(up_port)}
        cpu_in = wall_in = 0.0
        prof = H.Profiler(srv.pid, H.ROOT / "bench/results/egress_latency.pyspy.txt",
                          args.profile)
        with prof:
            for block in range(args.blocks):
                # Alternate which side goes first, so neither always follows the other.
                for side in (("sandbox", "host") if block % 2 == 0 else ("host", "sandbox")):
                    if side == "host":
                        got = run_client_on_host(client, host_cfg)
                    else:
                        cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()
                        got = run_client_in_sandbox(c, sid, in_cfg)
                        cpu_in += cpu_seconds(srv.pid) - cpu0
                        wall_in += time.perf_counter() - t0
                    for name, xs in got["ms"].items():
                        m.setdefault(name, []).extend(xs)
                    for name, why in got["failed"].items():
                        failed.setdefault(name, f"{side} block {block}, {why}")
        prof_rows = prof.top(25)
    proxied_requests = args.blocks * (per_block + args.warmup) * 4
    stats = {k: H.summarize(v) for k, v in m.items()}
    for k, v in m.items():
        # Linux delays an ACK by 40 ms at least: a sender waiting on Nagle for one shows so.
        stats[k]["stalled_35ms"] = sum(x >= 35 for x in v)
    rows = report(stats, failed, proxied_requests, cpu_in, wall_in, prof_rows)
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=rows, measurements=stats, failed=failed, upstream_port=up_port,
                  server_cpu_ms_per_proxied_request=cpu_in / proxied_requests * 1000,
                  profile=prof_rows, leftovers=srv.leftovers)
    H.emit(result, args.json)


def report(stats: dict[str, dict[str, float]], failed: dict[str, str],
           proxied_requests: int, cpu_in: float,
           wall_in: float, prof_rows: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    print("| mode | n | p50 ms | p90 ms | p99 ms | >= 35 ms | floor (same run) | added p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in MODE_TEXT:
        s = stats.get(name) or {"n": 0}
        if not s["n"]:
            print(f"| {MODE_TEXT[name]} | 0 | FAILED: {failed.get(name, '?')} | | | | | |")
            continue
        floor = FLOOR_OF.get(name)
        ok = floor and stats.get(floor, {}).get("n")
        added = f"{s['p50'] - stats[floor]['p50']:+.3f}" if ok else ""
        print(f"| {MODE_TEXT[name]} | {s['n']} | {s['p50']:.3f} | {s['p90']:.3f} | "
              f"{s['p99']:.3f} | {s['stalled_35ms']} | {floor or ''} | {added} |")
    print(f"\nserver CPU while the sandbox client ran: {cpu_in / proxied_requests * 1000:.3f} ms "
          f"per proxied request, an upper bound (it includes each block's command exec); "
          f"{100 * cpu_in / wall_in:.0f}% of one core")
    if prof_rows:
        print("\npy-spy on the server while the clients ran (inclusive %, self %):")
        for f, inc, own in prof_rows:
            print(f"  {inc:5.1f}% {own:5.1f}%  {f}")
    rows = []
    for name, metric in (
        ("proxy_new", "added p50, plain HTTP via the egress proxy, new connection per request"),
        ("proxy_keepalive", "added p50, plain HTTP via the egress proxy, kept-alive connection"),
        ("connect_new", "added p50, CONNECT tunnel + GET via the egress proxy, new tunnel each"),
    ):
        s, f = stats.get(name, {}), stats.get(FLOOR_OF[name], {})
        if not s.get("n") or not f.get("n"):
            rows.append({"metric": metric, "goal": f"added p50 <= {GOAL_ADDED_P50_MS:g} ms",
                         "p50": None, "p99": None, "unit": "ms", "met": False,
                         "floor": f"FAILED: {failed.get(name) or failed.get(FLOOR_OF[name])}",
                         "ratio": "-"})
            continue
        added = s["p50"] - f["p50"]
        rows.append({
            "metric": metric, "goal": f"added p50 <= {GOAL_ADDED_P50_MS:g} ms", "p50": added,
            "p99": s["p99"] - f["p99"], "unit": "ms", "met": added <= GOAL_ADDED_P50_MS,
            "floor": (f"host direct ({FLOOR_OF[name]}) p50 {f['p50']:.3f} ms / p99 "
                      f"{f['p99']:.3f}; proxied p50 {s['p50']:.3f} / p99 {s['p99']:.3f}"),
            "ratio": f"{s['p50'] / f['p50']:.1f}x floor"})
    print()
    for row in rows:
        if row["p50"] is None:
            print(f"RESULT: {row['metric']}: {row['floor']}")
            continue
        print(f"RESULT: {row['metric']}: {row['p50']:+.3f} ms (p99 {row['p99']:+.3f} ms; goal "
              f"{row['goal']}: {'MET' if row['met'] else 'MISSED'}); {row['ratio']}")
    return rows


if __name__ == "__main__":
    H.run_isolated(main)
