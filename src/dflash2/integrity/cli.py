"""``dflash2 verify | fetch | manifest | keygen``."""

from __future__ import annotations

from pathlib import Path


def add_integrity_parsers(sub) -> None:
    p = sub.add_parser("verify", help="check a checkpoint folder against a (signed) manifest")
    p.add_argument("dir")
    p.add_argument("manifest")
    p.add_argument("--signature")
    p.add_argument("--public-key")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("fetch", help="download the files of a manifest, resuming, from the first source that works")
    p.add_argument("manifest")
    p.add_argument("--dir", required=True)
    p.add_argument("--source", action="append", required=True)
    p.add_argument("--signature")
    p.add_argument("--public-key")
    p.set_defaults(fn=cmd_fetch)
    p = sub.add_parser("manifest", help="write a manifest (and its minisign signature) for a folder")
    p.add_argument("dir")
    p.add_argument("--output", required=True)
    p.add_argument("--secret-key")
    p.set_defaults(fn=cmd_manifest)
    p = sub.add_parser("keygen", help="make an unencrypted minisign key pair")
    p.add_argument("--secret-key", required=True)
    p.add_argument("--public-key", required=True)
    p.set_defaults(fn=cmd_keygen)


def _refusing(fn):
    """Every refusal is one line and exit 1, never a traceback."""

    def run(args) -> int:
        from .manifest import ManifestError, SourceError
        from .minisign import SignatureError

        try:
            return fn(args)
        except (ManifestError, SignatureError, SourceError, OSError, ValueError, UnicodeError) as e:
            print(f"REJECTED: {e}")
            return 1

    return run


@_refusing
def cmd_verify(args) -> int:
    from .manifest import verify_folder

    return 0 if verify_folder(args.dir, args.manifest, args.signature, args.public_key) else 1


@_refusing
def cmd_fetch(args) -> int:
    from .manifest import fetch, read_manifest
    from .minisign import SignatureError

    if args.signature or args.public_key:
        try:
            read_manifest(args.manifest, args.signature, args.public_key)
        except (SignatureError, ValueError) as e:
            print(f"REJECTED manifest {args.manifest}: {e}")
            return 1
    else:
        read_manifest(args.manifest)
    ok = fetch(args.manifest, args.dir, args.source)
    print("verdict: all files fetched" if ok else "verdict: FAILED (see the FAIL lines)")
    return 0 if ok else 1


def cmd_manifest(args) -> int:
    from .manifest import write_manifest

    sig = write_manifest(args.dir, args.output, args.secret_key)
    print(f"wrote {args.output}" + (f" and {sig}" if sig else ""))
    return 0


def cmd_keygen(args) -> int:
    from .minisign import SecretKey, public_key_text

    sk = SecretKey.generate()
    Path(args.secret_key).write_text(sk.dump())
    Path(args.public_key).write_text(public_key_text(sk.public()))
    print(f"wrote {args.secret_key} and {args.public_key}")
    return 0
