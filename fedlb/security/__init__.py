"""fedlb.security: TLS material, silo keys and digests of stored files, for the deployment
and the cluster mode alike (it knows nothing of Flower's strategies).

- `make_certificates`, `make_silo_key`, `TlsFiles` (`TlsError`): a federation's CA,
  server certificate and silo keys.
- `file_digest`, `write_digest`, `check_digest`, `digest_path` (`DigestError`): SHA-256
  digests beside stored files.
- `claim_folder` (`FolderInUseError`, `LOCK_FILE`): one fedlb run per out-dir or work
  dir at a time, an OS lock held while the run's process lives; `cut_command`: a command
  line for a message, cut on whole arguments.
- `read_json`, `read_json_object`, `read_json_lines`, `read_lines`, `parse_json`,
  `json_kind`, `set_aside`, `open_stored`
  (`StoredFileError`): JSON files read back bounded in size and depth, finite numbers
  only, regular files only (a FIFO or a device refused at once); a damaged one set aside.
- `seal_zip`, `check_seal` (`DigestError`): a zip's own digest, sealed at its end (its
  archive comment), over every byte of it: checked with or without a side file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlb._faces import lazy_face

if TYPE_CHECKING:
    from .digests import (
        DigestError,
        check_digest,
        check_seal,
        digest_path,
        file_digest,
        seal_zip,
        write_digest,
    )
    from .run_lock import LOCK_FILE, FolderInUseError, claim_folder, cut_command
    from .stored import (
        StoredFileError,
        json_kind,
        open_stored,
        parse_json,
        read_json,
        read_json_lines,
        read_json_object,
        read_lines,
        set_aside,
    )
    from .tls import TlsError, TlsFiles, make_certificates, make_silo_key

__all__ = [
    "LOCK_FILE",
    "DigestError",
    "FolderInUseError",
    "StoredFileError",
    "TlsError",
    "TlsFiles",
    "check_digest",
    "check_seal",
    "claim_folder",
    "cut_command",
    "digest_path",
    "file_digest",
    "json_kind",
    "make_certificates",
    "make_silo_key",
    "open_stored",
    "parse_json",
    "read_json",
    "read_json_lines",
    "read_json_object",
    "read_lines",
    "seal_zip",
    "set_aside",
    "write_digest",
]

__getattr__ = lazy_face(
    __name__,
    {
        ".tls": ["TlsError", "TlsFiles", "make_certificates", "make_silo_key"],
        ".digests": [
            "DigestError",
            "check_digest",
            "check_seal",
            "digest_path",
            "file_digest",
            "seal_zip",
            "write_digest",
        ],
        ".run_lock": ["LOCK_FILE", "FolderInUseError", "claim_folder", "cut_command"],
        ".stored": [
            "StoredFileError",
            "json_kind",
            "open_stored",
            "parse_json",
            "read_json",
            "read_json_lines",
            "read_json_object",
            "read_lines",
            "set_aside",
        ],
    },
)
