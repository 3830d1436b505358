"""Ray's security settings for the testbed's clusters: a fresh auth token per testbed and, with
``tls=True``, certificates of a throwaway CA (docs/deployment.md §8)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, TypedDict

from ray_velo.testbed.errors import TestbedUnavailable
from ray_velo.wire.auth import TlsFiles

__all__ = [
    "AUTH_MODES",
    "DEFAULT_SECURITY",
    "AuthMode",
    "Security",
    "auth_env",
    "make_tls_files",
    "new_token",
    "tls_env",
    "without_inherited",
]

AuthMode = Literal["token", "disabled"]
AUTH_MODES: Final = ("token", "disabled")


class Security(TypedDict):
    """A testbed's Ray security settings (the ``auth`` and ``tls`` of ``Testbed``)."""

    auth: AuthMode
    tls: bool


#: Ray's coming default: token auth on, TLS off.
DEFAULT_SECURITY: Final[Security] = {"auth": "token", "tls": False}
#: Settings a process may carry from its parent that would contradict the testbed's own.
_INHERITED: Final = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_USE_TLS")


def new_token() -> str:
    """A fresh Ray auth token (64 hex digits, as ``ray get-auth-token --generate`` makes)."""
    return secrets.token_hex(32)


def auth_env(mode: AuthMode, token: str | None) -> dict[str, str]:
    """The environment of every node and driver of a cluster with Ray's auth ``mode``."""
    if mode not in AUTH_MODES:
        raise ValueError(f"auth must be one of {AUTH_MODES}, got {mode!r}")
    env: dict[str, str] = {"RAY_AUTH_MODE": mode}
    if mode == "token":
        if not token:
            raise ValueError("token auth needs a token")
        env["RAY_AUTH_TOKEN"] = token
    return env


def without_inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the auth, TLS and Ray address settings a parent process may carry."""
    drop = ("RAY_TLS_", "RAY_ADDRESS")
    return {k: v for k, v in environ.items() if k not in _INHERITED and not k.startswith(drop)}


def tls_env(files: TlsFiles) -> dict[str, str]:
    """The environment of a node (and its drivers) under Ray's TLS with ``files``."""
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": files.cert,
        "RAY_TLS_SERVER_KEY": files.key,
        "RAY_TLS_CA_CERT": files.ca,
    }


def make_tls_files(directory: str, addresses: Sequence[str]) -> list[TlsFiles]:
    """A throwaway CA in ``directory`` and, for each address, a certificate it signed that
    names that address (and 127.0.0.1: Ray's processes also dial it locally).

    Raises:
        TestbedUnavailable: the ``cryptography`` package is missing.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as exc:
        raise TestbedUnavailable(reason=f"TLS certificates need `cryptography`: {exc}") from exc

    os.makedirs(directory, mode=0o700, exist_ok=True)
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_extension = x509.BasicConstraints(ca=True, path_length=0)
    ca = _certificate("ray_velo testbed CA", ca_key.public_key(), ca_key, ca_extension)
    ca_path = _write(directory, "ca.crt", ca.public_bytes(pem))
    out = []
    for index, address in enumerate(addresses):
        key = ec.generate_private_key(ec.SECP256R1())
        names = x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys((address, "127.0.0.1"))]
        )
        cert = _certificate(address, key.public_key(), ca_key, names, issuer="ray_velo testbed CA")
        private = key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        out.append(
            TlsFiles(
                cert=_write(directory, f"node{index}.crt", cert.public_bytes(pem)),
                key=_write(directory, f"node{index}.key", private),
                ca=ca_path,
            )
        )
    return out


def _certificate(
    subject: str, public_key: Any, signing_key: Any, extension: Any, issuer: str | None = None
) -> Any:
    """A certificate for ``subject`` valid from five minutes ago for a day, signed by
    ``signing_key`` (self-signed when no ``issuer`` is named)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer or subject))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(extension, critical=isinstance(extension, x509.BasicConstraints))
        .sign(signing_key, hashes.SHA256())
    )


def _write(directory: str, name: str, data: bytes) -> str:
    """``data`` in a new file of ``directory`` only this user can read; its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
