"""A local HTTP server speaking the two parts of the Hugging Face Hub's API that downloads use: the
file list (``GET /api/models/{repo}/tree/{revision}``) and the files (``HEAD``/``GET
/{repo}/resolve/{revision}/{path}``, with HTTP ranges), answered with the headers huggingface_hub
reads (``X-Repo-Commit``, ``ETag``, sizes). Point ``HF_ENDPOINT`` at :attr:`FakeHub.url`.

Every request is recorded (method, path, ``Range`` header). ``stall_after[path] = n`` makes a GET of
that file send ``n`` bytes and then hang until :meth:`FakeHub.release` (a connection that stops
moving, as when a download is interrupted); ``None`` serves it whole."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@dataclass
class FakeHub:
    #: repo id -> {path in repo: bytes}
    repos: dict[str, dict[str, bytes]]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    stall_after: dict[str, int | None] = field(default_factory=dict)
    _release: threading.Event = field(default_factory=threading.Event)

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def release(self) -> None:
        self._release.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    # -- answers ---------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path):
            return self._tree(h, m.group(1))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._file(h, m.group(1), m.group(3), head)
        return self._error(h, 404, "EntryNotFound", "no such route")

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _tree(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
        entries = []
        for path, data in sorted(files.items()):
            entry: dict[str, object] = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
            if _is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        body = json.dumps(entries).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, path: str, head: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
        if path not in files:
            return self._error(h, 404, "EntryNotFound", f"{path} not found")
        data = files[path]
        etag = hashlib.sha256(data).hexdigest() if _is_lfs(path) else _git_oid(data)
        start = 0
        rng = h.headers.get("Range")
        if rng and not head and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
            start = int(m.group(1))
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        stall = self.stall_after.get(path)
        if stall is None:
            h.wfile.write(body)
            return
        h.wfile.write(body[:stall])
        h.wfile.flush()
        self._release.wait(120)  # then drop the connection without the rest


def _is_lfs(path: str) -> bool:
    return path.endswith((".gguf", ".safetensors"))


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
