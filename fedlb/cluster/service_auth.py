"""Who may call the manager service: an optional shared token, optional TLS.

The token travels as gRPC metadata `authorization: Bearer <token>` on every call and is
checked by a server interceptor before any handler runs. Without TLS it crosses the network
in the clear: a token alone keeps out other users of a trusted network, not an eavesdropper.
TLS uses a server certificate and key (those `fedlb certs` writes: the CLI finds them in
its folder); clients trust the CA that signed it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "FEDLB_MANAGER_TOKEN"
MIN_TOKEN_CHARS = 16
_HEADER = "authorization"


class ManagerSetupError(ValueError):
    """A token or certificate the service or a client cannot use; the message says why."""


def check_token(token: str, source: str) -> str:
    """`token` stripped, or ManagerSetupError: it must be a printable header value."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
        raise ManagerSetupError(
            f"the token from {source} must be at least {MIN_TOKEN_CHARS} printable ASCII "
            "characters (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if any(c.isspace() for c in token):
        raise ManagerSetupError(f"the token from {source} must not contain spaces")
    return token


def read_token(path: Path | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token in `path`, else in $FEDLB_MANAGER_TOKEN, else None (no token)."""
    if path is not None:
        try:
            return check_token(path.read_text(), str(path))
        except (OSError, UnicodeDecodeError) as error:
            raise ManagerSetupError(f"cannot read the token file {path}: {error}") from error
    if env.get(TOKEN_ENV):
        return check_token(env[TOKEN_ENV], f"${TOKEN_ENV}")
    return None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ManagerSetupError(
            f"cannot read {what} {path}: {error.strerror} (make TLS files with fedlb certs)"
        ) from error


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """TLS from a PEM certificate and its key, checked here: gRPC only says that it
    cannot listen."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key_pem, cert_pem = _read(key, "the TLS key"), _read(cert, "the TLS certificate")
    try:
        public = x509.load_pem_x509_certificate(cert_pem).public_key()
        private = load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:  # not PEM, or a key with a password
        raise ManagerSetupError(f"{cert}, {key}: unusable TLS files: {error}") from error
    if public != private.public_key():
        raise ManagerSetupError(f"{key} is not the key of {cert}")
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def client_channel(address: str, root_certificates: Path | bytes | None) -> grpc.Channel:
    """A plain channel, or TLS trusting `root_certificates` (a CA certificate file, e.g.
    the ca.crt of `fedlb certs`, or its PEM)."""
    if root_certificates is None:
        return grpc.insecure_channel(address)
    if isinstance(root_certificates, Path):
        root_certificates = _read(root_certificates, "the CA certificate")
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else ((_HEADER, f"Bearer {token}"),)


def _refuse(request: bytes, context: grpc.ServicerContext) -> None:
    context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "this manager wants a token: metadata 'authorization: Bearer <token>' "
        f"(ManagerClient(token=...) or ${TOKEN_ENV})",
    )


class TokenCheck(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs here
    """Lets a call through only with the right bearer token (compared in constant time)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._refusal = grpc.unary_unary_rpc_method_handler(_refuse)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            given = value if isinstance(value, bytes) else str(value).encode()
            if key == _HEADER and hmac.compare_digest(given, self._expected):
                return continuation(handler_call_details)
        return self._refusal
