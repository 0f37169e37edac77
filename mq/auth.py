"""Job membership: who may talk to a node.

Every node of a job knows one secret and proves it without sending it: the join handshake is a
challenge-response with fresh nonces in both directions (HMAC-SHA256)::

    A -> B  HELLO      {node A, nonce a, ...}
    B -> A  HELLO_ACK  {node B, nonce b, proof_B = MAC("ack",  a, b, B, A, incarnation B)}
    A -> B  LINK       {proof_A = MAC("link", b, a, A, B, incarnation A)}

A accepts B only after checking proof_B (bound to A's own fresh nonce: no replay), B accepts A
only after checking proof_A (bound to B's nonce). Until then neither is a peer: no frame of
theirs reaches a queue or handler.

Where the secret comes from, first match wins (:func:`resolve_secret`):

1. ``mq.create(..., secret=...)``;
2. the ``MQ_SECRET`` environment variable (``mq run`` sets it for its workers; k8s takes it
   from a Secret);
3. a per-user file, ``$MQ_SECRET_FILE`` or ``~/.config/mq/secret``, created with mode 0600 on
   first use: processes of one user on one host, or on hosts sharing a home directory (the usual
   Slurm setup), find each other with no setup, and nobody else gets in.

``insecure=True`` turns authentication off, and ``mq doctor`` says so.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any, Literal, overload

from mq.errors import ConfigError, ProtocolError
from mq.options import check_bool

NONCE_BYTES = 16
ENV_VAR = "MQ_SECRET"
FILE_ENV_VAR = "MQ_SECRET_FILE"


@dataclass(frozen=True)
class Secret:
    """A job secret and where it came from (``explicit``, ``env``, ``file:<path>``)."""

    key: bytes
    source: str

    def __repr__(self) -> str:  # never print the key
        return f"Secret(source={self.source!r})"

    def proof(self, purpose: str, mine: bytes, theirs: bytes, me: int, them: int, incarnation: str) -> bytes:
        """MAC binding both nonces, both node ids and the prover's incarnation."""
        msg = b"|".join([b"mq-auth-v1", purpose.encode(), mine, theirs, str(me).encode(),
                         str(them).encode(), incarnation.encode()])
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def check(self, proof: Any, purpose: str, mine: bytes, theirs: bytes, me: int, them: int,
              incarnation: Any) -> bool:
        if not isinstance(proof, bytes) or not isinstance(incarnation, str):
            return False
        return hmac.compare_digest(proof, self.proof(purpose, mine, theirs, me, them, incarnation))

    def sign(self, data: bytes) -> bytes:
        """MAC of a value written where strangers can write (the rendezvous store)."""
        return hmac.new(self.key, b"mq-store-v1|" + data, hashlib.sha256).digest()


def seal(secret: Secret | None, data: bytes) -> bytes:
    """``data`` with a MAC in front, for a store anyone on the network can write."""
    return data if secret is None else secret.sign(data) + data


def unseal(secret: Secret | None, blob: bytes, what: str) -> bytes:
    """The data of a :func:`seal`-ed value; :class:`~mq.errors.ProtocolError` if its MAC is
    wrong (a stranger planted it, or the writer has another secret)."""
    if secret is None:
        return blob
    mac, data = blob[:32], blob[32:]
    if len(mac) != 32 or not hmac.compare_digest(mac, secret.sign(data)):
        raise ProtocolError(f"{what} is not signed with this job's secret: planted by a stranger, "
                            "or that node uses another secret (set the same MQ_SECRET everywhere)")
    return data


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def default_secret_file() -> str:
    explicit = os.environ.get(FILE_ENV_VAR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "mq", "secret")


@overload
def resolve_secret(secret: Any = None, insecure: Literal[False] = False) -> Secret: ...
@overload
def resolve_secret(secret: Any = None, insecure: bool = False) -> Secret | None: ...
def resolve_secret(secret: Any = None, insecure: bool = False) -> Secret | None:
    """The job secret (see the module docstring), or None when ``insecure``.

    Raises:
        ConfigError: a bad ``secret``, or a secret file others can read (the fix is named).
    """
    if check_bool(insecure, "insecure"):
        if secret is not None:
            raise ConfigError("pass either secret= or insecure=True, not both")
        return None
    if secret is not None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, bytes) or len(secret) < 8:
            raise ConfigError("secret must be a str or bytes of at least 8 characters (e.g. "
                              "secrets.token_hex(16)), the same on every node of the job")
        return Secret(secret, "explicit")
    env = os.environ.get(ENV_VAR)
    if env:
        if len(env) < 8:
            raise ConfigError(f"{ENV_VAR} must be at least 8 characters (e.g. "
                              "`export MQ_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')`)")
        return Secret(env.encode(), "env")
    path = default_secret_file()
    return Secret(_read_or_create(path), f"file:{path}")


def _read_or_create(path: str) -> bytes:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if not os.path.exists(path):
        # Write a private temporary file, then link it into place: processes starting together
        # either win the link or read the winner's complete file, never a half-written one.
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the mq secret file {path} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {path}`")
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < 8:
        raise ConfigError(f"the mq secret file {path} is empty or too short: delete it and mq "
                          "makes a new one (every node of a job must share it)")
    return key


def state() -> dict[str, Any]:
    """The trust state a new node would have, for ``mq doctor`` (never the key; creates
    nothing)."""
    if os.environ.get(ENV_VAR):
        source = f"{ENV_VAR} (environment)"
    else:
        path = default_secret_file()
        if not os.path.exists(path):
            source = f"file {path} (made with mode 0600 on first use)"
        else:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            bad = mode & (stat.S_IRWXG | stat.S_IRWXO)
            source = f"file {path} (mode {mode:o}{': readable by others, run chmod 600' if bad else ''})"
    return {"authenticated": True, "secret": source,
            "opt_out": "mq.create(..., insecure=True) turns authentication off"}
