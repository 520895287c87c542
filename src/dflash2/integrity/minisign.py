"""minisign keys and signatures (Ed25519 through ``cryptography``), in minisign's file formats.

Public key: ``untrusted comment`` line + base64(``Ed`` | key_id[8] | pk[32]).
Signature (.minisig): untrusted comment, base64(``ED`` | key_id | Ed25519(BLAKE2b-512(file))),
``trusted comment: ...``, base64(Ed25519(signature | trusted comment)).
Secret key: minisign's layout; only unencrypted keys (``minisign -W``) are read and written.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat


class SignatureError(ValueError):
    pass


@dataclass
class PublicKey:
    key_id: bytes
    key: Ed25519PublicKey

    @classmethod
    def parse(cls, text: str) -> "PublicKey":
        lines = [l for l in text.strip().splitlines() if l.strip()]
        raw = _b64(lines[-1], "public key")
        if len(raw) != 42 or raw[:2] != b"Ed":
            raise SignatureError("public key: not a minisign Ed25519 public key")
        return cls(raw[2:10], Ed25519PublicKey.from_public_bytes(raw[10:]))

    @classmethod
    def load(cls, path_or_b64: str | Path) -> "PublicKey":
        p = Path(path_or_b64)
        return cls.parse(p.read_text() if p.is_file() else str(path_or_b64))


@dataclass
class SecretKey:
    key_id: bytes
    key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "SecretKey":
        return cls(os.urandom(8), Ed25519PrivateKey.generate())

    def public(self) -> PublicKey:
        return PublicKey(self.key_id, self.key.public_key())

    def _sk64(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        seed = self.key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return seed + self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def dump(self) -> str:
        sk = self._sk64()
        checksum = hashlib.blake2b(b"Ed" + self.key_id + sk, digest_size=32).digest()
        raw = b"Ed" + b"\x00\x00" + b"B2" + bytes(32) + struct.pack("<QQ", 0, 0) + self.key_id + sk + checksum
        return f"untrusted comment: minisign secret key {self.key_id[::-1].hex().upper()}\n{base64.b64encode(raw).decode()}\n"

    @classmethod
    def parse(cls, text: str) -> "SecretKey":
        lines = [l for l in text.strip().splitlines() if l.strip()]
        raw = _b64(lines[-1], "secret key")
        if len(raw) != 158 or raw[:2] != b"Ed":
            raise SignatureError("secret key: not a minisign Ed25519 secret key")
        if raw[2:4] != b"\x00\x00":
            raise SignatureError(
                "secret key: password-encrypted keys are not supported; remove the password with `minisign -C -W` first"
            )
        key_id, sk, checksum = raw[54:62], raw[62:126], raw[126:158]
        if hashlib.blake2b(b"Ed" + key_id + sk, digest_size=32).digest() != checksum:
            raise SignatureError("secret key: checksum mismatch (corrupt key file)")
        return cls(key_id, Ed25519PrivateKey.from_private_bytes(sk[:32]))


def public_key_text(pk: PublicKey) -> str:
    raw = b"Ed" + pk.key_id + pk.key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return f"untrusted comment: minisign public key {pk.key_id[::-1].hex().upper()}\n{base64.b64encode(raw).decode()}\n"


def sign(
    data: bytes, sk: SecretKey, trusted_comment: str = "", untrusted_comment: str = "signature from dflash2"
) -> str:
    sig = sk.key.sign(hashlib.blake2b(data, digest_size=64).digest())
    global_sig = sk.key.sign(sig + trusted_comment.encode())
    return (
        f"untrusted comment: {untrusted_comment}\n{base64.b64encode(b'ED' + sk.key_id + sig).decode()}\n"
        f"trusted comment: {trusted_comment}\n{base64.b64encode(global_sig).decode()}\n"
    )


def verify(data: bytes, signature_text: str, pk: PublicKey) -> str:
    """Raises :class:`SignatureError`; returns the trusted comment when the signature holds."""
    lines = signature_text.splitlines()
    if len(lines) < 4 or not lines[2].startswith("trusted comment: "):
        raise SignatureError("signature: not a minisign signature file (4 lines expected)")
    raw = _b64(lines[1], "signature")
    if len(raw) != 74 or raw[:2] not in (b"ED", b"Ed"):
        raise SignatureError("signature: unknown algorithm or wrong length")
    if raw[2:10] != pk.key_id:
        raise SignatureError(
            f"signature: made by key {raw[2:10][::-1].hex().upper()}, "
            f"not by the given public key {pk.key_id[::-1].hex().upper()}"
        )
    message = hashlib.blake2b(data, digest_size=64).digest() if raw[:2] == b"ED" else data
    try:
        pk.key.verify(raw[10:], message)
    except InvalidSignature:
        raise SignatureError("signature: does not match the signed file (file or signature altered)") from None
    trusted = lines[2][len("trusted comment: ") :]
    try:
        pk.key.verify(_b64(lines[3], "global signature"), raw[10:] + trusted.encode())
    except InvalidSignature:
        raise SignatureError("signature: trusted comment or global signature altered") from None
    return trusted


def _b64(s: str, what: str) -> bytes:
    try:
        return base64.b64decode(s.strip(), validate=True)
    except Exception:
        raise SignatureError(f"{what}: invalid base64") from None
