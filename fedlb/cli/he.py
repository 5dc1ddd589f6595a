"""`fedlb keygen` and `fedlb decrypt`: CKKS keys for a federation, and opening the
encrypted global model at a silo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedlb._markup import plain

from .common import UsageError, app, console


@app.command()
def keygen(
    out: Annotated[Path, typer.Option(help="Folder for the key files.")],
    poly_modulus_degree: Annotated[
        int, typer.Option(help="CKKS ring degree N (N/2 values per ciphertext).")
    ] = 8192,
    coeff_bits: Annotated[
        str, typer.Option(help="Coefficient moduli in bits: data, rescaling prime(s), special.")
    ] = "60,40,60",
    scale_bits: Annotated[int, typer.Option(help="Scale 2^bits (the rescaling primes').")] = 40,
    overwrite: Annotated[bool, typer.Option(help="Replace existing key files.")] = False,
) -> None:
    """Make CKKS keys: silo.context (secret key: give it to every silo, never to the
    server), server.context (public: the server's), and fingerprint.txt. Defaults give
    128-bit security and the one multiplication the weighted average needs (the docs:
    Explanation, Encrypted updates)."""
    from fedlb.he import HeKeyError, HeParams, context_info, load_context, write_keys

    try:
        bits = tuple(int(b) for b in coeff_bits.split(","))
    except ValueError as error:
        raise UsageError(
            f"--coeff-bits must be numbers like 60,40,60, got {coeff_bits!r}"
        ) from error
    try:
        files = write_keys(out, HeParams(poly_modulus_degree, bits, scale_bits), overwrite)
    except HeKeyError as error:
        raise UsageError(str(error)) from error
    info = context_info(load_context(files.public, "server"))
    console.print(
        f"CKKS keys (degree {info.poly_modulus_degree}, {info.total_bits} modulus bits, "
        f"depth {info.depth}, scale 2^{info.scale_bits:g}; fingerprint {files.fingerprint}):\n"
        f"  {plain(files.secret)}  secret: every silo (--he-context), never the server\n"
        f"  {plain(files.public)}  public: the server (--he-context)"
    )


@app.command()
def decrypt(
    model: Annotated[Path, typer.Argument(help="The encrypted model (model.ckks.npz).")],
    context: Annotated[Path, typer.Option(help="The silos' secret context (silo.context).")],
    out: Annotated[Path, typer.Option(help="Where to write the PyTorch state_dict.")] = Path(
        "model.pt"
    ),
    unchecked: Annotated[
        bool,
        typer.Option(
            "--unchecked",
            help="Decrypt a model that carries no digest (written by an older fedlb) and has "
            "none beside it: its integrity is then not checked.",
        ),
    ] = False,
) -> None:
    """Decrypt the federation's final model (a silo's job: it holds the secret key)."""
    import torch

    from fedlb.flower import decrypt_record, load_encrypted
    from fedlb.he import CiphertextError, HeKeyError, load_context

    try:
        secret = load_context(context, "silo")
        record = decrypt_record(secret, load_encrypted(model, unchecked=unchecked))
    except (HeKeyError, CiphertextError) as error:
        raise UsageError(str(error)) from error
    torch.save(record.to_torch_state_dict(), out)
    console.print(f"decrypted {plain(model)} into {plain(out)} ({len(record)} arrays)")
