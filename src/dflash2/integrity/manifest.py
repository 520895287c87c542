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
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=path.name,
                                     disable=not progress, leave=False) as bar:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def build_manifest(folder: str | Path) -> dict:
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    return {"version": 1, "files": [{"path": str(p.relative_to(folder)), "size": p.stat().st_size,
                                     "sha256": sha256_file(p)} for p in files]}


def write_manifest(folder, output, secret_key: str | Path | None = None) -> Path | None:
    text = json.dumps(build_manifest(folder), indent=2) + "\n"
    Path(output).write_text(text)
    if secret_key is None:
        return None
    sk = SecretKey.parse(Path(secret_key).read_text())
    sig_path = Path(str(output) + ".minisig")
    sig_path.write_text(sign(text.encode(), sk, trusted_comment=f"timestamp:{int(time.time())}\tfile:{Path(output).name}"))
    return sig_path


def read_manifest(path: str | Path, signature: str | Path | None = None,
                  public_key: str | Path | None = None) -> list[FileEntry]:
    """Parse a manifest; when a signature is given it is checked before anything else is read."""
    data = Path(path).read_bytes()
    if signature is not None or public_key is not None:
        if signature is None or public_key is None:
            raise ManifestError("--signature and --public-key go together")
        verify(data, Path(signature).read_text(), PublicKey.load(public_key))
    try:
        raw = json.loads(data)
        entries = [FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"]).lower()) for f in raw["files"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path}: not a valid manifest ({e})") from None
    for e in entries:
        if Path(e.path).is_absolute() or ".." in Path(e.path).parts:
            raise ManifestError(f"{path}: unsafe path {e.path!r}")
    return entries


def check_file(folder: Path, e: FileEntry, progress: bool = True) -> str | None:
    """None when the file matches, else why not."""
    p = folder / e.path
    if not p.is_file():
        return "missing"
    if p.stat().st_size != e.size:
        return f"size {p.stat().st_size} != {e.size}"
    digest = sha256_file(p, progress)
    return None if digest == e.sha256 else f"sha256 {digest[:16]}... != {e.sha256[:16]}..."


def verify_folder(folder, manifest, signature=None, public_key=None, progress=True, out=print) -> bool:
    try:
        entries = read_manifest(manifest, signature, public_key)
    except (SignatureError, ManifestError) as e:
        out(f"REJECTED manifest {manifest}: {e}")
        return False
    folder, ok = Path(folder), True
    for e in entries:
        problem = check_file(folder, e, progress)
        out(f"{'ok  ' if problem is None else 'FAIL'} {e.path} ({e.size:,} bytes){'' if problem is None else ': ' + problem}")
        ok &= problem is None
    out(f"verdict: {'all ' + str(len(entries)) + ' files match' if ok else 'MISMATCH'}"
        f"{' (signature ok)' if signature and ok else ''}")
    return ok


def _download(url: str, dest: Path, size: int) -> None:
    """Append to ``dest`` from its current length (HTTP Range, or a seek for file://)."""
    have = dest.stat().st_size if dest.exists() else 0
    if have >= size:
        return
    if url.startswith("file://"):
        with open(url[len("file://"):], "rb") as src, open(dest, "ab") as f:
            src.seek(have)
            while chunk := src.read(CHUNK):
                f.write(chunk)
        return
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        if have and resp.status != 206:  # the server ignored Range: start over
            dest.unlink()
            have = 0
        with open(dest, "ab") as f:
            while chunk := resp.read(CHUNK):
                f.write(chunk)


def fetch(manifest, folder, sources: list[str], attempts_per_source: int = 3, out=print) -> bool:
    entries = read_manifest(manifest)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    all_ok = True
    for e in entries:
        final = folder / e.path
        if final.is_file() and check_file(folder, e, progress=False) is None:
            out(f"ok   {e.path} (already here)")
            continue
        partial = final.with_name(final.name + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        done = False
        for src in sources:
            url = src.rstrip("/") + "/" + e.path
            for attempt in range(attempts_per_source):
                try:
                    _download(url, partial, e.size)
                except (urllib.error.URLError, OSError, ConnectionError) as err:
                    out(f"     {e.path}: {url} broke off ({err}); resuming from {partial.stat().st_size if partial.exists() else 0} bytes")
                    continue
                if partial.stat().st_size < e.size:
                    out(f"     {e.path}: {url} ended early at {partial.stat().st_size} bytes; resuming")
                    continue
                if partial.stat().st_size == e.size and sha256_file(partial, progress=False) == e.sha256:
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
