#!/usr/bin/env python3
"""The DaemonSet's init container (deploy/k8s/kvhostd-daemonset.yaml) prepares
the socket directory on every pod start, not only the first on a node.

It runs the manifest's own command (read from the YAML, the mount path
replaced by a temporary directory) as root under exactly the capabilities its
securityContext grants (setpriv: bounding and inheritable sets of
capabilities.add only, no ambient capabilities, no_new_privs for
allowPrivilegeEscalation: false), twice in a row on a directory made as
kubelet makes a hostPath (root, 0755). Both runs must succeed and leave the
directory owned by the daemon's uid/gid with mode 0770. (The first version
chmod-ed after chown-ing on the second run: root without CAP_FOWNER may not
chmod a directory it does not own, so the second pod start on a node failed.)

Needs root (exit 77, which ctest reports as skipped, otherwise) and setpriv
(util-linux). Usage: k8s_init_container_test.py REPO_ROOT
"""
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import yaml

SKIP = 77


def main():
    root = sys.argv[1]
    path = os.path.join(root, "deploy/k8s/kvhostd-daemonset.yaml")
    if os.geteuid() != 0:
        print("SKIP: needs root (the init container runs as root with CAP_CHOWN only); "
              "run as root (CI does) to check it")
        return SKIP
    if shutil.which("setpriv") is None:
        print("SKIP: setpriv (util-linux) not found")
        return SKIP
    with open(path) as f:
        ds = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if c["name"] == "socket-dir")
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0, "the init container is expected to run as root"
    assert sc["capabilities"]["drop"] == ["ALL"], sc["capabilities"]
    caps = [c.lower() for c in sc["capabilities"]["add"]]
    mount = init["volumeMounts"][0]["mountPath"]
    daemon_uid = pod["securityContext"]["runAsUser"]
    daemon_gid = pod["securityContext"]["runAsGroup"]
    command = list(init["command"])

    work = tempfile.mkdtemp(prefix="kvhost-init.")
    try:
        target = os.path.join(work, "run-kvhost")
        os.mkdir(target)
        os.chown(target, 0, 0)
        os.chmod(target, 0o755)  # as kubelet creates a hostPath DirectoryOrCreate
        argv = [a.replace(mount, target) for a in command]
        assert argv != command, f"the command does not name its mount {mount}: {command}"
        capset = "-all," + ",".join("+" + c for c in caps)
        setpriv = ["setpriv", "--reuid=0", "--regid=0", "--clear-groups",
                   f"--bounding-set={capset}", f"--inh-caps={capset}"]
        if sc.get("allowPrivilegeEscalation") is False:
            setpriv.append("--no-new-privs")
        for run in (1, 2, 3):
            done = subprocess.run(setpriv + argv, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"FAIL: pod start {run}: the init container's command exited "
                      f"{done.returncode} under capabilities {caps}: {done.stderr.strip()}")
                print(f"  command: {argv}")
                return 1
            st = os.stat(target)
            got = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
            if got != (daemon_uid, daemon_gid, 0o770):
                print(f"FAIL: pod start {run}: the directory is uid {got[0]}, gid {got[1]}, "
                      f"mode {got[2]:04o}; wanted {daemon_uid}, {daemon_gid}, 0770")
                return 1
            print(f"ok: pod start {run}: {target} is {daemon_uid}:{daemon_gid} 0770")
            if run == 2:
                os.chmod(target, 0o755)  # changed by hand meanwhile: put right again
        # The capability set is the manifest's: without CAP_FOWNER root cannot
        # chmod what it does not own (else the runs above prove nothing).
        probe = subprocess.run(setpriv + ["chmod", "0700", target], capture_output=True)
        if probe.returncode == 0:
            print("FAIL: chmod of a directory root does not own succeeded under "
                  f"{caps}; the capability set is not reproduced")
            return 1
        print("ok: the capability set is the manifest's (no CAP_FOWNER)")
    finally:
        shutil.rmtree(work)
    print("k8s init container ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
