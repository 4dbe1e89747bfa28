"""Template specs: the TOML a user writes, parsed and validated into a `TemplateSpec`.

Everything a spec names ends up on a command line run as real root during a build (package
names for apt and pip, file destinations), so validation here is strict and conservative: a
value either matches a narrow pattern or the spec is refused with a message that names the
field and says what is allowed. The format is documented in docs/TEMPLATES.md.
"""

from __future__ import annotations

import posixpath
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.vocab import LANGUAGES

SPECS_DIR = Path(__file__).resolve().parent / "specs"

NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
VARIANTS = ("minbase", "apt", "essential", "required", "important", "standard")
DEFAULT_SUITE = "bookworm"
DEFAULT_VARIANT = "apt"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_SUITE_RE = re.compile(r"[a-z][a-z0-9.-]{0,31}")
# Plain http(s) URLs only: the mirror becomes an mmdebstrap argument and a sources.list line.
_MIRROR_RE = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%+/-]*)?")
# Debian package names (policy 5.6.1), optionally pinned: `name`, `name=version`,
# `name/release`. Never a leading '-', never whitespace: nothing can become an apt option.
_APT_RE = re.compile(
    r"[a-z0-9][a-z0-9+.-]{0,99}(:[a-z0-9]{1,16})?(=[A-Za-z0-9.+~:-]{1,64}|/[a-z0-9.-]{1,32})?"
)
# PEP 508 names with extras and version specifiers, without URLs, markers or spaces.
_PIP_VERSION = r"(==|>=|<=|~=|!=|>|<)[A-Za-z0-9.*+!_-]{1,64}"
_PIP_RE = re.compile(
    rf"[A-Za-z0-9]([A-Za-z0-9._-]{{0,99}})(\[[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*\])?"
    rf"({_PIP_VERSION}(,{_PIP_VERSION})*)?"
)
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# The code host's languages: a context it cannot start would fail every sandbox start, so an
# unknown one is refused when the spec is loaded.
WARM_LANGUAGES = LANGUAGES
# File destinations under these are mounted over (or are kernel filesystems) in every sandbox,
# so a file placed there would never be seen; /etc/passwd and /etc/group are overlaid too.
FORBIDDEN_DEST_ROOTS = ("/proc", "/dev", "/sys", "/workspace", "/.agentbox", "/tmp", "/run")
FORBIDDEN_DESTS = ("/var/tmp", "/etc/passwd", "/etc/group")

MAX_PACKAGES = 500
MAX_FILES = 1000
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_TOTAL_FILE_BYTES = 64 * 1024 * 1024
MAX_ENV = 256
MAX_VALUE_CHARS = 32 * 1024
MAX_READY_TIMEOUT = 3600

MAX_EXTENDS_DEPTH = 4
_TOP_KEYS = (
    "name", "description", "extends", "base", "apt", "pip", "files", "env", "run", "start", "code",
)  # fmt: skip
_TABLE_KEYS = {
    "base": ("suite", "variant", "mirror"),
    "apt": ("packages",),
    "pip": ("packages",),
    "run": ("workdir", "user"),
    "start": ("cmd", "ready", "ready_timeout"),
    "code": ("warm",),
}
_FILE_KEYS = ("dest", "content", "src", "mode")


class SpecError(ValueError):
    """The spec is not valid; the message names the field and what it may be."""


@dataclass(frozen=True)
class FileSpec:
    dest: str
    content: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    description: str = ""
    suite: str = DEFAULT_SUITE
    variant: str = DEFAULT_VARIANT
    mirror: str = DEFAULT_MIRROR
    apt_packages: tuple[str, ...] = ()
    pip_packages: tuple[str, ...] = ()
    files: tuple[FileSpec, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/workspace"
    user: str = "user"
    start_cmd: str | None = None
    ready_cmd: str | None = None
    ready_timeout: float = 30.0
    warm: tuple[str, ...] = ()
    spec_text: str = ""
    # `extends`: the shipped spec whose layers this one is built on (its apt, pip and files
    # steps come after the parent's, so the parent's layers are shared, not rebuilt).
    parent: TemplateSpec | None = None


def valid_name(name: str) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def builtin_spec_names() -> list[str]:
    """Templates agentbox ships a spec for (built on first use)."""
    return sorted(p.stem for p in SPECS_DIR.glob("*.toml"))


def builtin_spec_path(name: str) -> Path | None:
    """The shipped spec for `name` (src/agentbox/templates/specs/<name>.toml), if there is one."""
    if not valid_name(name):
        return None
    path = SPECS_DIR / f"{name}.toml"
    return path if path.is_file() else None


def load_spec(text: str, base_dir: Path | None = None, _depth: int = 0) -> TemplateSpec:
    """Parse and validate a TOML spec. `base_dir` resolves `[[files]] src` paths (relative to
    the spec file, and confined to that directory); without it, `src` is refused.

    `extends = "NAME"` builds on the shipped spec NAME: its base, packages and files come
    first (their layers shared with NAME's own build), then this spec's; its env, run, start
    and code settings hold unless this spec sets them (env is merged, key by key)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"the spec is not valid TOML: {e}") from None
    _check_keys(doc, _TOP_KEYS, "the spec's top level")
    for table, keys in _TABLE_KEYS.items():
        if table in doc:
            _check_keys(_table(doc, table), keys, f"[{table}]")

    name = doc.get("name")
    if name is None:
        raise SpecError('name: missing; every spec needs a name like name = "my-template"')
    if not valid_name(name):
        raise SpecError(
            f"name: {name!r} is not a valid template name; use 1-63 characters: lowercase "
            "letters, digits and '-', starting with a letter or digit"
        )
    description = _string(doc.get("description", ""), "description", allow_empty=True)
    parent = _parent(doc, _depth)

    base = _table(doc, "base")
    if parent is not None and base:
        raise SpecError(f"base: a spec that extends {parent.name!r} has its base; remove [base]")
    suite = _string(base.get("suite", DEFAULT_SUITE), "base.suite")
    if not _SUITE_RE.fullmatch(suite):
        raise SpecError(
            f'base.suite: {suite!r} is not a Debian suite name; use e.g. "bookworm" '
            "(lowercase letters, digits, '.', '-')"
        )
    variant = _string(base.get("variant", DEFAULT_VARIANT), "base.variant")
    if variant not in VARIANTS:
        raise SpecError(
            f"base.variant: {variant!r} is not allowed; use one of {', '.join(VARIANTS)}"
        )
    mirror = _string(base.get("mirror", DEFAULT_MIRROR), "base.mirror")
    if not _MIRROR_RE.fullmatch(mirror):
        raise SpecError(
            f"base.mirror: {mirror!r} is not allowed; use a plain http:// or https:// URL "
            'such as "http://deb.debian.org/debian"'
        )

    apt_packages = _packages(_table(doc, "apt"), "apt.packages", _APT_RE, "a Debian package name")
    pip_packages = _packages(
        _table(doc, "pip"), "pip.packages", _PIP_RE, "a PyPI requirement like numpy or numpy==2.2.6"
    )
    files = _files(doc.get("files", []), base_dir)
    env = _env(_table(doc, "env"))
    if parent is not None:
        env = {**parent.env, **env}
        suite, variant, mirror = parent.suite, parent.variant, parent.mirror

    run = _table(doc, "run")
    workdir = _abs_path(
        _string(run.get("workdir", parent.workdir if parent else "/workspace"), "run.workdir"),
        "run.workdir",
    )
    user = _string(run.get("user", parent.user if parent else "user"), "run.user")
    if user not in ("user", "root"):
        raise SpecError(
            f'run.user: {user!r} is not allowed; use "user" (uid 1000) or "root" '
            "(uid 0 inside the sandbox, without capabilities)"
        )

    start_cmd = parent.start_cmd if parent else None
    ready_cmd = parent.ready_cmd if parent else None
    ready_timeout = parent.ready_timeout if parent else 30.0
    if "start" in doc:
        ready_cmd, ready_timeout = None, 30.0
        start = _table(doc, "start")
        if "cmd" not in start:
            raise SpecError("start.cmd: missing; [start] needs the command to run, as a string")
        start_cmd = _command(start["cmd"], "start.cmd")
        if "ready" in start:
            ready_cmd = _command(start["ready"], "start.ready")
        if "ready_timeout" in start:
            t = start["ready_timeout"]
            if (
                isinstance(t, bool)
                or not isinstance(t, int | float)
                or not 0 < t <= MAX_READY_TIMEOUT
            ):
                raise SpecError(
                    f"start.ready_timeout: {t!r} is not allowed; use a number of seconds "
                    f"above 0 and at most {MAX_READY_TIMEOUT}"
                )
            ready_timeout = float(t)

    warm: tuple[str, ...] = parent.warm if parent else ()
    if "code" in doc:
        langs = _table(doc, "code").get("warm", [])
        if not isinstance(langs, list) or not all(isinstance(x, str) for x in langs):
            raise SpecError('code.warm: must be a list of language names, e.g. ["python"]')
        for lang in langs:
            if lang not in WARM_LANGUAGES:
                raise SpecError(
                    f"code.warm: {lang!r} is not a code-interpreter language; use any of "
                    f"{', '.join(WARM_LANGUAGES)}"
                )
        warm = tuple(dict.fromkeys(langs))

    return TemplateSpec(
        name=name,
        description=description,
        suite=suite,
        variant=variant,
        mirror=mirror,
        apt_packages=apt_packages,
        pip_packages=pip_packages,
        files=files,
        env=env,
        workdir=workdir,
        user=user,
        start_cmd=start_cmd,
        ready_cmd=ready_cmd,
        ready_timeout=ready_timeout,
        warm=warm,
        spec_text=text,
        parent=parent,
    )


def _parent(doc: dict[str, Any], depth: int) -> TemplateSpec | None:
    if "extends" not in doc:
        return None
    name = _string(doc["extends"], "extends")
    path = builtin_spec_path(name) if valid_name(name) else None
    if path is None:
        raise SpecError(
            f"extends: {name!r} is not a shipped template spec; use one of "
            f"{', '.join(builtin_spec_names())}"
        )
    if depth >= MAX_EXTENDS_DEPTH:
        raise SpecError(f"extends: more than {MAX_EXTENDS_DEPTH} specs deep (a cycle?)")
    return load_spec(path.read_text(), path.parent, depth + 1)


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise SpecError(f"unknown key {key!r} in {where}; allowed: {', '.join(allowed)}")


def _table(doc: dict[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise SpecError(f"{name}: must be a table ([{name}]), not a {type(value).__name__}")
    return value


def _string(value: Any, field_name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{field_name}: must be a string, not {type(value).__name__}")
    if not allow_empty and not value:
        raise SpecError(f"{field_name}: must not be empty")
    if "\0" in value:
        raise SpecError(f"{field_name}: must not contain NUL characters")
    if len(value) > MAX_VALUE_CHARS:
        raise SpecError(f"{field_name}: longer than {MAX_VALUE_CHARS} characters")
    return value


def _command(value: Any, field_name: str) -> str:
    cmd = _string(value, field_name)
    if not cmd.strip():
        raise SpecError(f"{field_name}: must be a shell command, not blank")
    return cmd


def _packages(
    table: dict[str, Any], field_name: str, pattern: re.Pattern[str], what: str
) -> tuple[str, ...]:
    pkgs = table.get("packages", [])
    if not isinstance(pkgs, list):
        raise SpecError(f"{field_name}: must be a list of strings")
    if len(pkgs) > MAX_PACKAGES:
        raise SpecError(f"{field_name}: at most {MAX_PACKAGES} packages")
    for p in pkgs:
        if not isinstance(p, str) or not pattern.fullmatch(p):
            raise SpecError(
                f"{field_name}: {p!r} is not allowed; each entry must be {what} "
                "(no spaces, no options, no URLs, not starting with '-')"
            )
    # Order does not matter to apt or pip's resolver: sorted, so reordering is no rebuild.
    return tuple(sorted(set(pkgs)))


def _abs_path(path: str, field_name: str) -> str:
    if not path.startswith("/") or any(c in path for c in "\n\r\t") or "\\" in path:
        raise SpecError(f"{field_name}: {path!r} must be an absolute path like /workspace")
    norm = posixpath.normpath(path)
    if norm != path or path.startswith("//"):
        raise SpecError(f"{field_name}: {path!r} is not normalised; write it as {norm!r}")
    return path


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _files(entries: Any, base_dir: Path | None) -> tuple[FileSpec, ...]:
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SpecError("files: must be an array of tables ([[files]] with dest and content)")
    if len(entries) > MAX_FILES:
        raise SpecError(f"files: at most {MAX_FILES} entries")
    out: list[FileSpec] = []
    seen: set[str] = set()
    total = 0
    for i, entry in enumerate(entries):
        where = f"files[{i}]"
        _check_keys(entry, _FILE_KEYS, where)
        if "dest" not in entry:
            raise SpecError(f"{where}.dest: missing; give the absolute path to write")
        dest = _abs_path(_string(entry["dest"], f"{where}.dest"), f"{where}.dest")
        if (
            dest == "/"
            or any(_under(dest, r) for r in FORBIDDEN_DEST_ROOTS)
            or dest in FORBIDDEN_DESTS
        ):
            raise SpecError(
                f"{where}.dest: {dest!r} is not allowed; sandboxes mount over "
                f"{', '.join(FORBIDDEN_DEST_ROOTS + FORBIDDEN_DESTS)}, so files cannot go there"
            )
        if dest in seen:
            raise SpecError(f"{where}.dest: {dest!r} is given twice")
        seen.add(dest)
        content = _file_content(entry, where, base_dir)
        total += len(content)
        if total > MAX_TOTAL_FILE_BYTES:
            raise SpecError(f"files: more than {MAX_TOTAL_FILE_BYTES} bytes in all")
        mode = entry.get("mode", "0644")
        if not isinstance(mode, str) or not re.fullmatch(r"0?[0-7]{3}", mode):
            raise SpecError(
                f'{where}.mode: {mode!r} is not allowed; use an octal string from "0000" to '
                '"0777" such as "0644" (no setuid, setgid or sticky bits)'
            )
        out.append(FileSpec(dest=dest, content=content, mode=int(mode, 8)))
    return tuple(out)


def _file_content(entry: dict[str, Any], where: str, base_dir: Path | None) -> bytes:
    if ("content" in entry) == ("src" in entry):
        raise SpecError(f"{where}: give exactly one of content (a string) or src (a path)")
    if "content" in entry:
        content = entry["content"]
        if not isinstance(content, str):
            raise SpecError(f"{where}.content: must be a string")
        data = content.encode()
    else:
        src = _string(entry["src"], f"{where}.src")
        if base_dir is None:
            raise SpecError(
                f"{where}.src: {src!r} cannot be read here (no spec directory); send the "
                "file's text as content instead"
            )
        root = base_dir.resolve()
        path = (root / src).resolve()
        if not path.is_relative_to(root):
            raise SpecError(f"{where}.src: {src!r} is outside the spec's directory {root}")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SpecError(f"{where}.src: cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
    return data


def _env(table: dict[str, Any]) -> dict[str, str]:
    if len(table) > MAX_ENV:
        raise SpecError(f"env: at most {MAX_ENV} variables")
    out: dict[str, str] = {}
    for key, value in table.items():
        if not _ENV_KEY_RE.fullmatch(key):
            raise SpecError(
                f"env: {key!r} is not a variable name; use letters, digits and '_', not "
                "starting with a digit"
            )
        out[key] = _string(value, f"env.{key}", allow_empty=True)
    return out
