"""A loopback stand-in for the Hugging Face Hub, serving dataset repositories from memory.

``huggingface_hub`` and ``datasets`` read ``HF_ENDPOINT`` when they are imported, so a test
starts :class:`HubStandIn`, then runs the code under test in a subprocess whose environment
:meth:`HubStandIn.env` builds (endpoint, caches under the test's tmp dir, offline flags unset).
The real ``load_dataset`` code runs against it: it asks for the repository card and info,
lists the repository tree, then downloads the data files.  Only what those calls need is
served; every request is logged in :attr:`HubStandIn.requests` (``"GET /api/..."``) so a test
can show what was asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the one revision each repository has


def _entry(path: str, content: bytes) -> dict:
    return {"type": "file", "path": path, "size": len(content),
            "oid": hashlib.sha1(content).hexdigest()}


class HubStandIn:
    """A threaded HTTP server answering the Hub API for dataset repositories in ``repos``.

    ``repos`` maps a repository id (``org/name``) to its files (path in repo -> bytes).  The
    revision ``main`` and :data:`COMMIT` both name the single commit.
    """

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.requests: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep the test output clean
                pass

            def do_HEAD(self) -> None:
                stand_in._answer(self)

            def do_GET(self) -> None:
                stand_in._answer(self)

            def do_POST(self) -> None:
                stand_in._answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The endpoint to put in ``HF_ENDPOINT``."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        """Environment for a subprocess using this Hub: its endpoint, caches under ``home``."""
        env = {key: value for key, value in os.environ.items()
               if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                              "HF_TOKEN", "HF_DATASETS_CACHE", "HF_HUB_CACHE")}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(home),
                   HF_DATASETS_CACHE=str(home / "datasets"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1",
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        env.update(extra)
        return env

    # -- request handling ----------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        self.requests.append(f"{handler.command} {handler.path}")
        parts = urlsplit(handler.path)
        path = unquote(parts.path)
        if handler.command == "POST":  # drain the body (paths-info sends a form)
            body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        else:
            body = b""
        if path.startswith("/api/datasets/"):
            self._api(handler, path.removeprefix("/api/datasets/"), parse_qs(parts.query), body)
        elif path.startswith("/datasets/") and "/resolve/" in path:
            repo_id, _, rest = path.removeprefix("/datasets/").partition("/resolve/")
            revision, _, file = rest.partition("/")
            self._file(handler, repo_id, revision, file)
        else:  # anything else the client may probe (e.g. /api/agent-harnesses)
            self._send(handler, 404, {"error": "not served by the stand-in"})

    def _repo(self, handler, repo_id: str, revision: str | None) -> dict[str, bytes] | None:
        if repo_id not in self.repos:
            self._send(handler, 404, {"error": f"Repository {repo_id} not found"},
                       {"X-Error-Code": "RepoNotFound"})
            return None
        if revision not in (None, "main", COMMIT):
            self._send(handler, 404, {"error": f"Invalid rev id: {revision}"},
                       {"X-Error-Code": "RevisionNotFound"})
            return None
        return self.repos[repo_id]

    def _api(self, handler, rest: str, query: dict, body: bytes) -> None:
        # /api/datasets/<org>/<name>[/revision/<rev> | /tree/<rev>[/<path>] | /paths-info/<rev>]
        pieces = rest.split("/")
        repo_id, action = "/".join(pieces[:2]), pieces[2:]
        revision = action[1] if len(action) > 1 else None
        files = self._repo(handler, repo_id, revision)
        if files is None:
            return
        if not action or action[0] == "revision":
            self._send(handler, 200, {
                "id": repo_id, "sha": COMMIT, "private": False, "disabled": False,
                "gated": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": name} for name in sorted(files)]})
        elif action[0] == "tree":
            prefix = "/".join(action[2:]).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            self._send(handler, 200, self._tree(files, prefix, recursive))
        elif action[0] == "paths-info":
            form = parse_qs(body.decode())
            wanted = form.get("paths", [])
            if not wanted and body.startswith(b"{"):
                wanted = json.loads(body).get("paths", [])
            entries = []
            for name in wanted:
                if name in files:
                    entries.append(_entry(name, files[name]))
                elif any(f.startswith(name.rstrip("/") + "/") for f in files):
                    entries.append({"type": "directory", "path": name, "oid": "0" * 40})
            self._send(handler, 200, entries)
        else:
            self._send(handler, 404, {"error": "not served by the stand-in"})

    @staticmethod
    def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
        entries, directories = [], set()
        for name in sorted(files):
            if prefix and not name.startswith(prefix + "/"):
                continue
            relative = name[len(prefix) + 1:] if prefix else name
            parents = relative.split("/")[:-1]
            for depth in range(1, len(parents) + 1 if recursive else min(1, len(parents)) + 1):
                directories.add("/".join(filter(None, [prefix, *parents[:depth]])))
            if recursive or not parents:
                entries.append(_entry(name, files[name]))
        return [{"type": "directory", "path": d, "oid": "0" * 40}
                for d in sorted(directories)] + entries

    def _file(self, handler, repo_id: str, revision: str, file: str) -> None:
        files = self._repo(handler, repo_id, revision)
        if files is None:
            return
        if file not in files:
            self._send(handler, 404, {"error": f"Entry not found: {file}"},
                       {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            return
        content = files[file]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(content).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}
        self._send(handler, 200, content, headers)

    @staticmethod
    def _send(handler, status: int, payload, headers: dict[str, str] | None = None) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        if not isinstance(payload, bytes):
            handler.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)


def parquet_bytes(rows: list[dict]) -> bytes:
    """The rows as one parquet file (what ``push_to_hub`` stores), built with pyarrow."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()
