"""The key that signs what gradline writes and later trusts (checkpoint manifests), and
the HMAC-SHA256 that signs and checks with it.

Why a key: a checksum manifest that sits beside the files it covers proves nothing
against someone who can write that folder, since they can rewrite the manifest too.
An HMAC over the manifest, keyed by a secret kept elsewhere, can only be made by a
holder of the key.

Where the key comes from, in order:
1. GRADLINE_SIGNING_KEY (at least 32 characters): for jobs whose nodes do not share the
   project folder, and for checkpoints kept outside a project. Every node of one job
   must be given the same value.
2. `.gradline/signing.key` in the project that holds the signed folder (git-ignored),
   created once with mode 0600 on first use; nodes that share the project folder share
   it.
The key is never logged, never put in params or in a run's record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from training.errors import GradlineError
from training.roots import project_root_at_or_above

SIGNING_KEY_ENV = "GRADLINE_SIGNING_KEY"
KEY_FILE = Path(".gradline") / "signing.key"
MIN_KEY_CHARS = 32


class SigningKeyError(GradlineError):
    """No usable signing key: unset and outside a project, too short, or unreadable."""


def key_file(root: Path) -> Path:
    return root / KEY_FILE


def signing_key(signed: Path) -> bytes:
    """The key for files under `signed`: GRADLINE_SIGNING_KEY, else the key file of the
    project that holds `signed` (created on first use)."""
    from_env = os.environ.get(SIGNING_KEY_ENV)
    if from_env is not None:
        if len(from_env) < MIN_KEY_CHARS:
            raise SigningKeyError(
                f"{SIGNING_KEY_ENV} is shorter than {MIN_KEY_CHARS} characters; set it to "
                'a long random value, e.g. python -c "import secrets; '
                'print(secrets.token_hex(32))"'
            )
        return from_env.encode("utf-8")
    root = project_root_at_or_above(signed)
    if root is None:
        raise SigningKeyError(
            f"{signed} is not inside a gradline project, so there is no project key to "
            f"sign or check it with; set {SIGNING_KEY_ENV} (the same value on every node)"
        )
    return _read_or_create(key_file(root))


def _read_or_create(path: Path) -> bytes:
    """The key in `path`, created atomically the first time: written in full to a temp
    file of mode 0600, then linked into place, which fails if another process won the
    race (every rank then reads the winner's key)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write(secrets.token_hex(32))
                handle.flush()
                os.fsync(handle.fileno())
            # FileExistsError: another rank created it first, and its key is used.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    try:
        mode = path.stat().st_mode
        key = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SigningKeyError(f"cannot read the signing key {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # A key others can read or replace signs nothing they could not sign themselves.
        raise SigningKeyError(
            f"the signing key {path} is open to other users (mode {stat.S_IMODE(mode):o}); "
            f"run chmod 600 {path}"
        )
    if len(key) < MIN_KEY_CHARS:
        raise SigningKeyError(
            f"the signing key {path} is shorter than {MIN_KEY_CHARS} characters; delete it "
            "to have a new one made (checkpoints signed with the old one are then refused)"
        )
    return key.encode("ascii")


def sign(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def signature_matches(key: bytes, payload: bytes, signature: str) -> bool:
    """Constant-time comparison, so timing reveals nothing about the right signature."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign(key, payload), signature)
