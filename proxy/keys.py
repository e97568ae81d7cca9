"""Client API keys (DESIGN §11: every channel that leaves loopback is authenticated).

Keys come from a file only its owner can read (``--api-keys-file``, ``proxy.api_keys_file``;
the check of onepiece/secret_file.py) or from ``$ONEPIECE_API_KEYS``; never from a command line
(``ps`` shows those to every user). Both hold keys separated by new lines, commas or white
space (``#`` starts a comment). A key is 32 to 256 visible ASCII characters (``onepiece keys
new`` makes one), so that its hash cannot be searched for.

A request's key is compared with every key in constant time (digests of equal length, no early
exit). What the proxy keeps of the caller is its *owner tag*: a hash of the key, stored in the
records it creates, so a record names its owner without holding anything that gives the key back.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from onepiece.secret_file import SecretFileError, read_secret_file

ENV = "ONEPIECE_API_KEYS"  # the proxy's keys
CLIENT_ENV = "ONEPIECE_API_KEY"  # a client's key (onepiece.client, onepiece generate)
KEY_RE = re.compile(r"^(?:(?![,#])[\x21-\x7e]){32,256}$")  # visible ASCII but the separators
MAX_KEYS_FILE_BYTES = 1 << 20
NO_KEYS_BEYOND_LOOPBACK = (
    "a proxy that binds beyond loopback needs client API keys: put them in a file of mode 0600 named by "
    f"--api-keys-file (proxy.api_keys_file in a topology), or in the environment variable {ENV} "
    "(`onepiece keys new --file PATH` makes one); or bind to 127.0.0.1")


class ApiKeyError(SecretFileError):
    """Keys given but unusable, or missing where they are required; never echoes a key."""


def new_key() -> str:
    """A fresh key: 256 random bits."""
    return "op-" + secrets.token_urlsafe(32)


def owner_tag(key: str) -> str:
    """What a record stores of its creator's key: non-reversible, the same on every proxy."""
    return hashlib.sha256(b"onepiece-owner\0" + key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``owner`` is its key's tag (None when keys are off: everyone is one
    caller), ``secret`` what its idempotent ids are derived from (unknown to other callers)."""

    owner: str | None = None
    secret: bytes = field(default=b"", repr=False)


ANYONE = Caller()


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        keys = list(dict.fromkeys(keys))
        if not keys:
            raise ApiKeyError("no API key given")
        # (digest to compare, the caller it stands for); the keys themselves are not kept.
        self._entries = [(hashlib.sha256(k.encode()).digest(),
                          Caller(owner_tag(k), hashlib.sha256(b"onepiece-idempotency\0" + k.encode()).digest()))
                         for k in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def caller(self, presented: str) -> Caller | None:
        """The caller ``presented`` is the key of; None if it is none of them."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for want, caller in self._entries:  # every entry, whatever matched: constant time
            if hmac.compare_digest(digest, want):
                found = caller
        return found


def parse_keys(text: str, where: str) -> list[str]:
    """The keys in ``text``, separated by new lines, commas or white space (``#`` starts a
    comment to the end of its line): the same for a file and the variable. An error names
    ``where`` and the line, never the key."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for word in re.split(r"[\s,]+", line.split("#", 1)[0]):
            if not word:
                continue
            if not KEY_RE.match(word):
                raise ApiKeyError(f"{where}, line {n}: a key is 32 to 256 visible ASCII characters, without "
                                  f"',' or '#' (`onepiece keys new` makes one)")
            out.append(word)
    if not out:
        raise ApiKeyError(f"{where}: holds no key")
    return out


def load_keys(file: str | Path | None, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """The proxy's keys: from ``file`` if given, else ``$ONEPIECE_API_KEYS``; None if neither."""
    if file:
        text = read_secret_file(file, "API keys", MAX_KEYS_FILE_BYTES)
        return ApiKeys(parse_keys(text, f"API keys file {file}"))
    value = environ.get(ENV, "")
    if not value.strip():
        return None
    return ApiKeys(parse_keys(value, f"environment variable {ENV}"))


def client_key(file: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client sends: the one in ``file`` (mode 0600, the same check), else
    ``$ONEPIECE_API_KEY``; None when neither is given."""
    if file:
        keys = parse_keys(read_secret_file(file, "API key"), f"API key file {file}")
        if len(keys) > 1:
            raise ApiKeyError(f"API key file {file}: holds {len(keys)} keys; a client sends one")
        return keys[0]
    return environ.get(CLIENT_ENV, "").strip() or None


def beyond_loopback(host: str) -> bool:
    """Whether binding ``host`` accepts connections from other hosts (a name other than
    localhost counts as such: it may resolve anywhere)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True


def check_bind(host: str, keys: ApiKeys | None) -> None:
    """Refuse a proxy that would serve other hosts without keys."""
    if keys is None and beyond_loopback(host):
        raise ApiKeyError(f"proxy on {host}: {NO_KEYS_BEYOND_LOOPBACK}")
