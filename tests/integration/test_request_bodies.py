"""Bodies the server cannot read as a JSON object answer `400 invalid_request` with the reason,
as docs/API.md says; well-formed JSON that breaks the schema stays `422` with `detail.errors`."""

from __future__ import annotations

import pytest
from conftest import ServerHandle

JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"template": "default",}', "line 1 column 24"),
        (b'{"template": ', "line 1 column 14"),
        (b'{"template":\n "default"\n', "line 3 column 1"),
        (b"not json", "line 1 column 1"),
    ],
)
def test_malformed_json_is_400_naming_where_it_broke(
    server: ServerHandle, tenant_key: str, body: bytes, reason: str
) -> None:
    with server.client(tenant_key) as c:
        r = c.post("/v1/sandboxes", content=body, headers=JSON)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == "invalid_request", err
    assert "not valid JSON" in err["message"] and reason in err["message"], err


@pytest.mark.parametrize("body", [b"[1, 2]", b'"default"', b"42", b"null"])
def test_json_that_is_not_an_object_is_400(
    server: ServerHandle, tenant_key: str, body: bytes
) -> None:
    with server.client(tenant_key) as c:
        r = c.post("/v1/sandboxes", content=body, headers=JSON)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == "invalid_request" and "JSON object" in err["message"], err


def test_a_required_body_left_out_is_400(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        r = c.post("/v1/sandboxes/sbx_0000000000000000/files/mkdir", headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_request" and "JSON object" in r.json()["message"]


def test_schema_violations_stay_422_with_their_errors(
    server: ServerHandle, tenant_key: str
) -> None:
    with server.client(tenant_key) as c:
        r = c.post("/v1/sandboxes", json={"timeout": "soon"})
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["code"] == "invalid_request", err
    assert err["detail"]["errors"][0]["loc"] == ["body", "timeout"], err
