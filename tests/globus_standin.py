"""A local stand-in for Globus Transfer: `responses` callbacks that answer the real globus-sdk client and move real
bytes."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import uuid
from urllib.parse import parse_qs, urlparse

import responses

API = "https://transfer.api.globus.org/v0.10"
_SYNC = {0: "exists", 1: "size", 2: "mtime", 3: "checksum"}


class _Stop(Exception):
    """Ends a task run: fatal (FAILED) or stuck (stays ACTIVE with a nice_status)."""

    def __init__(self, code: str, fatal: bool):
        super().__init__(code)
        self.code, self.fatal = code, fatal


class GlobusStandIn:
    """Collections ``roots`` (UUID -> directory posing as its root) served to globus-sdk through ``mock``.

    A submitted task runs at submit time, copying its items between the two
    roots the way Globus does: file items follow symlinks, recursive items
    skip them, parents are created, mtimes kept to the second with
    preserve_timestamp, sync_level honoured, source errors skipped with
    skip_source_errors. get_task then answers ACTIVE ``polls_before_done``
    times before the final status. Knobs emulate trouble: ACL denials
    (``denied``), quotas, lost submit responses, stuck tasks.
    """

    def __init__(self, mock: responses.RequestsMock, roots: dict[str, str]):
        self.roots = {ep: os.path.realpath(root) for ep, root in roots.items()}
        self.tasks: dict[str, dict] = {}
        self.submissions: list[dict] = []            # every POST /transfer body, in order
        self.submission_ids_issued: list[str] = []
        self._by_submission: dict[str, str] = {}
        self.polls_before_done = 1
        self.lose_submit_responses = 0               # accept the task, then answer 503 (response lost)
        self.denied: set[tuple[str, str]] = set()    # (collection, path prefix) an ACL denies
        self.quota: dict[str, int] = {}              # collection -> bytes it may still take
        self.stuck: tuple[str, str] | None = None    # (status, nice_status) every task keeps
        self.before_run = None
        routes = [("GET", r"/submission_id", self._submission_id), ("POST", r"/transfer", self._submit),
                  ("GET", r"/task/([^/?]+)", self._task), ("POST", r"/task/([^/?]+)/cancel", self._cancel),
                  ("GET", r"/task/([^/?]+)/(successful_transfers|skipped_errors)", self._listing),
                  ("GET", r"/operation/endpoint/([^/?]+)/ls", self._ls),
                  ("GET", r"/operation/endpoint/([^/?]+)/stat", self._stat),
                  ("POST", r"/operation/endpoint/([^/?]+)/mkdir", self._mkdir)]
        for method, path, handler in routes:
            pattern = re.compile(re.escape(API) + path + r"(?:\?.*)?$")
            mock.add_callback(method, pattern, callback=self._route(pattern, handler))

    def _route(self, pattern, handler):
        def callback(request):
            status, body = handler(request, *pattern.match(request.url).groups())
            return status, {"Content-Type": "application/json"}, json.dumps(body)
        return callback

    # ------------------------------------------------------------ paths

    def path(self, collection: str, path: str) -> str:
        """The local file behind ``path`` on ``collection``; PermissionError where the ACL denies it."""
        root = self.roots[collection]
        real = os.path.normpath(os.path.join(root, path.lstrip("/")))
        if not (real == root or real.startswith(root.rstrip(os.sep) + os.sep)) or any(
                c == collection and (path + "/").startswith(p.rstrip("/") + "/") for c, p in self.denied):
            raise PermissionError(path)
        return real

    @staticmethod
    def _error(status: int, code: str, message: str):
        return status, {"code": code, "message": message, "request_id": "standin", "resource": "standin"}

    # ------------------------------------------------------------ tasks

    def _submission_id(self, request):
        value = str(uuid.uuid4())
        self.submission_ids_issued.append(value)
        return 200, {"DATA_TYPE": "submission_id", "value": value}

    def _submit(self, request):
        body = json.loads(request.body)
        self.submissions.append(body)
        submission = body["submission_id"]
        code = "Duplicate" if submission in self._by_submission else "Accepted"
        if code == "Accepted":
            if body["source_endpoint"] not in self.roots or body["destination_endpoint"] not in self.roots:
                return self._error(404, "ClientError.NotFound", "No such endpoint")
            task = self._run(body)
            self.tasks[task["task_id"]] = task
            self._by_submission[submission] = task["task_id"]
        if self.lose_submit_responses:
            self.lose_submit_responses -= 1
            return self._error(503, "ServiceUnavailable", "try again later")
        return 202, {"DATA_TYPE": "transfer_result", "code": code, "submission_id": submission,
                     "task_id": self._by_submission[submission], "message": "The transfer has been accepted"}

    def _run(self, body: dict) -> dict:
        task = {"DATA_TYPE": "task", "task_id": str(uuid.uuid4()), "type": "TRANSFER", "label": body.get("label"),
                "source_endpoint_id": body["source_endpoint"], "destination_endpoint_id": body["destination_endpoint"],
                "sync_level": body.get("sync_level"), "verify_checksum": body.get("verify_checksum"),
                "final": "SUCCEEDED", "nice": None, "fatal_error": None, "polls": 0, "files_skipped": 0,
                "successful": [], "skipped": []}
        if self.before_run:
            self.before_run()
        try:
            for item in body["DATA"]:
                self._item(body, task, item)
        except _Stop as stop:
            if stop.fatal:
                task["final"], task["fatal_error"] = "FAILED", {"code": stop.code, "description": stop.code.lower()}
            else:
                task["stuck"] = ("ACTIVE", stop.code)
        return task

    def _item(self, body: dict, task: dict, item: dict) -> None:
        src_path, dst_path = item["source_path"], item["destination_path"]
        try:
            src = self.path(body["source_endpoint"], src_path)
        except PermissionError:
            self._skip(body, task, item, "PERMISSION_DENIED")
            return
        if not os.path.exists(src) or (item.get("recursive") is True) != os.path.isdir(src):
            self._skip(body, task, item, "FILE_NOT_FOUND" if not os.path.exists(src) else "NOT_A_FILE")
            return
        pairs = [(src, src_path, dst_path)] if not item.get("recursive") else self._walk(src, src_path, dst_path)
        for source, source_path, destination_path in pairs:
            try:
                target = self.path(body["destination_endpoint"], destination_path)
            except PermissionError:
                raise _Stop("PERMISSION_DENIED", fatal=False) from None   # Globus retries until the deadline
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            elif self._copy(body, source, target):
                task["successful"].append({"DATA_TYPE": "successful_transfer", "source_path": source_path,
                                           "destination_path": destination_path})
            else:
                task["files_skipped"] += 1

    def _walk(self, src: str, src_path: str, dst_path: str):
        yield src, src_path, dst_path
        for current, dirs, files in os.walk(src):
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(current, name)
                if os.path.islink(full):
                    continue                                  # recursive transfers skip symlinks
                rel = os.path.relpath(full, src)
                yield full, src_path.rstrip("/") + "/" + rel, dst_path.rstrip("/") + "/" + rel

    def _skip(self, body, task, item, code):
        if not body.get("skip_source_errors"):
            raise _Stop(code, fatal=True)
        task["skipped"].append({"DATA_TYPE": "skipped_error", "source_path": item["source_path"],
                                "destination_path": item["destination_path"], "error_code": code,
                                "error_details": f"{code.lower()}: {item['source_path']}", "is_directory": False})

    def _copy(self, body: dict, source: str, target: str) -> bool:
        """Copy one file (following links); False when sync_level finds it current."""
        st = os.stat(source)
        if _current(body.get("sync_level"), source, target, st):
            return False
        collection = body["destination_endpoint"]
        if collection in self.quota:
            if st.st_size > self.quota[collection] and body.get("fail_on_quota_errors"):
                raise _Stop("QUOTA_EXCEEDED", fatal=True)
            self.quota[collection] -= st.st_size
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(source, target)
        if body.get("preserve_timestamp"):
            os.utime(target, (int(st.st_mtime), int(st.st_mtime)))
        return True

    def _task(self, request, task_id):
        task = self.tasks.get(task_id)
        if task is None:
            return self._error(404, "ClientError.NotFound", f"Task {task_id} not found")
        task["polls"] += 1
        status, nice = task.get("stuck") or self.stuck or (None, None)
        if task.get("cancelled"):
            status, nice = "FAILED", None
        elif status is None:
            done = task["polls"] > self.polls_before_done
            status, nice = (task["final"], None) if done else ("ACTIVE", "Queued")
        public = {k: v for k, v in task.items() if k not in ("successful", "skipped", "stuck", "final", "polls")}
        return 200, {**public, "status": status, "nice_status": nice, "nice_status_short_description": nice,
                     "files_transferred": len(task["successful"]), "subtasks_skipped_errors": len(task["skipped"])}

    def _cancel(self, request, task_id):
        self.tasks[task_id]["cancelled"] = True
        self.tasks[task_id]["fatal_error"] = {"code": "CANCELED", "description": "canceled"}
        return 200, {"DATA_TYPE": "result", "code": "Canceled", "message": "The task has been cancelled."}

    def _listing(self, request, task_id, kind):
        key = "successful" if kind == "successful_transfers" else "skipped"
        return 200, {"DATA_TYPE": kind, "DATA": self.tasks[task_id][key], "marker": 0, "next_marker": None}

    # ------------------------------------------------------------ file operations

    def _query(self, request) -> dict:
        return {k: v[0] for k, v in parse_qs(urlparse(request.url).query).items()}

    def _ls(self, request, collection):
        query = self._query(request)
        try:
            real = self.path(collection, query["path"])
        except PermissionError:
            return self._error(403, "EndpointPermissionDenied", "Denied by endpoint")
        if not os.path.isdir(real):
            code = ("ClientError.NotFound" if not os.path.lexists(real)
                    else "ExternalError.DirListingFailed.NotDirectory")
            return self._error(404 if "NotFound" in code else 502, code, f"Directory '{query['path']}' not found")
        names = sorted(os.listdir(real))
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 100_000))
        page = [_doc(os.path.join(real, name)) for name in names[offset:offset + limit]]
        return 200, {"DATA_TYPE": "file_list", "DATA": page, "path": query["path"], "endpoint": collection,
                     "length": len(page), "total": len(names), "offset": offset, "limit": limit}

    def _stat(self, request, collection):
        try:
            real = self.path(collection, self._query(request)["path"])
        except PermissionError:
            return self._error(403, "EndpointPermissionDenied", "Denied by endpoint")
        if not os.path.lexists(real):
            return self._error(404, "NotFound", "Path not found\nMessage: No such file or directory")
        return 200, _doc(real)

    def _mkdir(self, request, collection):
        path = json.loads(request.body)["path"]
        try:
            real = self.path(collection, path)
        except PermissionError:
            return self._error(403, "EndpointPermissionDenied", "Denied by endpoint")
        if os.path.lexists(real):
            return self._error(502, "ExternalError.MkdirFailed.Exists", f"Path already exists: {path}")
        if not os.path.isdir(os.path.dirname(real)):
            return self._error(404, "ClientError.NotFound", f"Parent of {path} does not exist")
        os.mkdir(real)
        return 202, {"DATA_TYPE": "mkdir_result", "code": "DirectoryCreated", "message": "created"}


def _current(sync_level, source: str, target: str, st: os.stat_result) -> bool:
    """Whether sync_level (0 exists, 1 size, 2 mtime, 3 checksum; each adds to the last) skips this file."""
    level = _SYNC.get(sync_level, sync_level)
    if level is None or not os.path.isfile(target):
        return False
    other = os.stat(target)
    if level == "exists":
        return True
    if other.st_size != st.st_size:
        return False
    if level in ("size", "mtime"):
        return level == "size" or int(other.st_mtime) >= int(st.st_mtime)
    with open(source, "rb") as a, open(target, "rb") as b:
        return a.read() == b.read()


def _doc(real: str) -> dict:
    """An operation_ls/operation_stat document for a local path (symlinks show their target's type)."""
    link = os.readlink(real) if os.path.islink(real) else None
    try:
        st = os.stat(real)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
    except FileNotFoundError:
        st, kind = os.lstat(real), "invalid_symlink"
    modified = time.strftime("%Y-%m-%d %H:%M:%S+00:00", time.gmtime(st.st_mtime))
    return {"DATA_TYPE": "file", "name": os.path.basename(real), "type": kind, "size": st.st_size,
            "permissions": f"{stat.S_IMODE(st.st_mode):04o}", "last_modified": modified, "link_target": link,
            "user": "standin", "group": "standin"}
