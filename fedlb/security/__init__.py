"""fedlb.security: TLS material, silo keys and digests of stored files, for the deployment
and the cluster mode alike (it knows nothing of Flower's strategies).

- `make_certificates`, `make_silo_key`, `TlsFiles` (`TlsError`): a federation's CA,
  server certificate and silo keys.
- `file_digest`, `write_digest`, `check_digest`, `digest_path` (`DigestError`): SHA-256
  digests beside stored files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlb._faces import lazy_face

if TYPE_CHECKING:
    from .digests import DigestError, check_digest, digest_path, file_digest, write_digest
    from .tls import TlsError, TlsFiles, make_certificates, make_silo_key

__all__ = [
    "DigestError",
    "TlsError",
    "TlsFiles",
    "check_digest",
    "digest_path",
    "file_digest",
    "make_certificates",
    "make_silo_key",
    "write_digest",
]

__getattr__ = lazy_face(
    __name__,
    {
        ".tls": ["TlsError", "TlsFiles", "make_certificates", "make_silo_key"],
        ".digests": ["DigestError", "check_digest", "digest_path", "file_digest", "write_digest"],
    },
)
