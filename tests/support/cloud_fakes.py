"""Small local stand-ins for the two cloud services no registry package emulates, each a real HTTP
server on 127.0.0.1 (run with threaded_server.ThreadedServer):

- `fake_hub(repos)`: the part of the Hugging Face Hub that huggingface_hub's downloads use:
  HEAD/GET {endpoint}/{org}/{name}/resolve/{revision}/{path}, with the Hub's headers (X-Repo-Commit,
  ETag, Content-Length) and its error codes (X-Error-Code: RepoNotFound, RevisionNotFound,
  EntryNotFound, GatedRepo), and private repositories that need a bearer token.
- `fake_metadata_server()`: the GCE / GKE metadata server that Google's Application Default
  Credentials ask for a token under Workload Identity (Metadata-Flavor: Google).

Each records the requests it gets in `.seen`: (method, path, authorization header).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response


@dataclass
class HubRepo:
    """A model repository: revision (branch, tag or commit) -> commit, commit -> {path: bytes}."""

    refs: dict[str, str]
    files: dict[str, dict[str, bytes]]
    token: str | None = None  # private: only this bearer token sees it
    gated: bool = False


@dataclass
class Recorder:
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def record(self, request: Request) -> None:
        self.seen.append((request.method, request.url.path, request.headers.get("authorization")))


def _hub_error(status: int, code: str, message: str, commit: str | None = None) -> Response:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit:
        headers["X-Repo-Commit"] = commit
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def fake_hub(repos: dict[str, HubRepo]) -> FastAPI:
    app, recorder = FastAPI(), Recorder()
    app.state.seen = recorder.seen

    @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(org: str, name: str, revision: str, path: str, request: Request) -> Response:
        recorder.record(request)
        repo = repos.get(f"{org}/{name}")
        if repo is None or (repo.token and request.headers.get("authorization") != f"Bearer {repo.token}"):
            return _hub_error(401, "RepoNotFound", "Repository Not Found")
        if repo.gated:
            return _hub_error(403, "GatedRepo", "Access to this model is restricted")
        commit = repo.refs.get(revision, revision if revision in repo.files else None)
        if commit is None:
            return _hub_error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        data = repo.files[commit].get(path)
        if data is None:
            return _hub_error(404, "EntryNotFound", f"{path} does not exist", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        body = b"" if request.method == "HEAD" else data
        return Response(body, headers=headers, media_type="application/octet-stream")

    return app


def fake_metadata_server(token: str = "ya29.workload-identity", project: str = "adapters-project") -> FastAPI:
    """`app.state.on_gce = False` makes it answer like a machine that is not on Google Cloud."""
    app, recorder = FastAPI(), Recorder()
    app.state.seen, app.state.on_gce = recorder.seen, True
    flavor = {"Metadata-Flavor": "Google"}
    account = {"email": "adapters@adapters-project.iam.gserviceaccount.com", "aliases": ["default"],
               "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
    answers: dict[str, str | dict] = {
        "": "ok",
        "computeMetadata/v1/project/project-id": project,
        "computeMetadata/v1/universe/universe-domain": "googleapis.com",
    }
    for name in ("default", account["email"]):  # the client asks by alias, then by e-mail
        answers[f"computeMetadata/v1/instance/service-accounts/{name}/"] = account
        answers[f"computeMetadata/v1/instance/service-accounts/{name}/token"] = {
            "access_token": token, "expires_in": 3600, "token_type": "Bearer"}

    @app.get("/{path:path}")
    async def metadata(path: str, request: Request) -> Response:
        recorder.record(request)
        if not app.state.on_gce or path not in answers:
            return PlainTextResponse("not found", status_code=404)
        if request.headers.get("metadata-flavor") != "Google":
            return PlainTextResponse("Missing Metadata-Flavor header", status_code=403, headers=flavor)
        answer = answers[path]
        if isinstance(answer, str):
            return PlainTextResponse(answer, headers=flavor)
        return JSONResponse(answer, headers=flavor)

    return app
