"""Warm pools: their sizes and how often they served a create."""

from __future__ import annotations

from fastapi import APIRouter

from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Admin, Mgr, Who


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/pools", response_model=m.PoolList, responses=RESPONSES, tags=["pools"])
    async def list_pools(mgr: Mgr, who: Who) -> m.PoolList:
        # Sizes are the operator's settings, visible to all; hits and misses are per tenant.
        return m.PoolList(pools=[m.PoolStats(**p) for p in mgr.pool_stats(who)])

    @r.put("/v1/pools/{template}", response_model=m.PoolStats, responses=RESPONSES, tags=["pools"])
    async def set_pool(template: str, body: m.PoolBody, mgr: Mgr, who: Admin) -> m.PoolStats:
        return m.PoolStats(**await mgr.set_pool_size(who, template, body.size))

    return r
