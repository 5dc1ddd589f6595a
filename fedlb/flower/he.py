"""CKKS on Flower's wire: encrypted ArrayRecords, the silo's encryption mod, and the
server's encrypted weighted average.

An encrypted ArrayRecord holds `ckks/layout` (JSON: names, shapes, dtypes, slots, the
key's fingerprint) and `ckks/0`, `ckks/1`, ... (serialised ciphertexts), all as uint8
arrays so Flower chunks them like any model. No context or key ever travels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedlb.security import (
    DigestError,
    StoredFileError,
    check_digest,
    check_seal,
    open_stored,
    seal_zip,
)

from .protocol import NODE_HE_CONTEXT, add_he_seconds

# fedlb.he (and TenSEAL, ~0.5 s of imports) is loaded only where a key or a ciphertext is
# at hand: Flower starts a fresh ClientApp process per message, and a plaintext
# federation should not pay for it.
if TYPE_CHECKING:
    from collections.abc import Callable

    import tenseal as ts

    from fedlb.he import Layout

    # A ClientApp's call chain and a mod, as the public `ClientApp(mods=...)` spells them
    ClientAppCallable = Callable[[Message, Context], Message]
    Mod = Callable[[Message, Context, ClientAppCallable], Message]

log = logging.getLogger("fedlb.flower")

LAYOUT_KEY = "ckks/layout"


def is_encrypted(record: ArrayRecord) -> bool:
    return LAYOUT_KEY in record


def encrypted_record(ciphertexts: Sequence[bytes], layout: Layout) -> ArrayRecord:
    """The ciphertexts and their layout as one ArrayRecord of uint8 arrays."""
    arrays = OrderedDict([(LAYOUT_KEY, Array(np.frombuffer(layout.to_json().encode(), np.uint8)))])
    for k, data in enumerate(ciphertexts):
        arrays[f"ckks/{k}"] = Array(np.frombuffer(data, np.uint8))
    return ArrayRecord(arrays)


def read_layout(record: ArrayRecord) -> Layout:
    """The layout of an encrypted record, without copying its ciphertexts."""
    from fedlb.he import CiphertextError, Layout

    if LAYOUT_KEY not in record:
        raise CiphertextError("the arrays are not encrypted (no ckks/layout)")
    try:
        return Layout.from_json(record[LAYOUT_KEY].numpy().tobytes())
    except CiphertextError:
        raise
    except Exception as error:  # a corrupt Array payload
        raise CiphertextError(f"the encrypted layout cannot be decoded: {error}") from error


def read_encrypted(record: ArrayRecord) -> tuple[list[bytes], Layout]:
    """(ciphertexts, layout) of an encrypted record; CiphertextError if it is not one."""
    from fedlb.he import CiphertextError

    layout = read_layout(record)
    try:
        keys = [f"ckks/{k}" for k in range(layout.count)]
        if set(record.keys()) != {LAYOUT_KEY, *keys}:
            raise CiphertextError(
                f"expected ciphertexts ckks/0..{layout.count - 1}, got {sorted(record.keys())}"
            )
        return [record[key].numpy().tobytes() for key in keys], layout
    except CiphertextError:
        raise
    except Exception as error:  # a corrupt Array payload
        raise CiphertextError(f"the encrypted arrays cannot be decoded: {error}") from error


INNER_DIGEST = "__sha256__"  # the arrays' digest, inside the .npz (older fedlb checks it)


def _arrays_digest(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """sha256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return np.frombuffer(digest.digest(), dtype=np.uint8)


def save_encrypted(record: ArrayRecord, path: Path) -> Path:
    """An encrypted model to an .npz of its uint8 arrays (no key inside), sealed with the
    digest of the whole file at its end (`fedlb.security.seal_zip`): a copy that lost its
    side files is still checked, every byte of it. Written to a temporary file first and
    renamed, so an earlier model at `path` is replaced only by a whole new one."""
    read_encrypted(record)  # refuses anything that is not one
    arrays = {k: a.numpy() for k, a in record.items()}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w+b") as handle:
            np.savez(handle, **arrays, **{INNER_DIGEST: _arrays_digest(arrays)})  # type: ignore[arg-type]
            seal_zip(handle)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def load_encrypted(path: Path, unchecked: bool = False) -> ArrayRecord:
    """What `save_encrypted` wrote; CiphertextError, one line naming the file, if it is not
    an encrypted model, is damaged (its sealed digest, the .sha256 beside it, or the arrays'
    digest inside it does not match; cut short; bytes added), or cannot be checked at all
    unless `unchecked`: one flipped bit in a ciphertext decrypts, without a word, to
    weights off by 10^7. A file sealed by fedlb is checked whole before it is read. One
    written before fedlb sealed its files is checked on its arrays' digest (every byte
    that decrypts; its zip headers only by a .sha256 beside it), one with neither digest
    (older still) only by its .sha256, or not at all with `unchecked`."""
    from fedlb.he import CiphertextError

    try:
        beside = check_digest(path)
        try:
            sealed = check_seal(path)
        except DigestError as error:
            raise DigestError(f"{error}. Use an intact copy") from error
        with open_stored(path) as handle, np.load(handle, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (DigestError, StoredFileError) as error:  # StoredFileError: a FIFO, a device
        raise CiphertextError(str(error)) from error
    except Exception as error:  # zip, header and pickle errors alike: a damaged file
        raise CiphertextError(
            f"{path}: not an encrypted model file, or a damaged one "
            f"({type(error).__name__}: {error})"
        ) from error
    inner = arrays.pop(INNER_DIGEST, None)
    if inner is not None and not np.array_equal(inner, _arrays_digest(arrays)):
        raise CiphertextError(
            f"{path} does not match the digest written inside it: the file was damaged or "
            "changed after fedlb wrote it. Use an intact copy"
        )
    if not sealed and inner is None and not beside and not unchecked:
        raise CiphertextError(
            f"{path} carries no digest and has none beside it ({path.name}.sha256): its "
            "integrity cannot be checked. Restore the .sha256 file, or decrypt it unchecked "
            "(--unchecked) if you trust this copy"
        )
    record = ArrayRecord(OrderedDict((k, Array(arrays[k])) for k in arrays))
    read_encrypted(record)
    return record


def encrypt_record(context: ts.Context, record: ArrayRecord) -> ArrayRecord:
    from fedlb.he import encrypt_arrays

    ciphertexts, layout = encrypt_arrays(context, {k: a.numpy() for k, a in record.items()})
    return encrypted_record(ciphertexts, layout)


def decrypt_record(context: ts.Context, record: ArrayRecord) -> ArrayRecord:
    from fedlb.he import HeKeyError, decrypt_arrays, fingerprint

    ciphertexts, layout = read_encrypted(record)
    if layout.fingerprint != fingerprint(context):
        raise HeKeyError(
            f"the model is encrypted under key {layout.fingerprint[:12]}…, this silo's key "
            f"is {fingerprint(context)[:12]}…: the silo and the server use keys of "
            "different `fedlb keygen` runs"
        )
    arrays = decrypt_arrays(context, ciphertexts, layout)
    return ArrayRecord(OrderedDict((k, Array(v)) for k, v in arrays.items()))


@functools.lru_cache(maxsize=4)
def _silo_context(path: str) -> ts.Context:
    from fedlb.he import load_context

    return load_context(path, "silo")


@functools.lru_cache(maxsize=4)
def _context_from_bytes(data: bytes) -> ts.Context:
    import tenseal

    from fedlb.he import check_context

    return check_context(tenseal.context_from(data), "silo", "the silo's HE context")


def he_mod(context: ts.Context | None = None) -> Mod:
    """A Flower mod for any ClientApp: decrypts the incoming global model, and encrypts
    the reply's arrays. The secret context is `context`, or the file named by the node
    config's `he-context`; with neither, messages pass through untouched. A silo with a
    key refuses a plaintext model (it would otherwise send its update in the clear).

    The seconds spent decrypting, encrypting and serialising are a fixed per-round cost of
    the silo, so the balancer accounts for them: `balance_mod()` listed before this mod
    times them as part of the handler; listed after it, this mod adds them to its report.
    They are reported as `fedlb.he-s` either way."""
    # Kept serialised: a simulation ships the ClientApp, mods included, to Ray actors by
    # pickling, and TenSEAL contexts do not pickle. Each process deserialises it once.
    secret_bytes = (
        None
        if context is None
        else context.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
    )

    def mod(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
        path = ctx.node_config.get(NODE_HE_CONTEXT)
        if secret_bytes is not None:
            secret = _context_from_bytes(secret_bytes)
        else:
            secret = _silo_context(str(path)) if path else None
        records = msg.content.array_records
        incoming = next(iter(records.values())) if records else None
        encrypted = incoming is not None and is_encrypted(incoming)
        if secret is None and not encrypted:
            return call_next(msg, ctx)
        from fedlb.he import HeKeyError

        if secret is None:
            raise HeKeyError(
                "the server sends an encrypted model but this silo has no HE key: start "
                f"it with --he-context silo.context (node config {NODE_HE_CONTEXT})"
            )
        if incoming is not None and not encrypted:
            raise HeKeyError(
                "this silo has an HE key but the server sent a plaintext model; refusing to "
                "send an unencrypted update: start the server with --he-context server.context"
            )
        he_s = 0.0
        if incoming is not None:
            start = time.perf_counter()
            content = RecordDict(
                {
                    **{k: v for k, v in msg.content.items() if k not in records},
                    **{k: decrypt_record(secret, v) for k, v in records.items()},
                }
            )
            msg.content = content
            he_s += time.perf_counter() - start
        reply = call_next(msg, ctx)
        if reply.has_error() or not reply.has_content():
            return reply
        start = time.perf_counter()
        out_records = reply.content.array_records
        encrypted_out = {k: encrypt_record(secret, v) for k, v in out_records.items()}
        he_s += time.perf_counter() - start
        content = RecordDict({**dict(reply.content.items()), **encrypted_out})
        for metrics in content.metric_records.values():
            add_he_seconds(metrics, he_s)
        reply.content = content
        return reply

    return mod


class EncryptedModel(ArrayRecord):
    """The global model of a run under HE, as `LoadBalancedFedAvg.start` returns it: CKKS
    ciphertexts that only a silo's secret key opens. Reading it as plaintext raises
    instead of giving bytes that look like a model: save it with `save_encrypted(model,
    path)` and decrypt it at a silo (`fedlb decrypt MODEL --context silo.context`, or
    `decrypt_record`)."""

    def __init__(self, record: ArrayRecord) -> None:
        read_encrypted(record)  # refuses anything that is not one
        super().__init__(OrderedDict(record.items()))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "the global model is CKKS-encrypted: the server holds no key to read it. Save "
            "it with fedlb.flower.save_encrypted(result.arrays, Path('model.ckks.npz')) and "
            "decrypt it at a silo: `fedlb decrypt model.ckks.npz --context silo.context`"
        )

    to_torch_state_dict = _refuse
    to_numpy_ndarrays = _refuse


class EncryptedAggregation:
    """The server's side: holds only a public context (checked: no secret key), encrypts
    the initial model, checks replies' ciphertexts, and averages them under encryption."""

    def __init__(self, context: ts.Context) -> None:
        from fedlb.he import check_context, fingerprint

        self.context = check_context(context, "server", "the server's HE context")
        self.fingerprint = fingerprint(context)

    @classmethod
    def from_file(cls, path: str) -> EncryptedAggregation:
        """The server's aggregation from a public context file (`fedlb keygen`'s
        server.context); a context holding a secret key is refused (HeKeyError).

        Args:
            path: the server's context file.

        Example:
            ```python
            from fedlb.flower import EncryptedAggregation, LoadBalancedFedAvg

            strategy = LoadBalancedFedAvg(
                fraction_evaluate=0.0,
                he=EncryptedAggregation.from_file("keys/server.context"),
            )
            ```
        """
        from fedlb.he import load_context

        return cls(load_context(path, "server"))

    def encrypt(self, record: ArrayRecord) -> ArrayRecord:
        return record if is_encrypted(record) else encrypt_record(self.context, record)

    def check(self, record: ArrayRecord, like: ArrayRecord) -> list[Any]:
        """The reply's ciphertexts, loaded and checked against the run's key and the global
        model's layout; CiphertextError says what is wrong."""
        from fedlb.he import CiphertextError, load_ciphertexts

        ciphertexts, layout = read_encrypted(record)
        expected = read_layout(like)
        if (layout.names, layout.shapes, layout.dtypes) != (
            expected.names,
            expected.shapes,
            expected.dtypes,
        ):
            raise CiphertextError("its encrypted arrays do not have the global model's layout")
        return load_ciphertexts(self.context, ciphertexts, layout)

    def average(
        self, updates: Sequence[list[Any]], weights: Sequence[float], like: ArrayRecord
    ) -> ArrayRecord:
        from fedlb.he import weighted_sum

        total = float(sum(weights))
        ciphertexts = weighted_sum(updates, [w / total for w in weights])
        return encrypted_record(ciphertexts, read_layout(like))
