"""Benchmark: an MCP tool call over the server's `/mcp` vs the same command on the native API.

One MCP session over streamable HTTP (the official `mcp` client, JSON-RPC over SSE), its
sandbox already made; `run_command` of `true`, read to its answer. Floors in the same run, in
the same sandbox: `POST /v1/sandboxes/{id}/commands` of `true` (what the tool call does inside
the server, over loopback) and `GET /v1/health`.

    .venv/bin/python bench/mcp_latency.py [-n 300]

Goal: the tool call's p50 within 3x the native command's (the MCP layer: the client's and the
SDK's JSON-RPC, the session's bookkeeping and one loopback hop).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_RATIO = 3.0


async def tool_calls(url: str, key: str, n: int, warmup: int) -> tuple[list[float], str]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    endpoint = f"{url}/mcp?template=host&on_end=keep"  # the sandbox outlives the session
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http,
        Client(streamable_http_client(endpoint, http_client=http)) as client,
    ):
        info = await client.call_tool("sandbox_info", {})  # the session's sandbox, made
        text = "\n".join(c.text for c in info.content if c.type == "text")
        sandbox_id = next(x.split('"')[3] for x in text.splitlines() if '"sandbox_id"' in x)
        out: list[float] = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            r = await client.call_tool("run_command", {"command": "true"})
            took = time.perf_counter() - t0
            assert not r.is_error, r
            if i >= warmup:
                out.append(took * 1000)
        return out, sandbox_id


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=300)
    args = p.parse_args()
    mach = H.print_header("Benchmark: an MCP tool call over /mcp vs the native API")
    m: dict[str, list[float]] = {}
    with H.BenchServer("mcp", default_template="host") as srv, srv.client() as c:
        key = c.post("/v1/keys", json={"tenant": "bench-mcp"}).json()["key"]
        calls, sid = asyncio.run(tool_calls(srv.url, key, args.n, 20))
        m["MCP run_command `true` over /mcp (RESULT)"] = calls
        with httpx.Client(base_url=srv.url, headers={"X-API-Key": key}, timeout=120) as mine:
            m["native: command `true`, same sandbox"] = H.timed_runs(
                lambda: H.run_command(mine, sid, "true"), args.n, 20
            )
            m["HTTP: GET /v1/health"] = H.timed_runs(lambda: mine.get("/v1/health"), 200, 20)
            mine.delete(f"/v1/sandboxes/{sid}")  # kept when the MCP session ended (on_end=keep)
    print()
    H.print_timings(m, 50)
    ours = H.summarize(m["MCP run_command `true` over /mcp (RESULT)"])
    floor = H.summarize(m["native: command `true`, same sandbox"])
    ratio = ours["p50"] / floor["p50"]
    ok = ratio <= GOAL_RATIO
    print(
        f"\nRESULT: MCP tool call p50 {ours['p50']:.2f} ms, p99 {ours['p99']:.2f} ms; native "
        f"command p50 {floor['p50']:.2f} ms; {ratio:.1f}x (goal <= {GOAL_RATIO:.0f}x: "
        f"{'met' if ok else 'NOT met'})"
    )
    H.emit(
        {
            "benchmark": "mcp_latency",
            "machine": mach,
            "measurements": {k: H.summarize(v) for k, v in m.items()},
            "rows": [
                {
                    "name": "MCP tool call over /mcp",
                    "goal": f"<= {GOAL_RATIO:.0f}x native",
                    "achieved_ms": ours["p50"],
                    "p99_ms": ours["p99"],
                    "ratio": ratio,
                    "met": ok,
                }
            ],
        },
        args.json,
    )


if __name__ == "__main__":
    H.run_isolated(main)
