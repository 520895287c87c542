"""Checkpoint manifests (sizes + sha256 per file), their signatures, verification and a
resumable multi-source fetch that never leaves a half-written file under its final name."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .minisign import PublicKey, SecretKey, SignatureError, sign, verify

CHUNK = 1 << 20


class ManifestError(ValueError):
    pass


@dataclass
class FileEntry:
    path: str
    size: int
    sha256: str


def sha256_file(path: Path, progress: bool = True) -> str:
    h = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc=path.name, disable=not progress, leave=False
        ) as bar,
    ):
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def build_manifest(folder: str | Path) -> dict:
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    return {
        "version": 1,
        "files": [
            {"path": str(p.relative_to(folder)), "size": p.stat().st_size, "sha256": sha256_file(p)} for p in files
        ],
    }


def write_manifest(folder, output, secret_key: str | Path | None = None) -> Path | None:
    text = json.dumps(build_manifest(folder), indent=2) + "\n"
    Path(output).write_text(text)
    if secret_key is None:
        return None
    sk = SecretKey.parse(Path(secret_key).read_text())
    sig_path = Path(str(output) + ".minisig")
    sig_path.write_text(
        sign(text.encode(), sk, trusted_comment=f"timestamp:{int(time.time())}\tfile:{Path(output).name}")
    )
    return sig_path


# files a loader may read (weights, shard indexes, configs, token maps): an unlisted one is refused
LOADABLE_SUFFIXES = (".safetensors", ".json", ".pt", ".pth", ".bin", ".gguf", ".npy", ".npz")
READ_TIMEOUT_S = 30.0  # one read of a source
SOURCE_DEADLINE_S = 600.0  # all attempts at one file from one source


class SourceError(Exception):
    """A source that broke off, timed out, sent too much or answered something malformed."""


def _check_entry_path(manifest, raw_path) -> str:
    if not isinstance(raw_path, str) or not raw_path:
        raise ManifestError(f"{manifest}: entry path {raw_path!r} is not a file name")
    parts = raw_path.split("/")
    if (
        raw_path.startswith("/")
        or "\\" in raw_path
        or ":" in raw_path
        or any(part in ("", ".", "..") for part in parts)
        or "\x00" in raw_path
    ):
        raise ManifestError(f"{manifest}: unsafe path {raw_path!r} (a relative path of plain names is required)")
    return raw_path


def read_manifest(
    path: str | Path, signature: str | Path | None = None, public_key: str | Path | None = None
) -> list[FileEntry]:
    """Parse a manifest; when a signature is given it is checked before anything else is read."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    if signature is not None or public_key is not None:
        if signature is None or public_key is None:
            raise ManifestError("--signature and --public-key go together")
        try:
            sig_text = Path(signature).read_text()
            key = PublicKey.load(public_key)
        except (OSError, UnicodeDecodeError) as e:
            raise ManifestError(f"cannot read the signature or public key ({e})") from None
        verify(data, sig_text, key)
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), list):
            raise ValueError("no 'files' list")
        entries = []
        for f in raw["files"]:
            size, digest = f["size"], str(f["sha256"]).lower()
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"size {size!r} is not a byte count")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"sha256 {digest!r} is not 64 hex digits")
            entries.append(FileEntry(_check_entry_path(path, f["path"]), size, digest))
    except ManifestError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path}: not a valid manifest ({e})") from None
    if len({e.path for e in entries}) != len(entries):
        raise ManifestError(f"{path}: a path is listed twice")
    return entries


def _inside(folder: Path, rel: str) -> Path:
    """``folder / rel``, refused when any part of it below ``folder`` is a symlink (nothing is
    read or written through a link an attacker left in the folder)."""
    p = folder
    for part in rel.split("/"):
        p = p / part
        if p.is_symlink():
            raise ManifestError(f"{folder / rel}: {p} is a symlink; refused")
    return p


def check_file(folder: Path, e: FileEntry, progress: bool = True) -> str | None:
    """None when the file matches, else why not."""
    try:
        p = _inside(folder, e.path)
    except ManifestError:
        return "a symlink (refused)"
    if not p.is_file():
        return "missing"
    if p.stat().st_size != e.size:
        return f"size {p.stat().st_size} != {e.size}"
    digest = sha256_file(p, progress)
    return None if digest == e.sha256 else f"sha256 {digest[:16]}... != {e.sha256[:16]}..."


def unlisted_loadable(folder: Path, entries: list[FileEntry], manifest: str | Path | None = None) -> list[str]:
    """Files in ``folder`` a loader could read that the manifest does not list."""
    listed = {e.path for e in entries}
    skip = {Path(manifest).resolve()} if manifest is not None else set()
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if rel in listed or p.resolve() in skip or not (p.is_file() or p.is_symlink()):
            continue
        if p.suffix.lower() in LOADABLE_SUFFIXES or p.name.startswith("model.safetensors"):
            out.append(rel)
    return out


def verify_folder(folder, manifest, signature=None, public_key=None, progress=True, out=print) -> bool:
    """Every listed file matches, and no unlisted weight, index, config or token-map file lies beside them."""
    try:
        entries = read_manifest(manifest, signature, public_key)
    except (SignatureError, ManifestError) as e:
        out(f"REJECTED manifest {manifest}: {e}")
        return False
    folder, ok = Path(folder), True
    if not folder.is_dir():
        out(f"REJECTED {folder}: not a folder")
        return False
    for e in entries:
        problem = check_file(folder, e, progress)
        out(
            f"{'ok  ' if problem is None else 'FAIL'} {e.path} ({e.size:,} bytes){'' if problem is None else ': ' + problem}"
        )
        ok &= problem is None
    for rel in unlisted_loadable(folder, entries, manifest):
        out(f"FAIL {rel}: not listed in the manifest (a loader could read it)")
        ok = False
    out(
        f"verdict: {'all ' + str(len(entries)) + ' files match' if ok else 'MISMATCH'}"
        f"{' (signature ok)' if signature and ok else ''}"
    )
    return ok


def _download(url: str, dest: Path, size: int, deadline: float) -> None:
    """Append to ``dest`` from its current length (HTTP Range, or a seek for file://), never past
    ``size`` bytes nor past ``deadline`` (time.monotonic). Raises SourceError on any failure."""
    have = dest.stat().st_size if dest.exists() else 0
    if have >= size:
        return

    def copy(read, f) -> None:
        left = size - have
        while left > 0:
            if time.monotonic() > deadline:
                raise SourceError(f"too slow: the {SOURCE_DEADLINE_S:.0f} s deadline for this source passed")
            chunk = read(min(CHUNK, left))
            if not chunk:
                return
            f.write(chunk)
            left -= len(chunk)
        if read(1):  # the source has more than the manifest says: it is not this file
            raise SourceError(f"sent more than the manifest's {size:,} bytes")

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        if url.startswith("file://"):
            with open(url[len("file://") :], "rb") as src, os.fdopen(os.open(dest, flags, 0o644), "ab") as f:
                src.seek(have)
                copy(src.read, f)
            return
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        with urllib.request.urlopen(req, timeout=READ_TIMEOUT_S) as resp:
            if have and resp.status != 206:  # the server ignored Range: start over
                dest.unlink()
                have = 0
            announced = resp.headers.get("Content-Length")
            if announced is not None and announced.isdigit() and int(announced) > size - have:
                raise SourceError(f"sent more than the manifest's {size:,} bytes (Content-Length {announced})")
            with os.fdopen(os.open(dest, flags, 0o644), "ab") as f:
                copy(resp.read1, f)  # read1: returns what has arrived, so the deadline is checked
    except SourceError:
        raise
    except Exception as e:  # URLError, HTTPError, IncompleteRead, timeouts, a malformed answer
        raise SourceError(f"{type(e).__name__}: {e}") from None


def fetch(
    manifest, folder, sources: list[str], attempts_per_source: int = 3, out=print, deadline_s: float = SOURCE_DEADLINE_S
) -> bool:
    entries = read_manifest(manifest)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    all_ok = True
    for e in entries:
        try:
            final = _inside(folder, e.path)
            partial = _inside(folder, e.path + ".partial")
            partial.parent.mkdir(parents=True, exist_ok=True)
            _inside(folder, e.path)  # a parent made just now is a real folder, checked again
        except (ManifestError, OSError) as err:
            out(f"FAIL {e.path}: {err}")
            all_ok = False
            continue
        if final.is_file() and check_file(folder, e, progress=False) is None:
            out(f"ok   {e.path} (already here)")
            continue
        done = False
        for src in sources:
            url = src.rstrip("/") + "/" + e.path
            deadline = time.monotonic() + deadline_s
            for attempt in range(attempts_per_source):
                try:
                    _download(url, partial, e.size, deadline)
                except SourceError as err:
                    got = partial.stat().st_size if partial.exists() else 0
                    if "more than the manifest" in str(err) or "deadline" in str(err):
                        out(f"     {e.path}: {url} {err}; next source")
                        partial.unlink(missing_ok=True)
                        break
                    out(f"     {e.path}: {url} broke off ({err}); resuming from {got} bytes")
                    continue
                if partial.stat().st_size < e.size:
                    out(f"     {e.path}: {url} ended early at {partial.stat().st_size} bytes; resuming")
                    continue
                if sha256_file(partial, progress=False) == e.sha256:
                    os.replace(partial, final)
                    done = True
                else:
                    out(f"     {e.path}: {url} gave a file that does not match the manifest; discarded")
                    partial.unlink()
                break
            if done:
                out(f"ok   {e.path} from {src}")
                break
        if not done:
            partial.unlink(missing_ok=True)
            out(f"FAIL {e.path}: no source gave a matching file")
            all_ok = False
    return all_ok
