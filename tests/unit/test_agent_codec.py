"""The agent's own JSON codec (json's C accelerator, no json import) and what its start imports.

Every sandbox starts a Python agent; json (which imports re, which imports enum) and typing cost
each start ~12 and ~7 ms on the development host (issue 19), so the agent reaches the
accelerator directly. These tests hold it to json's own results, errors included.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

AGENT_DIR = Path(__file__).resolve().parents[2] / "src/agentbox/agent"
sys.path.insert(0, str(AGENT_DIR))
import protocol as P  # noqa: E402
import sandbox_agent as A  # noqa: E402

VALUES = [
    {},
    [],
    {"op": "exec", "cmd": "echo 'hi' \"there\"\n", "env": {"A": "1"}, "timeout": 0},
    {"nested": [[[{"x": None}]]], "flags": [True, False], "n": -0.0},
    {"ints": [0, -1, 2**63, -(2**70)], "floats": [0.1, 1e-300, 1.5e300, 3.0]},
    {"text": "é ☃ 𝄞 \x00 \x1f \\ / \u2028", "": ""},
    "a bare string",
    12345,
    None,
]


@pytest.mark.parametrize("value", VALUES)
def test_encode_and_decode_as_json_does(value: object) -> None:
    assert P._encode is not None and P._scan is not None, "the fast path is on here"
    text = P.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert P.loads(text.encode()) == json.loads(text) == value


def test_non_finite_floats_as_json_writes_them() -> None:
    text = P.dumps([math.nan, math.inf, -math.inf])
    assert text == "[NaN,Infinity,-Infinity]"
    back = P.loads(text)
    assert isinstance(back, list) and math.isnan(back[0]) and back[1:] == [math.inf, -math.inf]


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1,]", b"{} x", b'{"a" 1}', b'"\\x"', b"\xff", b"nul", b'"a\x01"', b"[1] [2]"],
)
def test_malformed_input_fails_with_jsons_own_error(raw: bytes) -> None:
    with pytest.raises(ValueError) as fast:
        P.loads(raw)
    with pytest.raises(ValueError) as slow:
        json.loads(raw)
    assert type(fast.value) is type(slow.value) and str(fast.value) == str(slow.value)


@pytest.mark.parametrize(
    "raw", [' \n{"a": 1}\t\r\n', '{"a": 1}'.encode("utf-16"), b'\xef\xbb\xbf{"a": 1}']
)
def test_whitespace_and_other_encodings_decode_as_json_does(raw: bytes) -> None:
    assert P.loads(raw) == json.loads(raw) == {"a": 1}


def test_what_json_refuses_to_encode_is_refused_alike() -> None:
    with pytest.raises(TypeError, match="Object of type object is not JSON serializable"):
        P.dumps({"a": object()})
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference detected"):
        P.dumps(cycle)


def test_a_frame_round_trips_and_a_bad_one_is_a_protocol_error() -> None:
    frame = P.encode_json({"op": "ping", "x": "é"})
    kind, length = P.HEADER.unpack_from(frame)
    assert kind == P.KIND_JSON and length == len(frame) - P.HEADER.size
    assert P.decode_json(frame[P.HEADER.size :]) == {"op": "ping", "x": "é"}
    for bad in (b"[1]", b"{", b"\xff"):
        with pytest.raises(P.ProtocolError):
            P.decode_json(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b"/workspace",
        b"/a\\040b",
        b"/tab\\011and\\134backslash",
        b"/not\\08escape",
        b"/end\\04",
        b"/trailing\\",
        b"\\101\\102",
    ],
)
def test_mountinfo_escapes_are_undone_as_the_regex_did(raw: bytes) -> None:
    expected = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), raw)
    assert A._unescape_octal(raw) == expected


def test_the_agent_starts_without_json_re_or_typing() -> None:
    """Importing the agent as a sandbox does (`python3 -E -s -S`) loads none of them."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(AGENT_DIR)!r})\n"
        "import sandbox_agent\n"
        "heavy = sorted({'json', 're', 'enum', 'typing', 'signal'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-E", "-s", "-S", "-c", code], check=True, timeout=60)
