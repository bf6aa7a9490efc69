#!/usr/bin/env python3
"""Checks the Kubernetes manifests under deploy/k8s/ for the fields kvhostd
needs to work there, and starts the built kvhostd with the ConfigMap's flag
file and with the sidecar's arguments to prove kvhostd knows every flag.

What it checks (each check prints a line; the first failure names the
manifest and the field, and the script exits 1):
- every YAML document under deploy/k8s/ and deploy/k8s/examples/ parses;
- `kubectl apply -f deploy/k8s/` works on a fresh cluster: in the order
  kubectl applies them (files by name, documents in file order), every
  namespaced object's Namespace is defined before it (examples/ files, applied
  one by one, each on its own);
- the socket mode is the same wherever it is stated: flags, comments and
  config files under deploy/, docs/OPERATIONS.md, and kvhostd's default;
- the DaemonSet: a priority class defined here; a startup probe that waits
  at least the systemd unit's TimeoutStartSec; readiness failureThreshold >= 3;
  hostIPC true; the socket volume mounted at /run/kvhost in the
  kvhostd container; liveness and readiness probes; memory requests and
  limits; IPC_LOCK in capabilities.add; --flagfile naming a file inside the
  mounted ConfigMap, whose key exists in the ConfigMap;
- the ConfigMap's flag file: kvhostd starts with it (an unknown flag makes
  kvhostd exit at once: 1 for a name it does not know, 2 for a bad value);
- the sidecar Pod (examples/): both containers mount the same socket volume,
  /dev/shm is an emptyDir with medium Memory and a sizeLimit, the kvhostd
  container has probes and memory limits, and kvhostd starts with its
  arguments.

Usage: k8s_manifests_test.py KVHOSTD REPO_ROOT   (needs python3-yaml)
"""
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import yaml

SOCKET_DIR = "/run/kvhost"
ROOT = None  # the repository's root, set by main()


class CheckFailed(Exception):
    pass


def check(condition, manifest, field, what):
    """Prints what was checked; raises naming the manifest and the field."""
    if not condition:
        raise CheckFailed(f"FAIL {manifest}: {field}: {what}")
    print(f"ok   {manifest}: {field}: {what}")


def load_documents(k8s_dir):
    """{manifest file name: [documents]} for every *.yaml / *.yml there, in
    name order (the order `kubectl apply -f DIR` applies them)."""
    files = sorted(glob.glob(os.path.join(k8s_dir, "*.yaml")) +
                   glob.glob(os.path.join(k8s_dir, "*.yml")))
    if not files:
        raise CheckFailed(f"FAIL {k8s_dir}: no YAML files")
    docs = {}
    for path in files:
        name = os.path.basename(path)
        try:
            with open(path, encoding="utf-8") as f:
                parsed = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            raise CheckFailed(f"FAIL {name}: not valid YAML: {e}")
        check(parsed and all(isinstance(d, dict) and "kind" in d for d in parsed), name,
              "documents", f"{len(parsed)} document(s), each with a kind")
        docs[name] = parsed
    return docs


# Kinds that live in no namespace, and namespaces every cluster has.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "RuntimeClass", "PriorityClass", "CustomResourceDefinition",
                  "Node", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
BUILTIN_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease"}


def check_namespace_order(units):
    """`units`: lists of (manifest, documents) applied in one kubectl call
    each, in kubectl's order. Every namespaced object's Namespace must be
    defined before it within its unit (a fresh cluster has only the builtin
    ones)."""
    for unit in units:
        defined = set(BUILTIN_NAMESPACES)
        for manifest, documents in unit:
            for d in documents:
                meta = d.get("metadata") or {}
                if d["kind"] == "Namespace":
                    defined.add(meta.get("name"))
                    continue
                if d["kind"] in CLUSTER_SCOPED:
                    continue
                ns = meta.get("namespace", "default")
                check(ns in defined, manifest, f"{d['kind']} {meta.get('name')}.metadata.namespace",
                      f"'{ns}' defined before it in apply order "
                      f"({' -> '.join(m for m, _ in unit)})")


# Statements of the socket's mode, in flags, YAML and prose. Each captures
# the octal mode.
SOCKET_MODE_PATTERNS = [
    r"--socket[-_]mode`?[= ]+`?(0[0-7]{3})\b",                        # --socket_mode=0660
    r"--socket[-_]mode`?\s*\((?:octal,\s*)?default\s*`?(0[0-7]{3})\b",  # --socket-mode (default 0660)
    r"\bsocket_mode:\s*[\"']?(0[0-7]{3})\b",                           # socket_mode: "0660"
    r"\bthe socket(?: file)? is\s+`?(0[0-7]{3})\b",                     # the socket is 0660
    r"\(socket\s+`?(0[0-7]{3})\b",                                     # (socket `0660`)
    r"\bsocket \S+: mode (0[0-7]{3})\b",                               # the start log line
]


def check_socket_mode(root, kvhostd):
    """The socket mode is one value wherever it is stated."""
    help_text = subprocess.run([kvhostd, "--help"], capture_output=True, text=True).stdout
    m = re.search(r'--socket-mode \(default: "(0[0-7]{3})"\)', help_text)
    check(m is not None, "kvhostd --help", "--socket-mode", "a default is shown")
    default = m.group(1)
    paths = [p for p in glob.glob(os.path.join(root, "deploy", "**", "*"), recursive=True)
             if os.path.isfile(p)]
    paths.append(os.path.join(root, "docs", "OPERATIONS.md"))
    found = []
    for path in sorted(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for pattern in SOCKET_MODE_PATTERNS:
            for hit in re.finditer(pattern, text, re.IGNORECASE):
                line = text.count("\n", 0, hit.start()) + 1
                found.append((os.path.relpath(path, root), line, hit.group(1)))
    # The places known to state it; fewer means the patterns no longer see them.
    check(len(found) >= 8, "deploy/, docs/OPERATIONS.md", "socket mode statements",
          f"{len(found)} found")
    for where, line, mode in found:
        check(mode == default, f"{where}:{line}", "socket mode",
              f"{mode} (kvhostd's default {default})")


def find(docs, kind, name=None):
    """(manifest, document) of the one object of `kind` (and `name`)."""
    hits = [(m, d) for m, ds in docs.items() for d in ds
            if d.get("kind") == kind and (name is None or d.get("metadata", {}).get("name") == name)]
    if len(hits) != 1:
        raise CheckFailed(f"FAIL deploy/k8s: want exactly one {kind}"
                          f"{' ' + name if name else ''}, found {len(hits)}")
    return hits[0]


def container(manifest, pod_spec, name):
    for c in pod_spec.get("containers", []):
        if c.get("name") == name:
            return c
    raise CheckFailed(f"FAIL {manifest}: spec.containers: no container '{name}'")


def inference_container(manifest, pod_spec):
    others = [c for c in pod_spec.get("containers", []) if c.get("name") != "kvhostd"]
    if len(others) != 1:
        raise CheckFailed(f"FAIL {manifest}: spec.containers: want one container besides "
                          f"kvhostd, found {len(others)}")
    return others[0]


def volume(manifest, pod_spec, name):
    for v in pod_spec.get("volumes", []):
        if v.get("name") == name:
            return v
    raise CheckFailed(f"FAIL {manifest}: spec.volumes: no volume '{name}'")


def mount_at(c, path):
    """The volumeMount of container `c` at `path`, or None."""
    for m in c.get("volumeMounts", []):
        if os.path.normpath(m.get("mountPath", "")) == path:
            return m
    return None


def check_probes_and_memory(manifest, c, where):
    for probe in ("livenessProbe", "readinessProbe"):
        p = c.get(probe) or {}
        handlers = [h for h in ("exec", "grpc", "httpGet", "tcpSocket") if h in p]
        check(len(handlers) == 1, manifest, f"{where}.{probe}", f"present ({handlers})")
        if "exec" in p:
            cmd = p["exec"].get("command", [])
            check(any(a.startswith("--server=unix://" + SOCKET_DIR + "/") for a in cmd) and
                  "health" in cmd, manifest, f"{where}.{probe}.exec.command",
                  "kvhostctl health (exit 0 only when SERVING) through the unix socket")
    res = c.get("resources", {})
    for part in ("requests", "limits"):
        check(bool((res.get(part) or {}).get("memory")), manifest,
              f"{where}.resources.{part}.memory", f"set ({(res.get(part) or {}).get('memory')})")
    add = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
    check("IPC_LOCK" in add, manifest, f"{where}.securityContext.capabilities.add",
          f"IPC_LOCK in {add}")


def kvhostd_args(c):
    """The arguments kvhostd gets: `args`, after the shell wrapper if any."""
    return [str(a) for a in c.get("args", [])]


def start_kvhostd(kvhostd, args, manifest, field):
    """Runs kvhostd with the manifest's arguments, the socket and shm dir
    moved to a temp dir and --backend=host (no GPU here); checks that it
    serves, then stops it with SIGTERM and checks it exits 0. The manifest's
    --log-level is kept, so a bad level fails too (kvhostd's log is captured
    and shown only on failure)."""
    with tempfile.TemporaryDirectory(prefix="kvhost-k8s.") as tmp:
        sock = os.path.join(tmp, "s.sock")
        cmd = [kvhostd] + args + [f"--listen=unix://{sock}",
                                  f"--shm-dir={tmp}", "--backend=host"]
        print(f"     running: {shlex.join(cmd)}")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None and not os.path.exists(sock):
            time.sleep(0.05)
        started = proc.poll() is None and os.path.exists(sock)
        if started:
            time.sleep(0.5)  # a flag problem would have ended it by now
            started = proc.poll() is None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        output = proc.stdout.read().decode(errors="replace").strip()
        if not started:
            raise CheckFailed(f"FAIL {manifest}: {field}: kvhostd did not start with these "
                              f"flags (exit code {proc.returncode}): {output}")
        check(proc.returncode == 0, manifest, field,
              f"kvhostd started, served on the socket and exited {proc.returncode} on SIGTERM")


def check_start_and_priority(docs, manifest, spec, c, cw):
    """The startup probe waits at least as long as the systemd unit's
    TimeoutStartSec; readiness survives one slow answer; the pod's priority
    class is one the directory defines (or a built-in system one)."""
    unit = os.path.join(ROOT, "deploy", "systemd", "kvhostd.service")
    with open(unit, encoding="utf-8") as f:
        m = re.search(r"^TimeoutStartSec=(\d+)s?$", f.read(), re.MULTILINE)
    check(m is not None, "deploy/systemd/kvhostd.service", "TimeoutStartSec", "set in seconds")
    unit_start = int(m.group(1))
    startup = c.get("startupProbe") or {}
    waits = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    check(waits >= unit_start, manifest, f"{cw}.startupProbe",
          f"periodSeconds x failureThreshold = {waits} s >= the systemd unit's {unit_start} s")
    ready = (c.get("readinessProbe") or {}).get("failureThreshold", 3)
    check(ready >= 3, manifest, f"{cw}.readinessProbe.failureThreshold", f"{ready} >= 3")
    name = spec.get("priorityClassName")
    defined = [d["metadata"]["name"] for docs_of in docs.values() for d in docs_of
               if d["kind"] == "PriorityClass"]
    check(name in defined or name in ("system-node-critical", "system-cluster-critical"),
          manifest, "spec.template.spec.priorityClassName",
          f"a PriorityClass defined under deploy/k8s ({name}; defined: {defined})")


def check_daemonset(docs, kvhostd):
    manifest, ds = find(docs, "DaemonSet")
    spec = ds.get("spec", {}).get("template", {}).get("spec", {})
    where = "spec.template.spec"
    check(spec.get("hostIPC") is True, manifest, f"{where}.hostIPC", "true")
    c = container(manifest, spec, "kvhostd")
    cw = f"{where}.containers[kvhostd]"

    m = mount_at(c, SOCKET_DIR)
    check(m is not None, manifest, f"{cw}.volumeMounts", f"a volume mounted at {SOCKET_DIR}")
    v = volume(manifest, spec, m["name"])
    check((v.get("hostPath") or {}).get("path") == SOCKET_DIR, manifest,
          f"{where}.volumes[{m['name']}].hostPath.path", f"{SOCKET_DIR} (shared with the node's pods)")

    shm = mount_at(c, "/dev/shm")
    check(shm is not None, manifest, f"{cw}.volumeMounts", "a volume mounted at /dev/shm")
    check((volume(manifest, spec, shm["name"]).get("hostPath") or {}).get("path") == "/dev/shm",
          manifest, f"{where}.volumes[{shm['name']}].hostPath.path", "/dev/shm (the host's)")

    check_probes_and_memory(manifest, c, cw)
    check_start_and_priority(docs, manifest, spec, c, cw)

    args = kvhostd_args(c)
    flagfiles = [a.split("=", 1)[1] for a in args if a.startswith("--flagfile=")]
    check(len(flagfiles) == 1, manifest, f"{cw}.args", f"one --flagfile ({flagfiles})")
    flagfile = os.path.normpath(flagfiles[0])
    cm_mount = mount_at(c, os.path.dirname(flagfile))
    check(cm_mount is not None, manifest, f"{cw}.volumeMounts",
          f"a volume mounted at {os.path.dirname(flagfile)}, the --flagfile's directory")
    cm_name = (volume(manifest, spec, cm_mount["name"]).get("configMap") or {}).get("name")
    check(bool(cm_name), manifest, f"{where}.volumes[{cm_mount['name']}].configMap.name",
          f"a ConfigMap ({cm_name})")
    cm_manifest, cm = find(docs, "ConfigMap", cm_name)
    key = os.path.basename(flagfile)
    flags_text = (cm.get("data") or {}).get(key)
    check(isinstance(flags_text, str) and flags_text.strip() != "", cm_manifest,
          f"data.{key}", f"the flag file --flagfile={flagfile} names")

    with tempfile.TemporaryDirectory(prefix="kvhost-k8s-flags.") as tmp:
        path = os.path.join(tmp, key)
        with open(path, "w", encoding="utf-8") as f:
            f.write(flags_text)
        start_kvhostd(kvhostd, [a if not a.startswith("--flagfile=") else f"--flagfile={path}"
                                for a in args], cm_manifest,
                      f"data.{key} (with the DaemonSet's args)")


def check_sidecar(docs, kvhostd):
    pods = [(m, d) for m, ds in docs.items() for d in ds if d.get("kind") == "Pod"]
    check(len(pods) == 1, "deploy/k8s/examples", "kind: Pod", "one sidecar example")
    manifest, pod = pods[0]
    spec = pod.get("spec", {})
    kv = container(manifest, spec, "kvhostd")
    app = inference_container(manifest, spec)

    sock_kv = mount_at(kv, SOCKET_DIR)
    sock_app = mount_at(app, SOCKET_DIR)
    check(sock_kv is not None and sock_app is not None, manifest,
          "spec.containers[*].volumeMounts", f"both containers mount {SOCKET_DIR}")
    check(sock_kv["name"] == sock_app["name"], manifest, "spec.containers[*].volumeMounts",
          f"the same socket volume ({sock_kv['name']})")
    check("emptyDir" in volume(manifest, spec, sock_kv["name"]), manifest,
          f"spec.volumes[{sock_kv['name']}]", "an emptyDir")

    shm_kv = mount_at(kv, "/dev/shm")
    shm_app = mount_at(app, "/dev/shm")
    check(shm_kv is not None and shm_app is not None and shm_kv["name"] == shm_app["name"],
          manifest, "spec.containers[*].volumeMounts", "both containers mount one /dev/shm volume")
    shm = volume(manifest, spec, shm_kv["name"]).get("emptyDir") or {}
    check(shm.get("medium") == "Memory", manifest, f"spec.volumes[{shm_kv['name']}].emptyDir.medium",
          "Memory")
    check(bool(shm.get("sizeLimit")), manifest, f"spec.volumes[{shm_kv['name']}].emptyDir.sizeLimit",
          f"set ({shm.get('sizeLimit')})")

    check_probes_and_memory(manifest, kv, "spec.containers[kvhostd]")
    start_kvhostd(kvhostd, kvhostd_args(kv), manifest, "spec.containers[kvhostd].args")


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    global ROOT
    kvhostd, root = sys.argv[1], sys.argv[2]
    ROOT = root
    if not os.access(kvhostd, os.X_OK):
        print(f"FAIL {kvhostd} is not an executable", file=sys.stderr)
        return 1
    try:
        k8s = os.path.join(root, "deploy", "k8s")
        applied = load_documents(k8s)
        examples = load_documents(os.path.join(k8s, "examples"))
        check_namespace_order([list(applied.items())] +
                              [[(f"examples/{m}", ds)] for m, ds in examples.items()])
        check_socket_mode(root, kvhostd)
        check_daemonset(applied, kvhostd)
        check_sidecar({f"examples/{m}": ds for m, ds in examples.items()}, kvhostd)
    except CheckFailed as e:
        print(e, file=sys.stderr)
        return 1
    print("k8s manifests ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
