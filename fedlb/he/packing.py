"""Model arrays in and out of CKKS ciphertexts, and the encrypted weighted average.

All arrays are flattened into one vector (in a fixed key order) and cut into as few
ciphertexts as the slots allow. A `Layout` says how to put them back; it holds names,
shapes and dtypes (the model's architecture, shared by the whole federation anyway) and
the fingerprint of the key, never a key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tenseal as ts

from .keys import context_info, fingerprint


class CiphertextError(ValueError):
    """An encrypted update that cannot be used; the message says why."""


@dataclass(frozen=True)
class Layout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    slots: int
    fingerprint: str

    @property
    def total(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def count(self) -> int:
        """Ciphertexts needed."""
        return max(1, math.ceil(self.total / self.slots))

    def chunk_sizes(self) -> list[int]:
        sizes = [self.slots] * (self.count - 1)
        return [*sizes, self.total - self.slots * (self.count - 1)]

    def to_json(self) -> str:
        return json.dumps(
            {
                "names": self.names,
                "shapes": self.shapes,
                "dtypes": self.dtypes,
                "slots": self.slots,
                "fingerprint": self.fingerprint,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        try:
            raw = json.loads(text)
            layout = cls(
                names=tuple(str(n) for n in raw["names"]),
                shapes=tuple(tuple(int(d) for d in s) for s in raw["shapes"]),
                dtypes=tuple(str(d) for d in raw["dtypes"]),
                slots=int(raw["slots"]),
                fingerprint=str(raw["fingerprint"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CiphertextError(
                f"the layout of the encrypted arrays is unreadable: {error}"
            ) from error
        if not len(layout.names) == len(layout.shapes) == len(layout.dtypes) or layout.slots < 1:
            raise CiphertextError("the layout of the encrypted arrays is inconsistent")
        if any(d < 0 for s in layout.shapes for d in s):
            raise CiphertextError("the layout of the encrypted arrays has negative sizes")
        return layout


def layout_of(context: ts.Context, arrays: Mapping[str, np.ndarray]) -> Layout:
    return Layout(
        names=tuple(arrays),
        shapes=tuple(tuple(int(d) for d in a.shape) for a in arrays.values()),
        dtypes=tuple(str(a.dtype) for a in arrays.values()),
        slots=context_info(context).poly_modulus_degree // 2,
        fingerprint=fingerprint(context),
    )


def encrypt_arrays(
    context: ts.Context, arrays: Mapping[str, np.ndarray]
) -> tuple[list[bytes], Layout]:
    """The arrays packed into ciphertexts (serialised, no context or key inside)."""
    layout = layout_of(context, arrays)
    flat = (
        np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays.values()])
        if arrays
        else np.zeros(0)
    )
    return [
        ts.ckks_vector(context, flat[k * layout.slots : k * layout.slots + size]).serialize()
        for k, size in enumerate(layout.chunk_sizes())
    ], layout


def load_ciphertexts(
    context: ts.Context, ciphertexts: Sequence[bytes], layout: Layout
) -> list[ts.CKKSVector]:
    """Ciphertexts checked against the run: the key's fingerprint, their number, slots
    used, and that each is a fresh two-part ciphertext at the top level and scale (what
    one multiplication needs). Raises CiphertextError saying what is wrong."""
    if layout.fingerprint != fingerprint(context):
        raise CiphertextError(
            f"encrypted under another key (fingerprint {layout.fingerprint[:12]}…, the "
            f"run's is {fingerprint(context)[:12]}…)"
        )
    if len(ciphertexts) != layout.count:
        raise CiphertextError(f"{len(ciphertexts)} ciphertexts, the layout needs {layout.count}")
    top = context.seal_context().data.first_context_data()
    vectors = []
    for k, (data, size) in enumerate(zip(ciphertexts, layout.chunk_sizes(), strict=True)):
        try:
            vector = ts.ckks_vector_from(context, data)
            parts = vector.data.ciphertext()
        except Exception as error:  # TenSEAL raises ValueError/RuntimeError on bad bytes
            raise CiphertextError(f"ciphertext {k} cannot be read: {error}") from error
        if vector.size() != size or len(parts) != 1:
            raise CiphertextError(f"ciphertext {k} holds {vector.size()} values, not {size}")
        part = parts[0]
        if (
            part.size() != 2
            or part.is_transparent()
            or part.parms_id() != top.parms_id()
            or not math.isclose(part.scale, context.global_scale, rel_tol=1e-9)
        ):
            raise CiphertextError(
                f"ciphertext {k} is not a fresh ciphertext of this run's parameters "
                "(level, scale or size differ)"
            )
        vectors.append(vector)
    return vectors


def decrypt_arrays(
    context: ts.Context, ciphertexts: Sequence[bytes], layout: Layout
) -> dict[str, np.ndarray]:
    """The arrays back from ciphertexts (the context must hold the secret key)."""
    try:
        vectors = [ts.ckks_vector_from(context, data) for data in ciphertexts]
    except Exception as error:  # TenSEAL raises ValueError/RuntimeError on damaged bytes
        raise CiphertextError(f"a ciphertext cannot be read (damaged?): {error}") from error
    if len(vectors) != layout.count:
        raise CiphertextError(f"{len(vectors)} ciphertexts, the layout needs {layout.count}")
    flat = np.concatenate([np.asarray(v.decrypt(), dtype=np.float64) for v in vectors])
    if flat.size != layout.total:
        raise CiphertextError(f"{flat.size} values decrypted, the layout needs {layout.total}")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
        size = math.prod(shape)
        values = flat[offset : offset + size].reshape(shape)
        if np.issubdtype(np.dtype(dtype), np.integer):
            values = np.rint(values)  # counters (e.g. batch-norm's) survive the round trip
        arrays[name] = values.astype(dtype)
        offset += size
    return arrays


def weighted_sum(
    updates: Sequence[Sequence[ts.CKKSVector]], weights: Sequence[float]
) -> list[bytes]:
    """Σ_k weights[k] · update_k on ciphertexts (one plaintext multiplication each, then
    additions), serialised. The caller normalises the weights."""
    if not updates or len(updates) != len(weights):
        raise ValueError("weighted_sum needs one weight per update and at least one update")
    total = [vector * float(weights[0]) for vector in updates[0]]
    for update, weight in zip(updates[1:], weights[1:], strict=True):
        for k, vector in enumerate(update):
            total[k] += vector * float(weight)
    return [vector.serialize() for vector in total]
