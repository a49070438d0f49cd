"""A local HTTP test double of the few Kubernetes API endpoints the launcher calls.

No Kubernetes API server can run on these machines, so this stands in for one on loopback; the launcher
talks to it through the real `kubernetes` client and a real kubeconfig file. Like the real server it
validates TrainJobs and TrainingRuntimes against their CRD schemas (422 when invalid), refuses a name
that exists (409), answers 404 for what is missing and 403 in a namespace marked forbidden. A
StatefulSet it creates is at once fully ready, as a cluster whose pods pass their probes would make it.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import jsonschema

from tests.launchers import crds

CUSTOM = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[a-z]+)"
    r"(?:/(?P<name>[^/]+))?(?P<status>/status)?$"
)
CORE = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>configmaps|secrets|services|pods)(?:/(?P<name>[^/]+))?"
    r"(?P<log>/log)?$"
)
KINDS = {
    "trainjobs": "TrainJob",
    "trainingruntimes": "TrainingRuntime",
    "clustertrainingruntimes": "ClusterTrainingRuntime",
}


class _Handler(BaseHTTPRequestHandler):
    """The API server's routes over the fake's objects (`self.server.fake`)."""

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict | str):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length", 0))
        return json.loads(self.rfile.read(length)) if length else {}

    def _status(self, code: int, reason: str, message: str):
        self._send(
            code,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": reason,
                "message": message,
                "code": code,
            },
        )

    def _handle(self, method: str):
        server = self.server.fake
        url = urlparse(self.path)
        server.requests.append((method, url.path))
        m = CUSTOM.match(url.path) or CORE.match(url.path)
        if not m:
            return self._status(404, "NotFound", f"no route {url.path}")
        ns, plural, name = m.group("ns") or "", m.group("plural"), m.group("name")
        if ns in server.forbidden_namespaces:
            return self._status(403, "Forbidden", f'{plural} is forbidden in namespace "{ns}"')
        key = (plural, ns, name)
        if method == "POST":
            return self._create(server, plural, ns)
        if name is None:  # list
            return self._list(server, plural, ns, url)
        if key not in server.objects:
            return self._status(404, "NotFound", f'{plural} "{name}" not found')
        if m.groupdict().get("log"):
            return self._send(200, server.logs.get(name, ""))
        if method == "GET":
            return self._send(200, server.objects[key])
        if method == "PATCH":
            patch = self._body()
            server.objects[key]["metadata"].update(patch.get("metadata", {}))
            return self._send(200, server.objects[key])
        if method == "DELETE":
            del server.objects[key]
            for owned in [
                k
                for k, o in server.objects.items()
                if any(r.get("name") == name for r in o["metadata"].get("ownerReferences", []))
            ]:
                del server.objects[owned]
            return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
        return self._status(405, "MethodNotAllowed", method)

    def _create(self, server, plural: str, ns: str):
        body = self._body()
        name = body["metadata"]["name"]
        if (plural, ns, name) in server.objects:
            return self._status(409, "AlreadyExists", f'{plural} "{name}" already exists')
        if plural in KINDS:
            try:
                crds.validate(body)
            except (jsonschema.ValidationError, AssertionError) as e:
                return self._status(422, "Invalid", f"{KINDS[plural]} {name!r} is invalid: {e}")
        body["metadata"]["uid"] = str(uuid.uuid4())
        if plural == "statefulsets":  # the cluster starts its pods, and their probes pass
            replicas = body["spec"]["replicas"]
            body["status"] = {"replicas": replicas, "readyReplicas": replicas}
        server.objects[(plural, ns, name)] = body
        if plural == "trainjobs" and server.on_trainjob:
            server.on_trainjob(body)
        return self._send(201, body)

    def _list(self, server, plural: str, ns: str, url):
        selector = parse_qs(url.query).get("labelSelector", [""])[0]
        wanted = dict(p.split("=", 1) for p in selector.split(",") if p)
        items = [
            o
            for (p, n, _), o in server.objects.items()
            if p == plural
            and n == ns
            and all(o["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]
        return self._send(200, {"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_DELETE(self):
        self._handle("DELETE")


class FakeApiServer:
    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.logs: dict[str, str] = {}
        self.forbidden_namespaces: set[str] = set()
        # Called with each TrainJob created: a test can play the cluster (finish it, write its outputs).
        self.on_trainjob = None
        self.requests: list[tuple[str, str]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.fake = self  # what _Handler serves
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "dev", "user": {"token": "t0ken"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev"}}],
                },
                f,
            )
        return path

    def add_pod(self, namespace: str, job: str, node: int, phase: str, log: str = "", role: str = "node",
                container: dict | None = None) -> None:
        """A pod of `job`'s replicated job `role`, index `node`; `container`: its container `node`'s spec."""
        name = f"{job}-{role}-{node}-0-abcde"
        self.objects[("pods", namespace, name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"jobset.sigs.k8s.io/jobset-name": job, "jobset.sigs.k8s.io/job-index": str(node),
                           "jobset.sigs.k8s.io/replicatedjob-name": role},
            },
            "status": {"phase": phase},
            **({"spec": {"containers": [{"name": "node", "image": "trainjob", **container}]}} if container else {}),
        }
        self.logs[name] = log

    def set_conditions(self, namespace: str, job: str, **conditions: str) -> None:
        self.objects[("trainjobs", namespace, job)]["status"] = {
            "conditions": [
                {"type": t, "status": s, "reason": t, "message": t, "lastTransitionTime": "2026-11-29T00:00:00Z"}
                for t, s in conditions.items()
            ]
        }
