"""fedlb.he: CKKS homomorphic encryption of model updates (TenSEAL).

Keys (`write_keys`, `load_context` with its role checks, `fingerprint`), packing arrays
into as few ciphertexts as the slots allow (`encrypt_arrays`, `decrypt_arrays`,
`Layout`), and the server's encrypted weighted average (`load_ciphertexts`,
`weighted_sum`). numpy and tenseal only.
"""

from .keys import (
    FINGERPRINT_FILE,
    PUBLIC_FILE,
    SECRET_FILE,
    ContextInfo,
    HeKeyError,
    HeParams,
    KeyFiles,
    check_context,
    context_info,
    fingerprint,
    generate_keys,
    load_context,
    public_context,
    write_keys,
)
from .packing import (
    CiphertextError,
    Layout,
    decrypt_arrays,
    encrypt_arrays,
    layout_of,
    load_ciphertexts,
    weighted_sum,
)

__all__ = [
    "FINGERPRINT_FILE",
    "PUBLIC_FILE",
    "SECRET_FILE",
    "CiphertextError",
    "ContextInfo",
    "HeKeyError",
    "HeParams",
    "KeyFiles",
    "Layout",
    "check_context",
    "context_info",
    "decrypt_arrays",
    "encrypt_arrays",
    "fingerprint",
    "generate_keys",
    "layout_of",
    "load_ciphertexts",
    "load_context",
    "public_context",
    "weighted_sum",
    "write_keys",
]
