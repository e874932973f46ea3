"""The CLI's credentials file: named contexts (control-plane URL + token), one of them current.

The file is TOML (`~/.config/dctl/credentials`, mode 0600):

    current = "default"
    [contexts.default]
    url = "https://cp.example:8700"
    token = "dctl_..."
    ca_file = "/etc/dctl/ca.pem"   # optional: the CA that signed the server's certificate

It holds secrets a person may have edited by hand, so dctl never rewrites it wholesale: a new
context is appended as text, `current` is the only line ever changed, every write is atomic
(temporary file + rename) and happens under a lock so two writers cannot lose each other's
additions. `DCTL_URL`, `DCTL_TOKEN` and `DCTL_CA_FILE` override whatever the file says.

Without a `ca_file`, an https:// control plane is verified against the system trust store; a
relative `ca_file` is read from the credentials file's directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime import paths

URL_ENV = "DCTL_URL"
TOKEN_ENV = "DCTL_TOKEN"
CONTEXT_ENV = "DCTL_CONTEXT"
CA_FILE_ENV = "DCTL_CA_FILE"
FILE_MODE = 0o600

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# `current = ...` at the top level: before the first table header, on its own line.
_CURRENT_LINE = re.compile(r"^[ \t]*current[ \t]*=.*$", re.MULTILINE)
_TABLE_HEADER = re.compile(r"^[ \t]*\[", re.MULTILINE)


class CredentialsError(Exception):
    """The credentials file cannot be read or changed; the message says what to fix."""


@dataclass(frozen=True)
class Context:
    """One control plane the CLI can talk to: where it is, which token to present, and the CA
    file its certificate is verified with (None: the system trust store)."""

    name: str
    url: str
    token: str | None = None
    ca_file: str | None = None


def credentials_file() -> Path:
    """Where the credentials live: `credentials` in the dctl config directory."""
    return paths.config_dir() / "credentials"


def _toml_string(value: str) -> str:
    # A JSON string without ASCII escaping is a valid TOML basic string (same escapes).
    return json.dumps(value, ensure_ascii=False)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def check_name(name: str) -> str:
    """Return NAME if it is a usable context name, else raise with what is allowed."""
    if not _NAME.match(name):
        raise CredentialsError(
            f"invalid context name {name!r}: use 1-63 letters, digits, '.', ':', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


class CredentialsFile:
    """The credentials file at one path: read its contexts, add one, choose the current one."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or credentials_file()

    # Reading ---------------------------------------------------------------------------------

    def _text(self) -> str:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            raise CredentialsError(f"credentials file {self.path}: cannot be read: {exc}") from exc
        if stat.S_IMODE(info.st_mode) & 0o077:
            # Like ssh with a private key: a token others can read is a leaked token.
            raise CredentialsError(
                f"credentials file {self.path} is readable by other users "
                f"(mode {stat.S_IMODE(info.st_mode):04o}): run `chmod 600 {self.path}`"
            )
        try:
            return self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CredentialsError(f"credentials file {self.path}: cannot be read: {exc}") from exc

    def _parse(self, text: str) -> tuple[str | None, dict[str, Context]]:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CredentialsError(f"credentials file {self.path}: not valid TOML: {exc}") from exc
        current = data.get("current")
        if current is not None and not isinstance(current, str):
            raise CredentialsError(f"credentials file {self.path}: `current` must be a string")
        raw = data.get("contexts", {})
        if not isinstance(raw, Mapping):
            raise CredentialsError(f"credentials file {self.path}: `contexts` must be a table")
        contexts: dict[str, Context] = {}
        for name, entry in raw.items():
            if not isinstance(entry, Mapping) or not isinstance(entry.get("url"), str):
                raise CredentialsError(
                    f"credentials file {self.path}: [contexts.{name}] needs a string `url`"
                )
            token = entry.get("token")
            if token is not None and not isinstance(token, str):
                raise CredentialsError(
                    f"credentials file {self.path}: [contexts.{name}] `token` must be a string"
                )
            ca_file = entry.get("ca_file")
            if ca_file is not None and not isinstance(ca_file, str):
                raise CredentialsError(
                    f"credentials file {self.path}: [contexts.{name}] `ca_file` must be a string"
                )
            if ca_file:
                # Relative to the file, like ssh's IdentityFile: not to wherever dctl runs from.
                ca_file = str(self.path.parent / Path(ca_file).expanduser())
            contexts[name] = Context(name=name, url=entry["url"], token=token, ca_file=ca_file)
        return current, contexts

    def load(self) -> tuple[str | None, dict[str, Context]]:
        """The name `current` points at (maybe a missing one) and every context, in file order."""
        return self._parse(self._text())

    # Writing ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # The lock is a sibling file: the credentials file itself is replaced by rename.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(
                self.path.with_name(self.path.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600
            )
        except OSError as exc:
            raise CredentialsError(f"credentials file {self.path}: cannot lock: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _replace(self, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
            try:
                os.write(fd, text.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CredentialsError(
                f"credentials file {self.path}: cannot be written: {exc}"
            ) from exc

    def _checked(
        self, text: str, before: dict[str, Context]
    ) -> tuple[str | None, dict[str, Context]]:
        # Text edits must never lose or alter an existing context; parse the result to prove it.
        current, after = self._parse(text)
        if any(after.get(name) != ctx for name, ctx in before.items()):
            raise CredentialsError(
                f"credentials file {self.path}: its layout is unusual and dctl cannot edit it "
                "safely; edit it by hand"
            )
        return current, after

    def add(
        self,
        url: str,
        token: str | None,
        name: str = "default",
        make_current: bool = False,
        ca_file: str | None = None,
    ) -> Context:
        """Append a context; a taken NAME gets a `-2`, `-3`... suffix. Returns what was added.

        The context becomes current when MAKE_CURRENT is set or when no valid context is current.
        CA_FILE is stored as an absolute path.
        """
        if ca_file is not None:
            ca_file = str(Path(ca_file).expanduser().resolve())
        check_name(name)
        with self._locked():
            text = self._text()
            current, before = self._parse(text)
            chosen, n = name, 1
            while chosen in before:
                n += 1
                chosen = f"{name}-{n}"
            block = f"[contexts.{_toml_key(chosen)}]\nurl = {_toml_string(url)}\n"
            if token is not None:
                block += f"token = {_toml_string(token)}\n"
            if ca_file is not None:
                block += f"ca_file = {_toml_string(ca_file)}\n"
            if text and not text.endswith("\n"):
                text += "\n"
            text += ("\n" if text else "") + block
            if make_current or current not in before:
                text = self._with_current(text, chosen)
            self._checked(text, before)
            self._replace(text)
        return Context(name=chosen, url=url, token=token, ca_file=ca_file)

    def use(self, name: str) -> Context:
        """Make NAME the current context."""
        with self._locked():
            text = self._text()
            _, before = self._parse(text)
            if name not in before:
                known = ", ".join(before) or "none"
                raise CredentialsError(f"no context named {name!r} (known: {known})")
            text = self._with_current(text, name)
            current, _ = self._checked(text, before)
            if current != name:
                raise CredentialsError(
                    f"credentials file {self.path}: cannot set `current` in it; edit it by hand"
                )
            self._replace(text)
        return before[name]

    @staticmethod
    def _with_current(text: str, name: str) -> str:
        line = f"current = {_toml_string(name)}"
        header = _TABLE_HEADER.search(text)
        top_end = header.start() if header else len(text)
        match = _CURRENT_LINE.search(text, 0, top_end)
        if match:
            return text[: match.start()] + line + text[match.end() :]
        return f"{line}\n" + text


def resolve(
    name: str | None = None, path: Path | None = None, env: Mapping[str, str] | None = None
) -> Context:
    """The context the CLI should use: NAME, `DCTL_CONTEXT` or the current one, then env overrides.

    `DCTL_URL`, `DCTL_TOKEN` and `DCTL_CA_FILE` beat the file, so scripts need no file at all.
    """
    env = os.environ if env is None else env
    env_url, env_token = env.get(URL_ENV) or None, env.get(TOKEN_ENV) or None
    env_ca_file = env.get(CA_FILE_ENV) or None
    wanted = name or env.get(CONTEXT_ENV) or None
    store = CredentialsFile(path)
    if env_url and env_token and not wanted:
        return Context(name="env", url=env_url, token=env_token, ca_file=env_ca_file)
    current, contexts = store.load()
    chosen = wanted or current
    if wanted and wanted not in contexts:
        known = ", ".join(contexts) or "none"
        raise CredentialsError(f"no context named {wanted!r} in {store.path} (known: {known})")
    base = contexts.get(chosen) if chosen else None
    url = env_url or (base.url if base else None)
    if url is None:
        raise CredentialsError(
            f"no control plane configured: {store.path} has no current context; start "
            f"`dctl server` (it adds one), run `dctl context use NAME`, or set {URL_ENV} "
            f"and {TOKEN_ENV}"
        )
    token, ca_file = env_token, env_ca_file
    if base is not None and base.url.rstrip("/") == url.rstrip("/"):
        # The file's token goes only to the server it was issued by, never to a DCTL_URL elsewhere;
        # its CA vouches for that server only, too.
        token = base.token if token is None else token
        ca_file = base.ca_file if ca_file is None else ca_file
    return Context(name=base.name if base else "env", url=url, token=token, ca_file=ca_file)
