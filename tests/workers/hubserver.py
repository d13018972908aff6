"""A Hugging Face Hub on loopback for the push and model download tests: the part of the Hub's HTTP API that
`huggingface_hub`'s `create_repo`, `create_branch`, `upload_folder` and `snapshot_download` call (read from the
installed client), served by uvicorn in a thread, keeping what it receives in memory.

Covered, as the real Hub answers them:
- POST /api/repos/create (409 when the repository exists), GET /api/models/<repo>[/revision/<rev>] (repo_info),
  GET /api/models/<repo>/auth-check (auth_check: may the caller read it);
- POST /api/models/<repo>/branch/<branch> (409 when it exists);
- POST /api/validate-yaml (the model card's front matter must be a YAML mapping);
- POST /api/models/<repo>/preupload/<rev>: `lfs` for *.safetensors (the Hub's .gitattributes makes them LFS),
  `regular` otherwise, with the oid of the file already on that branch (the client then skips unchanged files);
- the LFS batch API (POST /<repo>.git/info/lfs/objects/batch, basic transfer) with a single-use upload URL
  (PUT, checked against the announced sha256 and size) and the verify call;
- POST /api/models/<repo>/commit/<rev>: the NDJSON commit (header, file, lfsFile, deletedFile, deletedFolder;
  parentCommit checked), one commit per call with its message;
- downloads: GET /api/models/<repo>/tree/<rev> (the listing snapshot_download reads) and HEAD/GET
  /<repo>/resolve/<rev>/<path> (X-Repo-Commit, ETag or X-Linked-Etag/X-Linked-Size for LFS files, as
  huggingface_hub's get_hf_file_metadata reads them), where <rev> is a branch or a commit.
Writes need `Authorization: Bearer <token>`, else 401. Reads are anonymous for a public repository, as on the Hub;
a wrong token is refused everywhere (401 "Invalid credentials in Authorization header", which huggingface_hub's
hf_raise_for_status tells apart from a missing repository). How the Hub answers reads it does not allow, as
huggingface_hub's hf_raise_for_status (utils/_http.py) and its docs on gated models describe them:
- a repository that does not exist, or a private one the caller cannot read: 401 without a token, 404 with one,
  both with `X-Error-Code: RepoNotFound` (the Hub does not say which, so that private names do not leak);
- a gated repository: its metadata and file list are public; its files answer 401 (no token) or 403 (a token
  whose user has not been granted access) with `X-Error-Code: GatedRepo`;
- a revision that does not exist: 404 with `X-Error-Code: RevisionNotFound`.

Not covered: the Xet storage protocol (huggingface_hub uses it when `hf_xet` is installed: tests set
HF_HUB_DISABLE_XET, so LFS is what they exercise), LFS files served by redirect to a CDN (the Hub's: resolve answers
the file itself here), pull requests, multipart LFS, rate limits.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.workers.rewardserver import AppServer

TOKEN = "hf_emulator_write_token"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt")


def git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    message: str
    parent: str | None
    files: dict[str, bytes]  # the whole tree at this commit, path -> content
    lfs: frozenset[str]  # which of its paths are LFS files


@dataclass
class Repo:
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)  # oldest first
    gated: bool = False
    granted: frozenset[str] = frozenset()  # the tokens whose users may read a gated or private repository

    def head(self, branch: str) -> Commit:
        return self.branches[branch][-1]

    def at(self, revision: str) -> Commit | None:
        """The commit a branch names, or the commit of that oid; None if neither."""
        if revision in self.branches:
            return self.head(revision)
        return next((c for commits in self.branches.values() for c in commits if c.oid == revision), None)


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content
    upload_keys: dict[str, tuple[str, int]] = field(default_factory=dict)  # one-time key -> (sha256, size)
    calls: list[str] = field(default_factory=list)  # "METHOD path", in order
    # When set, a commit is held until `hold` is set (at most a minute); `holding` says one is waiting.
    hold: threading.Event | None = None
    holding: threading.Event = field(default_factory=threading.Event)


def _error(status: int, message: str, *, code: str | None = None, **extra: str) -> JSONResponse:
    # The Hub's error body; huggingface_hub puts "error" into the exception's message and picks the exception's
    # type by X-Error-Code.
    headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def _is_read(request: Request) -> bool:
    path = request.url.path
    return request.method in ("GET", "HEAD") and (path.startswith("/api/models/") or "/resolve/" in path)


def make_app(state: HubState, token: str, read_tokens: frozenset[str] = frozenset()) -> FastAPI:
    app = FastAPI()
    known = {token, *read_tokens}

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        state.calls.append(f"{request.method} {request.url.path}")
        given = request.headers.get("authorization")
        if request.url.path.startswith("/lfs-upload/"):
            return await call_next(request)
        if given is None and _is_read(request):
            return await call_next(request)  # anonymous reads: the route decides what a public caller may see
        if given not in {f"Bearer {t}" for t in (known if _is_read(request) else {token})}:
            return _error(401, "Invalid credentials in Authorization header")
        return await call_next(request)

    def caller(request: Request) -> str | None:
        given = request.headers.get("authorization") or ""
        return given.removeprefix("Bearer ") or None

    def repo_or_404(repo_id: str, request: Request | None = None) -> Repo | JSONResponse:
        repo = state.repos.get(repo_id)
        who = caller(request) if request is not None else token
        if repo is None or (repo.private and who != token and who not in repo.granted):
            status = 401 if who is None else 404
            return _error(status, f"Repository Not Found for url: {repo_id}", code="RepoNotFound")
        return repo

    def commit_or_error(repo_id: str, revision: str, request: Request) -> tuple[Repo, Commit] | JSONResponse:
        """The repository and the commit `revision` names (a branch or a commit), or the Hub's refusal."""
        repo = repo_or_404(repo_id, request)
        if isinstance(repo, JSONResponse):
            return repo
        head = repo.at(revision)
        if head is None:
            return _error(404, f"Revision Not Found: {revision}", code="RevisionNotFound")
        return repo, head

    @app.post("/api/repos/create")
    async def create_repo(request: Request):
        body = await request.json()
        if body.get("type", "model") != "model":
            return _error(400, "this emulator keeps model repositories only")
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        if repo_id in state.repos:
            # huggingface_hub's create_repo(exist_ok=True) reads the URL from this answer, as the Hub sends it.
            return _error(409, "You already created this model repo", url=f"{request.base_url}{repo_id}")
        initial = Commit(secrets.token_hex(20), "initial commit", None, {".gitattributes": b"*.safetensors filter=lfs"
                                                                         b" diff=lfs merge=lfs -text\n"},
                         frozenset())  # fmt: skip
        state.repos[repo_id] = Repo(private=body.get("visibility") == "private", branches={"main": [initial]})
        return {"url": f"{request.base_url}{repo_id}", "name": repo_id, "id": repo_id}

    @app.get("/api/models/{owner}/{name}")
    @app.get("/api/models/{owner}/{name}/revision/{revision}")
    async def repo_info(owner: str, name: str, request: Request, revision: str = "main"):
        found = commit_or_error(f"{owner}/{name}", revision, request)
        if isinstance(found, JSONResponse):
            return found
        repo, head = found
        siblings = [{"rfilename": path} for path in sorted(head.files)]
        return {
            "id": f"{owner}/{name}",
            "sha": head.oid,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "siblings": siblings,
        }

    @app.get("/api/models/{owner}/{name}/auth-check")
    async def auth_check(owner: str, name: str, request: Request):
        # huggingface_hub's HfApi.auth_check (hf_api.py): 200 when the caller may read the repository; else the
        # Hub's refusal, read by hf_raise_for_status: RepoNotFound as for any read, GatedRepo (401 without a token,
        # 403 with one not granted access) as the gated repository's files answer.
        repo_id = f"{owner}/{name}"
        repo = repo_or_404(repo_id, request)
        if isinstance(repo, JSONResponse):
            return repo
        who = caller(request)
        if repo.gated and who != token and who not in repo.granted:
            status = 401 if who is None else 403
            return _error(status, f"Access to model {repo_id} is restricted and you are not in the authorized list",
                          code="GatedRepo")  # fmt: skip
        return {}

    @app.get("/api/models/{owner}/{name}/tree/{revision}")
    async def tree(owner: str, name: str, revision: str, request: Request):
        found = commit_or_error(f"{owner}/{name}", revision, request)
        if isinstance(found, JSONResponse):
            return found
        _, head = found
        entries = []
        for path in sorted(head.files):
            content = head.files[path]
            entry = {"type": "file", "path": path, "size": len(content), "oid": git_blob_oid(content)}
            if path in head.lfs:
                sha = hashlib.sha256(content).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(content), "pointerSize": 134}
            entries.append(entry)
        return entries

    @app.api_route("/{owner}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(owner: str, name: str, revision: str, path: str, request: Request):
        repo_id = f"{owner}/{name}"
        found = commit_or_error(repo_id, revision, request)
        if isinstance(found, JSONResponse):
            return found
        repo, head = found
        who = caller(request)
        if repo.gated and who != token and who not in repo.granted:
            status = 401 if who is None else 403
            return _error(status, f"Access to model {repo_id} is restricted and you are not in the authorized list",
                          code="GatedRepo")  # fmt: skip
        if path not in head.files:
            return _error(404, f"Entry not found: {path}", code="EntryNotFound")
        content = head.files[path]
        headers = {"X-Repo-Commit": head.oid, "Content-Length": str(len(content))}
        if path in head.lfs:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(content).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(content))
        headers["ETag"] = f'"{git_blob_oid(content)}"'
        body = b"" if request.method == "HEAD" else content
        return Response(body, headers=headers, media_type="application/octet-stream")

    @app.post("/api/models/{owner}/{name}/branch/{branch}")
    async def create_branch(owner: str, name: str, branch: str, request: Request):
        repo = repo_or_404(f"{owner}/{name}")
        if isinstance(repo, JSONResponse):
            return repo
        if branch in repo.branches:
            return _error(409, f"Reference already exists: refs/heads/{branch}")
        start = (await request.json()).get("startingPoint") or "main"
        if start not in repo.branches:
            return _error(400, f"Invalid starting point: {start}")
        repo.branches[branch] = [repo.head(start)]
        return {}

    @app.post("/api/validate-yaml")
    async def validate_yaml(request: Request):
        content = (await request.json())["content"]
        if content.startswith("---\n"):
            front = content[4:].split("\n---", 1)[0]
            try:
                meta = yaml.safe_load(front)
            except yaml.YAMLError as err:
                return JSONResponse({"errors": [{"message": f"invalid YAML: {err}"}]}, status_code=400)
            if not isinstance(meta, dict):
                return JSONResponse({"errors": [{"message": "metadata must be a mapping"}]}, status_code=400)
        return {"errors": [], "warnings": []}

    @app.post("/api/models/{owner}/{name}/preupload/{revision}")
    async def preupload(owner: str, name: str, revision: str, request: Request):
        repo = repo_or_404(f"{owner}/{name}")
        if isinstance(repo, JSONResponse):
            return repo
        head = repo.head(revision) if revision in repo.branches else None
        files = []
        for item in (await request.json())["files"]:
            path = item["path"]
            lfs = path.endswith(LFS_SUFFIXES)
            oid = None
            if head is not None and path in head.files:
                content = head.files[path]
                oid = hashlib.sha256(content).hexdigest() if path in head.lfs else git_blob_oid(content)
            files.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return {"files": files, "commitOid": head.oid if head else None}

    @app.post("/{owner}/{name}.git/info/lfs/objects/batch")
    async def lfs_batch(owner: str, name: str, request: Request):
        repo = repo_or_404(f"{owner}/{name}")
        if isinstance(repo, JSONResponse):
            return repo
        body = await request.json()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            return _error(400, "only uploads with the basic transfer are emulated")
        objects = []
        for obj in body["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in state.lfs_objects:
                objects.append({"oid": oid, "size": size})  # no actions: already stored
                continue
            key = secrets.token_urlsafe(16)
            state.upload_keys[key] = (oid, size)
            actions = {
                "upload": {"href": f"{request.base_url}lfs-upload/{key}"},
                "verify": {"href": f"{request.base_url}{owner}/{name}.git/info/lfs/objects/verify"},
            }
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": actions})
        return JSONResponse({"transfer": "basic", "objects": objects}, media_type="application/vnd.git-lfs+json")

    @app.put("/lfs-upload/{key}")
    async def lfs_upload(key: str, request: Request):
        if key not in state.upload_keys:
            return _error(403, "upload URL unknown or already used")
        oid, size = state.upload_keys.pop(key)
        content = await request.body()
        if len(content) != size or hashlib.sha256(content).hexdigest() != oid:
            return _error(400, f"content does not match oid {oid} and size {size}")
        state.lfs_objects[oid] = content
        return Response(status_code=200)

    @app.post("/{owner}/{name}.git/info/lfs/objects/verify")
    async def lfs_verify(owner: str, name: str, request: Request):
        body = await request.json()
        stored = state.lfs_objects.get(body["oid"])
        if stored is None or len(stored) != body["size"]:
            return _error(404, f"object {body['oid']} not uploaded")
        return {}

    @app.post("/api/models/{owner}/{name}/commit/{revision}")
    async def commit(owner: str, name: str, revision: str, request: Request):
        repo_id = f"{owner}/{name}"
        repo = repo_or_404(repo_id)
        if isinstance(repo, JSONResponse):
            return repo
        if revision not in repo.branches:
            return _error(404, f"Invalid rev id: {revision}")
        if request.headers.get("content-type") != "application/x-ndjson":
            return _error(400, "a commit is sent as application/x-ndjson")
        lines = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
        if state.hold is not None:
            state.holding.set()
            await asyncio.to_thread(state.hold.wait, 60)
        if not lines or lines[0]["key"] != "header" or not lines[0]["value"].get("summary"):
            return _error(400, "the first line must be the header with a summary")
        header, head = lines[0]["value"], repo.head(revision)
        if header.get("parentCommit") not in (None, head.oid):
            return _error(412, f"A commit has happened since: {head.oid}")
        files, lfs = dict(head.files), set(head.lfs)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"]
            if key == "file":
                files[path] = base64.b64decode(value["content"])
                lfs.discard(path)
            elif key == "lfsFile":
                if value["oid"] not in state.lfs_objects:
                    return _error(422, f"LFS object {value['oid']} for {path} was never uploaded")
                files[path] = state.lfs_objects[value["oid"]]
                lfs.add(path)
            elif key == "deletedFile":
                files.pop(path, None)
            elif key == "deletedFolder":
                files = {p: c for p, c in files.items() if not p.startswith(path.rstrip("/") + "/")}
            else:
                return _error(400, f"unknown operation {key!r}")
        oid = hashlib.sha1(json.dumps([head.oid, header["summary"], sorted(files)]).encode()
                           + secrets.token_bytes(8)).hexdigest()  # fmt: skip
        repo.branches[revision].append(Commit(oid, header["summary"], head.oid, files, frozenset(lfs & set(files))))
        return {"success": True, "commitOid": oid, "commitUrl": f"{request.base_url}{repo_id}/commit/{oid}"}

    return app


class HubServer(AppServer):
    """The emulated Hub; `state` holds the repositories, their branches and commits."""

    def __init__(self, token: str = TOKEN, read_tokens: frozenset[str] = frozenset()):
        self.state = HubState()
        self.token = token
        super().__init__(make_app(self.state, token, read_tokens))

    def add_model(
        self,
        repo_id: str,
        folder: Path,
        *,
        private: bool = False,
        gated: bool = False,
        granted: frozenset[str] = frozenset(),
    ) -> str:
        """A model repository holding `folder`'s files (weights as LFS files, as the Hub keeps them); returns the
        commit. `granted`: the tokens (other than the write token) allowed to read it when private or gated."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        lfs = frozenset(path for path in files if path.endswith(LFS_SUFFIXES))
        commit = Commit(secrets.token_hex(20), "upload model", None, files, lfs)
        self.state.repos[repo_id] = Repo(private=private, branches={"main": [commit]}, gated=gated, granted=granted)
        return commit.oid

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.state.repos[repo_id].head(branch).files

    def messages(self, repo_id: str, branch: str = "main") -> list[str]:
        return [c.message for c in self.state.repos[repo_id].branches[branch]]
