"""CKKS key material: parameters, key generation, and contexts checked for their role.

A silo holds the *secret* context (it decrypts the global model); the server holds the
*public* context: the parameters and the public key, no secret key, no Galois or
relinearisation keys (the weighted average multiplies ciphertexts by plaintext scalars
only, so it needs neither). A fingerprint of the public part ties the two together.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tenseal as ts

# The largest total coefficient modulus (bits) that keeps 128-bit security per ring
# degree: the HomomorphicEncryption.org standard's table, which SEAL enforces.
MAX_BITS_128 = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}

SECRET_FILE = "silo.context"
PUBLIC_FILE = "server.context"
FINGERPRINT_FILE = "fingerprint.txt"

Role = Literal["silo", "server"]


class HeKeyError(ValueError):
    """Key material that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class HeParams:
    """CKKS parameters. Defaults: ring degree 8192 (4096 slots per ciphertext), moduli
    60-40-60 bits (160 of the 218 bits 128-bit security allows), scale 2^40.

    Why: the weighted average is one ciphertext-by-scalar multiplication, so one 40-bit
    rescaling prime between the 60-bit data prime and the 60-bit special prime is all the
    depth it needs; a scale of 2^40 keeps ~1e-7 absolute precision, and the 60-bit data
    prime leaves 20 bits for the integer part (|weights| < 2^19).
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 60)
    scale_bits: int = 40

    def check(self) -> None:
        n, bits = self.poly_modulus_degree, self.coeff_mod_bit_sizes
        if n not in MAX_BITS_128:
            raise HeKeyError(f"poly modulus degree must be one of {sorted(MAX_BITS_128)}, got {n}")
        if sum(bits) > MAX_BITS_128[n]:
            raise HeKeyError(
                f"coefficient moduli {list(bits)} total {sum(bits)} bits: above the "
                f"{MAX_BITS_128[n]} bits that keep 128-bit security at degree {n}; use a "
                "larger degree or fewer bits"
            )
        if len(bits) < 3:
            raise HeKeyError(
                "the weighted average needs one multiplication: at least 3 coefficient "
                f"moduli (data, one rescaling prime, special), got {list(bits)}"
            )
        if any(b != self.scale_bits for b in bits[1:-1]):
            raise HeKeyError(
                f"the rescaling primes {list(bits[1:-1])} must equal the scale "
                f"({self.scale_bits} bits), or rescaling drifts the scale"
            )
        if bits[0] < self.scale_bits + 10:
            raise HeKeyError(
                f"the first modulus ({bits[0]} bits) must exceed the scale "
                f"({self.scale_bits} bits) by >= 10 bits to hold the values' integer part"
            )

    @property
    def slots(self) -> int:
        return self.poly_modulus_degree // 2


def generate_keys(params: HeParams | None = None) -> ts.Context:
    """A fresh secret CKKS context (a silo's); `public_context` derives the server's."""
    params = params or HeParams()
    params.check()
    context = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
    )
    context.global_scale = 2.0**params.scale_bits
    return context


def _public_bytes(context: ts.Context) -> bytes:
    data: bytes = context.serialize(
        save_public_key=True,
        save_secret_key=False,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    return data


def public_context(context: ts.Context) -> ts.Context:
    """The same keys without the secret key (what the server holds)."""
    return ts.context_from(_public_bytes(context))


def fingerprint(context: ts.Context) -> str:
    """SHA-256 of the public part (parameters and public key): the same for a silo's
    secret context and the server's public one made from it."""
    return hashlib.sha256(_public_bytes(context)).hexdigest()[:32]


@dataclass(frozen=True)
class ContextInfo:
    """What a context file holds, as far as TenSEAL shows it."""

    poly_modulus_degree: int
    total_bits: int  # all coefficient moduli, the special prime included
    depth: int  # multiplications a fresh ciphertext can take
    scale_bits: float


def context_info(context: ts.Context) -> ContextInfo:
    seal = context.seal_context().data
    key_level = seal.key_context_data()
    return ContextInfo(
        poly_modulus_degree=key_level.parms().poly_modulus_degree(),
        total_bits=key_level.total_coeff_modulus_bit_count(),
        depth=seal.first_context_data().chain_index(),
        scale_bits=math.log2(context.global_scale),
    )


@dataclass(frozen=True)
class KeyFiles:
    secret: Path
    public: Path
    fingerprint: str


def write_keys(out: Path, params: HeParams | None = None, overwrite: bool = False) -> KeyFiles:
    """silo.context (secret: give to every silo, never to the server), server.context
    (public) and fingerprint.txt in `out`. Existing key files are kept unless `overwrite`:
    replacing them would lock the silos out of a running federation's model."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / SECRET_FILE, out / PUBLIC_FILE, out / FINGERPRINT_FILE]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise HeKeyError(
            f"{', '.join(existing)} already exist; a new key would make models encrypted "
            "under the old one unreadable. Choose another folder or pass --overwrite"
        )
    context = generate_keys(params)
    secret = context.serialize(
        save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
    )
    paths[0].write_bytes(secret)
    paths[0].chmod(0o600)  # the secret key: readable by its owner only
    paths[1].write_bytes(_public_bytes(context))
    print_ = fingerprint(context)
    paths[2].write_text(print_ + "\n")
    return KeyFiles(paths[0], paths[1], print_)


def load_context(
    path: str | Path, role: Role, expected_fingerprint: str | None = None
) -> ts.Context:
    """A context file checked for its role: a silo's must hold the secret key, the
    server's must not (the server never holds one). `expected_fingerprint`, when given,
    must match. Every refusal names the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise HeKeyError(f"{path}: cannot read the HE context: {error.strerror}") from error
    try:
        context = ts.context_from(data)
    except Exception as error:  # TenSEAL raises ValueError or RuntimeError on bad bytes
        raise HeKeyError(
            f"{path}: not a TenSEAL context ({error}); make one with `fedlb keygen`"
        ) from error
    return check_context(context, role, str(path), expected_fingerprint)


def check_context(
    context: ts.Context, role: Role, name: str, expected_fingerprint: str | None = None
) -> ts.Context:
    """The checks of `load_context` on a context already in memory (`name` for errors)."""
    try:
        info = context_info(context)
    except Exception as error:  # a BFV context, or one TenSEAL cannot describe
        raise HeKeyError(f"{name}: not a CKKS context ({error})") from error
    limit = MAX_BITS_128.get(info.poly_modulus_degree, 0)
    if info.total_bits > limit or info.depth < 1:
        raise HeKeyError(
            f"{name}: degree {info.poly_modulus_degree} with {info.total_bits} modulus bits "
            f"and depth {info.depth}: fedlb needs 128-bit security (at most {limit} bits) and "
            "depth >= 1 (one multiplication); make keys with `fedlb keygen`"
        )
    if not context.has_public_key():
        raise HeKeyError(f"{name}: the context has no public key; make one with `fedlb keygen`")
    if role == "server" and context.is_private():
        raise HeKeyError(
            f"{name} holds a secret key: the server must never have it. Give the server "
            f"the public context ({PUBLIC_FILE}) and keep {SECRET_FILE} at the silos"
        )
    if role == "silo" and not context.is_private():
        raise HeKeyError(
            f"{name} has no secret key, so this silo could not decrypt the global model: "
            f"give silos {SECRET_FILE}, not {PUBLIC_FILE}"
        )
    if expected_fingerprint is not None and fingerprint(context) != expected_fingerprint:
        raise HeKeyError(
            f"{name}: key fingerprint {fingerprint(context)} does not match this run's "
            f"{expected_fingerprint}: the keys come from another `fedlb keygen`"
        )
    return context
