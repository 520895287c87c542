"""Manifests, minisign signatures, verify, and resumable multi-source fetch (loopback only)."""

import hashlib
import http.server
import json
import os
import threading
from pathlib import Path

import pytest

from dflash2.integrity.manifest import fetch, verify_folder, write_manifest
from dflash2.integrity.minisign import PublicKey, SecretKey, SignatureError, public_key_text, sign, verify


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300_000))
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(123_457))
    sk = SecretKey.generate()
    (tmp_path / "key.sec").write_text(sk.dump())
    (tmp_path / "key.pub").write_text(public_key_text(sk.public()))
    man = tmp_path / "MANIFEST.json"
    sig = write_manifest(d, man, tmp_path / "key.sec")
    return d, man, sig, tmp_path / "key.pub"


def _lines():
    out = []
    return out, out.append


def test_signed_manifest_verifies(ckpt):
    d, man, sig, pub = ckpt
    lines, say = _lines()
    assert verify_folder(d, man, sig, pub, progress=False, out=say)
    assert sum(l.startswith("ok") for l in lines) == 3 and "signature ok" in lines[-1]


def test_flipped_byte_in_file_is_named(ckpt):
    d, man, sig, pub = ckpt
    f = d / "model-00002-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[5000] ^= 1
    f.write_bytes(bytes(data))
    lines, say = _lines()
    assert not verify_folder(d, man, sig, pub, progress=False, out=say)
    assert any(l.startswith("FAIL model-00002-of-00002.safetensors") and "sha256" in l for l in lines)


def test_flipped_byte_in_manifest_rejected_before_files(ckpt, monkeypatch):
    d, man, sig, pub = ckpt
    text = man.read_text().replace('"size": 300000', '"size": 300001')
    man.write_text(text)
    import dflash2.integrity.manifest as m

    monkeypatch.setattr(m, "check_file", lambda *a, **k: pytest.fail("a file was read"))
    lines, say = _lines()
    assert not verify_folder(d, man, sig, pub, progress=False, out=say)
    assert "REJECTED manifest" in lines[0] and "does not match" in lines[0]


def test_flipped_byte_in_signature_rejected(ckpt):
    d, man, sig, pub = ckpt
    lines = sig.read_text().splitlines()
    raw = bytearray(__import__("base64").b64decode(lines[1]))
    raw[20] ^= 1
    lines[1] = __import__("base64").b64encode(bytes(raw)).decode()
    sig.write_text("\n".join(lines) + "\n")
    out, say = _lines()
    assert not verify_folder(d, man, sig, pub, progress=False, out=say)
    assert "REJECTED" in out[0]
    # altering the trusted comment breaks the global signature
    sk = SecretKey.generate()
    s = sign(b"data", sk, "t").replace("trusted comment: t", "trusted comment: x")
    with pytest.raises(SignatureError, match="trusted comment"):
        verify(b"data", s, sk.public())
    with pytest.raises(SignatureError, match="not by the given public key"):
        verify(b"data", sign(b"data", sk), SecretKey.generate().public())


def test_secret_key_round_trip():
    sk = SecretKey.generate()
    sk2 = SecretKey.parse(sk.dump())
    pk = PublicKey.parse(public_key_text(sk2.public()))
    assert verify(b"hello", sign(b"hello", sk2, "c"), pk) == "c"


class _Handler(http.server.BaseHTTPRequestHandler):
    root: Path = Path(".")
    cut_once: set = set()
    corrupt: bool = False

    def log_message(self, *a):
        pass

    def do_GET(self):
        p = self.root / self.path.lstrip("/")
        if not p.is_file():
            self.send_error(404)
            return
        data = p.read_bytes()
        if self.corrupt:
            data = bytes(b ^ 0xFF for b in data[:10]) + data[10:]
        start = 0
        rng = self.headers.get("Range")
        if rng:
            start = int(rng.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path not in self.cut_once:  # first request for this file: send half, then hang up
            self.cut_once.add(self.path)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


def _serve(root, corrupt=False):
    handler = type("H", (_Handler,), {"root": root, "cut_once": set(), "corrupt": corrupt})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_fetch_resumes_after_cut(ckpt, tmp_path):
    d, man, _, _ = ckpt
    srv, url = _serve(d)
    try:
        lines, say = _lines()
        dest = tmp_path / "dl"
        assert fetch(man, dest, [url], out=say)
        assert any("broke off" in l or "ended early" in l for l in lines)
        for f in d.iterdir():
            assert hashlib.sha256((dest / f.name).read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest()
        assert not list(dest.glob("*.partial"))
    finally:
        srv.shutdown()


def test_fetch_discards_wrong_file_and_uses_next_source(ckpt, tmp_path):
    d, man, _, _ = ckpt
    bad, bad_url = _serve(d, corrupt=True)
    try:
        lines, say = _lines()
        dest = tmp_path / "dl2"
        assert fetch(man, dest, [bad_url, f"file://{d}"], out=say)
        assert any("does not match the manifest; discarded" in l for l in lines)
        assert any(l.startswith("ok") and "file://" in l for l in lines)
        assert verify_folder(dest, man, progress=False, out=lambda s: None)
    finally:
        bad.shutdown()


def test_cli_refuses_drafter_failing_manifest(tmp_path):
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    d = tmp_path / "draft"
    shutil.copytree(repo / "models/smollm2-135m-dflash2", d)
    write_manifest(d, tmp_path / "M.json")
    (d / "config.json").write_text((d / "config.json").read_text() + " ")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2.cli",
            "generate",
            "--prompt",
            "hi",
            "--speculative-draft-model-path",
            str(d),
            "--verify-manifest",
            str(tmp_path / "M.json"),
        ],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    assert p.returncode == 2 and "refused" in p.stderr and "FAIL config.json" in p.stdout
