"""A throwaway provisioning target: this machine, with every path the roles write confined to one
test root, and loop devices standing in for NVMe disks. Everything is undone in :meth:`close`."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.host.loopdev import attach_loop

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
GROUP, GID = "memascend", 2300
HUGEPAGES_2M = 16


def tools_missing() -> str | None:
    """Why the real playbook run cannot happen here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (loop devices, sysctl, mounts)"
    for tool in (
        "ansible-playbook",
        "losetup",
        "parted",
        "blkid",
        "wipefs",
        "mkfs.ext4",
        "setpriv",
        "prlimit",
    ):
        if shutil.which(tool) is None:
            return f"needs {tool} (pip install ansible; apt-get install util-linux parted e2fsprogs)"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ansible_collections.ansible.posix, ansible_collections.community.general",
        ],
        capture_output=True,
    )
    if probe.returncode != 0:
        return "needs the ansible.posix and community.general collections (pip install ansible)"
    return None


class Sandbox:
    """Test root, loop disks, inventory and variables for one provisioning target."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.loops: list[str] = []
        self.notes: list[str] = []
        self.nr_hugepages_before = Path("/proc/sys/vm/nr_hugepages").read_text().strip()
        Path("/proc/sys/vm/nr_hugepages").write_text("0")  # start unprovisioned; restored in close()
        self.group_existed = _group_exists(GROUP)
        self.user = "memascend-doctor-test"
        self.user_created = False
        self.runner_user = "memascend-runner-test"  # made by the runner role; removed in close()
        self.runner_user_existed = _user_exists(self.runner_user)
        # The runner's venv must be reachable by its user: not under pytest's 0700 temporary folders.
        self.runner_root = Path(tempfile.mkdtemp(prefix="memascend-runner-test.", dir="/var/tmp"))
        self.runner_root.chmod(0o755)
        self.mount_path = root / "mnt" / "hugepages"
        # Every host has an fstab (ansible.posix.mount creates a missing one, even in check mode).
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc" / "fstab").touch()
        self.inventory = root / "inventory.yml"
        self.inventory.write_text(
            "memascend:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
            f"      ansible_python_interpreter: {sys.executable}\n"
        )

    def loop_disk(self, name: str, size_bytes: int = 64 << 20) -> str:
        """A new partition-scanning loop device over a sparse file; detached in :meth:`close`."""
        dev = attach_loop(self.root / f"{name}.img", size_bytes)
        self.loops.append(dev)
        return dev

    def variables(self, disks: list[str], allow_wipe: list[str] = (), extra: dict | None = None) -> Path:
        """The roles' variables for this sandbox (``extra`` added or overriding), as a file for ``-e @FILE``."""
        path = self.root / f"vars-{len(list(self.root.glob('vars-*.json')))}.json"
        path.write_text(json.dumps(self.host_values(disks, allow_wipe, extra)))
        return path

    def host_values(self, disks: list[str], allow_wipe: list[str] = (), extra: dict | None = None,
                    root: Path | None = None) -> dict[str, object]:
        """The roles' variables of one target whose files all lie under ``root`` (default: the test
        root; a folder of it for each "host" of a group, see :meth:`host_root`)."""
        r = self.root if root is None else root
        values = {
            "nvme_raw_devices": disks,
            "nvme_raw_allow_wipe": list(allow_wipe),
            "nvme_raw_udev_rules_dir": f"{r}/etc/udev/rules.d",
            "nvme_raw_udev_reload": False,  # no udevd in this sandbox; the role also sets the node's group
            "hugepages_count_2m": HUGEPAGES_2M,
            "hugepages_sysctl_file": f"{r}/etc/sysctl.d/80-memascend-hugepages.conf",
            "hugepages_mount_path": str(r / "mnt" / "hugepages"),
            "hugepages_fstab": f"{r}/etc/fstab",
            "hugepages_grub_dropin_dir": f"{r}/etc/default/grub.d",
            "hugepages_count_1g": 1,
            "hugepages_grub_update_command": "true",  # no bootloader here; the drop-in file is checked instead
            "memlock_limits_file": f"{r}/etc/security/limits.d/80-memascend-memlock.conf",
            "memlock_systemd_conf_dir": f"{r}/etc/systemd/system.conf.d",
            "memlock_docker_daemon_json": f"{r}/etc/docker/daemon.json",
            "memlock_docker_restart": False,
            "memlock_systemd_reexec": False,
            "gpu_runtime_install_packages": False,
            "gpu_runtime_check_driver": False,
            "gpu_runtime_docker_daemon_json": f"{r}/etc/docker/daemon.json",
            "gpu_runtime_restart_engine": False,
        }
        values.update(extra or {})
        return values

    def host_root(self, name: str) -> Path:
        """The folder under the test root that one "host" of a group writes its files to."""
        root = self.root / name
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc" / "fstab").touch()
        return root

    def group_inventory(self, group: str, hosts: dict[str, dict[str, object]]) -> Path:
        """An inventory with ``group`` of several "hosts", all this machine (``ansible_connection:
        local``), each with its own variables (host vars, as an operator's host_vars hold a host's
        disks); returns its path for ``-i``."""
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        path = self.root / f"inventory-{group}.yml"
        path.write_text(json.dumps({group: {"hosts": {name: {**local, **v} for name, v in hosts.items()}}}))
        return path

    def playbook(self, variables: Path | None, *tags: str, check: bool = False, inventory: Path | None = None,
                 args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        """Run site.yml against the sandbox (``check``: a dry run, ``--check --diff``, as
        ``just provision HOST --check`` passes it; ``inventory``: another than the one-host one,
        ``variables`` then ``None`` when the hosts carry theirs; ``args``: more ansible-playbook
        flags); returns the finished process (output in stdout)."""
        cmd = ["ansible-playbook", "-i", str(inventory or self.inventory), "site.yml", *args]
        if variables is not None:
            cmd += ["-e", f"@{variables}"]
        if tags:
            cmd += ["--tags", ",".join(tags)]
        if check:
            cmd += ["--check", "--diff"]
        env = {**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"}
        return subprocess.run(cmd, cwd=ANSIBLE_DIR, capture_output=True, text=True, env=env, timeout=600)

    def add_group_member(self) -> None:
        """A throwaway user in the memascend group, for checking device access as a non-root user."""
        if not _user_exists(self.user):
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", GROUP, self.user],
                check=True,
            )
            self.user_created = True

    def doctor(self, *args: str, limits_file: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``memascend doctor --json`` as a login without CAP_IPC_LOCK would see the host.

        ``limits_file`` emulates pam_limits: its memlock value is applied with prlimit; without it
        the limit is 64 KiB, an unprovisioned Debian default. Where the sandbox's own hard limit
        cannot be raised (no CAP_SYS_RESOURCE, as in this container), the provisioned run keeps
        CAP_IPC_LOCK instead, which is what ``--cap-add IPC_LOCK`` gives a container.
        """
        memlock = "65536"
        if limits_file is not None:
            value = _limits_memlock_kib(limits_file)
            memlock = "unlimited" if value == "unlimited" else str(int(value) * 1024)
        limit = ["prlimit", f"--memlock={memlock}:{memlock}", "--"]
        drop_cap = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
        if subprocess.run([*limit, "true"], capture_output=True).returncode != 0:
            self.notes.append(f"cannot set RLIMIT_MEMLOCK={memlock} here; doctor keeps CAP_IPC_LOCK")
            limit, drop_cap = [], []
        cmd = [*drop_cap, *limit, sys.executable, "-m", "memascend", "doctor", "--json", "--no-gpu", *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)

    def run_as(self, user: str, argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float,
               limits_file: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as ``user`` (its own groups, no capabilities) with exactly ``env``.

        ``limits_file`` emulates pam_limits at the user's login, as :meth:`doctor` does: its
        memlock value is applied with prlimit, or, where this sandbox cannot raise its hard limit,
        the user keeps CAP_IPC_LOCK instead (an ambient capability, what ``--cap-add IPC_LOCK``
        gives a container). This machine's Python lives under root's home (0700), which a real
        runner's does not: the command then runs in a private mount namespace whose ``/root`` is a
        0711 tmpfs with root's entries bound back, so the user may pass through it; the host's
        ``/root`` is left as it is.
        """
        lift, caps = [], []
        if limits_file is not None:
            value = _limits_memlock_kib(limits_file)
            memlock = "unlimited" if value == "unlimited" else str(int(value) * 1024)
            lift = ["prlimit", f"--memlock={memlock}:{memlock}", "--"]
            if subprocess.run([*lift, "true"], capture_output=True).returncode != 0:
                self.notes.append(f"cannot set RLIMIT_MEMLOCK={memlock} here; {user} keeps CAP_IPC_LOCK")
                lift, caps = [], ["--inh-caps=+ipc_lock", "--ambient-caps=+ipc_lock"]
        drop = [*lift, "setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *caps, "env", "-i",
                *(f"{k}={v}" for k, v in env.items()), *argv]
        if not (Path(sys.executable).resolve().is_relative_to("/root") and os.stat("/root").st_mode & 0o001 == 0):
            return subprocess.run(drop, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        traversable_root = (
            'set -e; keep=$(mktemp -d); mount --bind /root "$keep"; mount -t tmpfs -o mode=0711 tmpfs /root; '
            'for e in "$keep"/.[!.]* "$keep"/*; do [ -e "$e" ] || continue; n=/root/${e##*/}; '
            'if [ -d "$e" ]; then mkdir "$n"; else touch "$n"; fi; mount --bind "$e" "$n"; done; exec "$@"'
        )
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", traversable_root, "sh", *drop]
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)

    def snapshot(self) -> dict[str, object]:
        """What provisioning changes on this target: per loop disk its signatures (``blkid -p``), the
        sha256 of its first and last MiB (MBR/GPT and GPT's backup) and whether a partition node
        exists; the huge page counts in procfs and sysfs; the hugetlbfs mount; the group; every file
        under the test root's etc/."""
        disks = {}
        for dev in self.loops:
            probe = subprocess.run(["blkid", "-p", "-o", "export", dev], capture_output=True, text=True)
            with open(dev, "rb") as f:
                head = hashlib.sha256(f.read(1 << 20)).hexdigest()
                f.seek(-(1 << 20), os.SEEK_END)
                tail = hashlib.sha256(f.read(1 << 20)).hexdigest()
            disks[dev] = (probe.returncode, probe.stdout, head, tail, os.path.exists(dev + "p1"))
        sysfs = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
        etc = self.root / "etc"
        return {
            "disks": disks,
            "nr_hugepages": Path("/proc/sys/vm/nr_hugepages").read_text(),
            "sysfs_nr_hugepages_2m": sysfs.read_text() if sysfs.exists() else None,
            "mounted": os.path.ismount(self.mount_path),
            "mount_path_exists": self.mount_path.exists(),
            "group": _group_exists(GROUP),
            "etc_files": sorted(str(p.relative_to(etc)) for p in etc.rglob("*")) if etc.exists() else [],
        }

    def close(self) -> None:
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in reversed(mounts):  # the hugetlbfs mounts of every "host" under the test root
            if Path(mount).is_relative_to(self.root):
                subprocess.run(["umount", mount], check=False)
        for dev in self.loops:
            subprocess.run(["losetup", "--detach", dev], check=False)
        for image in self.root.glob("*.img"):  # sparse, but a run may have filled GiBs of one
            image.unlink()
        Path("/proc/sys/vm/nr_hugepages").write_text(self.nr_hugepages_before)
        if self.user_created:
            subprocess.run(["userdel", self.user], check=False)
        if not self.runner_user_existed and _user_exists(self.runner_user):
            subprocess.run(["userdel", "--remove", self.runner_user], check=False, capture_output=True)
        shutil.rmtree(self.runner_root, ignore_errors=True)
        if not self.group_existed and _group_exists(GROUP):
            subprocess.run(["groupdel", GROUP], check=False)


def recap(output: str, host: str = "localhost") -> dict[str, int]:
    """The PLAY RECAP counters of ``host``, e.g. ``{"ok": 35, "changed": 0, "failed": 0, ...}``."""
    line = next(line for line in output.splitlines() if line.split(" ", 1)[0] == host and "ok=" in line)
    return {k: int(v) for k, v in (field.split("=") for field in line.split(":", 1)[1].split())}


def _limits_memlock_kib(path: Path) -> str:
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[0] == "*" and fields[1] == "soft" and fields[2] == "memlock":
            return fields[3]
    raise AssertionError(f"no '* soft memlock' line in {path}")


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
