"""TLS for the SuperLink and its SuperNodes: a federation's own certificate authority.

`make_certificates` writes a CA (ca.crt; its key ca.key stays with whoever runs the
federation) and a server certificate for the SuperLink's host names and addresses
(server.crt, server.key). The SuperLink gets all three server files; every silo gets
ca.crt only, and refuses a SuperLink whose certificate that CA did not sign.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.crt", "server.key"


class TlsError(ValueError):
    """Certificate files that cannot be used; the message names them."""


@dataclass(frozen=True)
class TlsFiles:
    """The SuperLink's TLS files (PEM)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_folder(cls, folder: Path) -> TlsFiles:
        """ca.crt, server.crt and server.key from `fedlb certs`'s folder, checked."""
        files = cls(folder / CA_CERT, folder / SERVER_CERT, folder / SERVER_KEY)
        missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.is_file()]
        if missing:
            raise TlsError(f"missing TLS file(s) {', '.join(missing)}: make them with fedlb certs")
        return files

    def check(self, host: str) -> None:
        """TlsError unless the server certificate is one silos will accept: the CA signed
        it, the key is its key, both are valid now, and it names `host` (the address the
        SuperLink listens on; a wildcard address is not checked). Flower itself would
        start, then have every TLS handshake fail: "did not become ready" after a minute."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization

        def load(path: Path) -> x509.Certificate:
            try:
                return x509.load_pem_x509_certificate(path.read_bytes())
            except (OSError, ValueError) as error:
                raise TlsError(f"{path} is not a PEM certificate ({error})") from error

        ca, cert = load(self.ca), load(self.cert)
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as error:
            raise TlsError(
                f"{self.cert} was not signed by {self.ca} ({error or 'bad signature'}): silos "
                "trusting that CA would refuse the server; use the files of one `fedlb certs` "
                "run"
            ) from error
        try:
            key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as error:
            raise TlsError(f"{self.key} is not an unencrypted PEM private key ({error})") from error
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(
            serialization.Encoding.PEM, public
        ) != cert.public_key().public_bytes(serialization.Encoding.PEM, public):
            raise TlsError(f"{self.key} is not the key of {self.cert}")
        now = datetime.datetime.now(datetime.UTC)
        for path, certificate in ((self.ca, ca), (self.cert, cert)):
            if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
                raise TlsError(
                    f"{path} is valid from {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} "
                    f"to {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now: make "
                    "new certificates with fedlb certs"
                )
        if host in ("0.0.0.0", "::", ""):
            return
        names = certificate_names(cert)
        if host.lower() not in names:
            raise TlsError(
                f"{self.cert} is for {', '.join(sorted(names)) or 'no host'}, not {host}: silos "
                f"connecting to {host} would refuse it; make certificates for it (fedlb certs "
                f"--host {host})"
            )


def certificate_names(cert: object) -> set[str]:
    """The DNS names and IP addresses a certificate is for (lower case)."""
    from cryptography import x509

    assert isinstance(cert, x509.Certificate)
    try:
        alternative = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    names = {n.lower() for n in alternative.get_values_for_type(x509.DNSName)}
    return names | {str(a) for a in alternative.get_values_for_type(x509.IPAddress)}


def make_certificates(
    out: Path, hosts: list[str], days: int = 365, overwrite: bool = False
) -> TlsFiles:
    """A CA and a server certificate for `hosts` (names or IP addresses) in `out`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise TlsError("give at least one host name or address for the server certificate")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise TlsError(f"{', '.join(existing)} already exist; choose another folder or overwrite")
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlb federation CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    for path, data in zip(
        paths,
        (
            ca_cert.public_bytes(serialization.Encoding.PEM),
            key_bytes(ca_key),
            server_cert.public_bytes(serialization.Encoding.PEM),
            key_bytes(server_key),
        ),
        strict=True,
    ):
        path.write_bytes(data)
        if path.name.endswith(".key"):
            path.chmod(0o600)
    return TlsFiles(paths[0], paths[2], paths[3])


def make_silo_key(out: Path, name: str, overwrite: bool = False) -> tuple[Path, Path]:
    """A SuperNode authentication key pair (EC P-384, OpenSSH formats, as Flower reads
    them): NAME.key stays at the silo (`fedlb silo --auth-key`), NAME.pub goes to the
    server's folder of registered silos (`fedlb server --silo-keys`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not name or "/" in name:
        raise TlsError(f"a silo key needs a plain name, got {name!r}")
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / f"{name}.key", out / f"{name}.pub"
    existing = [str(p) for p in (private, public) if p.exists()]
    if existing and not overwrite:
        raise TlsError(f"{', '.join(existing)} already exist; choose another name or overwrite")
    key = ec.generate_private_key(ec.SECP384R1())
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + f" {name}\n".encode()
    )
    return private, public
