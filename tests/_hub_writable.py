"""A writable loopback Hub: the real ``huggingface_hub`` client creates model repositories on it
and commits files to them, which a test then reads back.

:class:`WritableHub` extends the read-only dataset stand-in (:class:`tests._hub_helpers.HubStandIn`)
with what ``HfApi.create_repo`` and ``HfApi.create_commit`` send:

    POST /api/repos/create                          {"name", "organization", "visibility", "type"}
    POST /api/validate-yaml                         the README.md front matter (always valid here)
    POST /api/models/<org>/<name>/preupload/<rev>   {"files": [{"path", "sample", "size"}]}
    POST /api/models/<org>/<name>/commit/<rev>      NDJSON: a header line, then one line a file

Every file is answered "regular" at preupload, so the client sends its content inline
(base64) in the commit and no LFS transfer is involved. Each repository keeps its files
(:attr:`ModelRepo.files`, path -> bytes), whether it was created private, and its commits;
every request needs a bearer token (the ones seen are in :attr:`WritableHub.tokens`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests._hub_helpers import HubStandIn


@dataclass
class ModelRepo:
    """A model repository of the stand-in: visibility at creation, files, commit summaries."""

    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)


class WritableHub(HubStandIn):
    """The dataset stand-in plus model repositories the client can create and commit to."""

    def __init__(self, repos: dict[str, dict[str, bytes]] | None = None) -> None:
        super().__init__(repos or {})
        self.models: dict[str, ModelRepo] = {}
        self.tokens: set[str] = set()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(handler.path).path)
        writes = path in ("/api/repos/create", "/api/validate-yaml") or (
            path.startswith("/api/models/") and ("/preupload/" in path or "/commit/" in path))
        if handler.command != "POST" or not writes:
            super()._answer(handler)
            return
        self.requests.append(f"POST {handler.path}")
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        auth = handler.headers.get("Authorization") or ""
        if not auth.startswith("Bearer ") or len(auth) <= len("Bearer "):
            self._send(handler, 401, {"error": "Invalid credentials in Authorization header"})
            return
        self.tokens.add(auth.removeprefix("Bearer "))
        if path == "/api/repos/create":
            self._create(handler, json.loads(body))
        elif path == "/api/validate-yaml":
            self._send(handler, 200, {"errors": [], "warnings": []})
        else:
            repo_id, _, rest = path.removeprefix("/api/models/").rpartition(
                "/preupload/" if "/preupload/" in path else "/commit/")
            repo = self.models.get(repo_id)
            if repo is None:
                self._send(handler, 404, {"error": f"Repository {repo_id} not found"},
                           {"X-Error-Code": "RepoNotFound"})
            elif "/preupload/" in path:
                files = json.loads(body)["files"]
                self._send(handler, 200, {"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                     "oid": None} for f in files]})
            else:
                self._commit(handler, repo_id, repo, body)

    def _create(self, handler, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}"
        url = f"{self.url}/{repo_id}"
        if payload.get("type", "model") != "model":
            self._send(handler, 400, {"error": "the stand-in holds model repositories only"})
        elif repo_id in self.models:
            self._send(handler, 409, {"error": "You already created this model repo", "url": url})
        else:
            self.models[repo_id] = ModelRepo(private=payload.get("visibility") == "private")
            self._send(handler, 200, {"url": url, "name": repo_id})

    def _commit(self, handler, repo_id: str, repo: ModelRepo, body: bytes) -> None:
        added: dict[str, bytes] = {}
        summary = ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                summary = item["value"]["summary"]
            elif item["key"] == "file" and item["value"].get("encoding") == "base64":
                added[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            else:  # LFS files, deletions: never asked for by this stand-in's preupload answer
                self._send(handler, 400, {"error": f"not served by the stand-in: {item['key']}"})
                return
        repo.files.update(added)
        repo.commits.append(summary)
        oid = hashlib.sha1(f"{repo_id}:{len(repo.commits)}".encode()).hexdigest()
        self._send(handler, 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}",
                                  "commitOid": oid})
