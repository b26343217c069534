#!/usr/bin/env python3
"""Run the shared-store scenarios over a real NFS mount, inside a throwaway VM.

    python tools/nfs_harness.py            # build (first run) or reuse the VM assets, boot, run, report
    python tools/nfs_harness.py --keep     # keep the run directory (console log, results) afterwards
    python tools/nfs_harness.py --json     # one JSON object on stdout (the results), progress on stderr
    python tools/nfs_harness.py -- --only packed   # arguments after -- go to tools/nfs/scenarios.py

docs/nfs-harness.md says how: a Debian kernel under ``qemu-system-x86_64``, its root this host's
own shared over virtio-9p, the NFS server's packages layered on with overlayfs, the assets cached
under ``.nfs-harness/``. Exit status: 0 when every scenario passed or the harness skipped
(``skipped: ...``: no ``/dev/kvm`` or no qemu); 1 when a scenario failed or the VM did not finish;
2 on bad usage or assets that could not be built. ``NFS_HARNESS_KVM`` and ``NFS_HARNESS_QEMU``
override the device and the qemu binary.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".nfs-harness"
#: Bump when what ends up in the cached assets changes.
ASSET_FORMAT = 2

#: Packages whose files the guest needs on top of this host's own (deps resolved against this host).
GUEST_PACKAGES = ("nfs-kernel-server",)
#: Kernel modules loaded in the initramfs, with everything they depend on.
#: veth: the claims scenario joins a second NFS client (a network namespace) to the server.
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "nfsd", "nfsv4", "nfsv3", "veth")
#: Top-level host directories the guest root is built from (besides Python and the repo).
HOST_TOP = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Of those, the ones the guest writes (guest.sh writes /etc/exports): writable over a tmpfs even
#: when the host has every package, so that no package's files were layered over them.
WRITABLE_TOP = ("etc",)

INIT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /ctl
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
for m in $(cat /modules/order); do insmod /modules/$m || echo "nfsh: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 ctl /ctl || { echo "nfsh: no ctl share"; poweroff -f; }
exec sh /ctl/stage1.sh
"""


class Skip(Exception):
    """The harness cannot run here; not a failure."""


class AssetError(Exception):
    """The VM assets could not be built."""


#: Where progress goes: stdout, or stderr under --json (stdout then holds one JSON object).
_progress = {"to": sys.stdout}


def log(msg: str) -> None:
    print(f"nfs-harness: {msg}", file=_progress["to"], flush=True)


# -- preconditions ---------------------------------------------------------------


def find_qemu_and_kvm() -> tuple[str, str]:
    kvm = os.environ.get("NFS_HARNESS_KVM", "/dev/kvm")
    if not os.path.exists(kvm):
        raise Skip(f"{kvm} is missing (no hardware virtualization for qemu -enable-kvm)")
    if not os.access(kvm, os.R_OK | os.W_OK):
        raise Skip(f"{kvm} is not readable and writable by this user")
    qemu = os.environ.get("NFS_HARNESS_QEMU") or shutil.which("qemu-system-x86_64")
    if not qemu or not os.access(qemu, os.X_OK):
        raise Skip("qemu-system-x86_64 not found (Debian: apt-get install --no-install-recommends qemu-system-x86)")
    return qemu, kvm


# -- assets: kernel, modules, initramfs, guest packages --------------------------------


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AssetError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc.stdout


def _apt(*args: str, cwd: Path | None = None) -> str:
    if not shutil.which("apt-get"):
        raise AssetError("apt-get not found: the VM assets are fetched from Debian's archive")
    return _run(["apt-get", "-q", "-o", "APT::Sandbox::User=root", *args], cwd=cwd)


def kernel_package() -> str:
    out = _run(["apt-cache", "depends", "linux-image-amd64"])
    found = re.findall(r"Depends: (linux-image-\S+-amd64)\b", out)
    if not found:
        raise AssetError(f"cannot tell which kernel linux-image-amd64 depends on:\n{out}")
    return found[0]


def _modinfo(path: Path) -> dict[str, str]:
    """The ``key=value`` strings of a kernel module's ``.modinfo`` section (ELF64, little-endian)."""
    data = path.read_bytes()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx]
    names = data[strtab[4] : strtab[4] + strtab[5]]
    info: dict[str, str] = {}
    for name_off, _type, _flags, _addr, off, size in sections:
        if names[name_off : names.index(b"\0", name_off)] == b".modinfo":
            for item in data[off : off + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, value)
    return info


def module_closure(moddir: Path, wanted: tuple[str, ...]) -> list[Path]:
    """The module files for ``wanted`` and their dependencies, dependencies first."""
    paths = {p.name[: -len(".ko")].replace("-", "_"): p for p in moddir.rglob("*.ko")}
    ordered: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        if name not in paths:
            raise AssetError(f"kernel module {name} not found under {moddir}")
        deps = _modinfo(paths[name]).get("depends", "")
        for dep in filter(None, deps.split(",")):
            visit(dep.replace("-", "_"))
        ordered.append(paths[name])

    for name in wanted:
        visit(name)
    return ordered


class _Cpio:
    """A minimal writer of the ``newc`` cpio format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        raw = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0)
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08x" % f for f in fields) + raw)
        self.buf.write(b"\0" * (-(110 + len(raw)) % 4))
        self.buf.write(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _merge_into_usr(extras: Path) -> None:
    """Move top-level dirs that are symlinks on this host (``/sbin -> usr/sbin``) to where they point.

    Otherwise the package's real ``/sbin`` would hide the host's symlink in the guest.
    """
    for top in list(extras.iterdir()):
        host = Path("/") / top.name
        if not top.is_dir() or not host.is_symlink():
            continue
        target = extras / os.readlink(host).lstrip("/")
        for src in top.rglob("*"):
            dst = target / src.relative_to(top)
            if src.is_dir() and not src.is_symlink():
                dst.mkdir(parents=True, exist_ok=True)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
        shutil.rmtree(top)


def build_assets(cache: Path, refresh: bool) -> dict[str, str]:
    """Fetch and build what the VM needs, once; later runs reuse it. Returns the asset paths."""
    stamp_path = cache / "assets.json"
    if not refresh and stamp_path.exists():
        stamp = json.loads(stamp_path.read_text())
        if stamp.get("format") == ASSET_FORMAT and all(Path(stamp[k]).exists() for k in ("kernel", "initrd", "extras")):
            return stamp
    started = time.monotonic()
    log("building the VM assets (first run, or --refresh): kernel, initramfs, NFS server packages")
    if cache.exists():
        shutil.rmtree(cache / "assets", ignore_errors=True)
    work = cache / "assets"
    debs = work / "debs"
    debs.mkdir(parents=True)
    kpkg = kernel_package()
    _apt("download", kpkg, "busybox-static", cwd=debs)
    guest_debs = debs / "guest"
    guest_debs.mkdir()
    # Download only what this host lacks: the guest's root is this host's /usr and /etc.
    _apt(
        "install", "-y", "--download-only", "--no-install-recommends",
        "-o", f"Dir::Cache::Archives={guest_debs}", *GUEST_PACKAGES,
    )  # fmt: skip
    kdir = work / "kernel"
    kdeb = next(debs.glob(f"{kpkg}_*.deb"))
    _run(["dpkg-deb", "-x", str(kdeb), str(kdir)])
    vmlinuz = next((kdir / "boot").glob("vmlinuz-*"))
    bbdir = work / "busybox"
    _run(["dpkg-deb", "-x", str(next(debs.glob("busybox-static_*.deb"))), str(bbdir)])
    extras = work / "extras"
    extras.mkdir()
    for deb in sorted(guest_debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(extras)])
    shutil.rmtree(extras / "usr" / "share" / "doc", ignore_errors=True)
    shutil.rmtree(extras / "usr" / "share" / "man", ignore_errors=True)
    _merge_into_usr(extras)

    modules = module_closure(next((kdir / "lib" / "modules").iterdir()), MODULES)
    cpio = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "ctl", "modules"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", (bbdir / "bin" / "busybox").read_bytes(), 0o755)
    cpio.file("init", INIT.encode(), 0o755)
    for mod in modules:
        cpio.file(f"modules/{mod.name}", mod.read_bytes())
    cpio.file("modules/order", "".join(f"{m.name}\n" for m in modules).encode())
    initrd = work / "initrd.img"
    initrd.write_bytes(gzip.compress(cpio.finish(), compresslevel=1))
    final_kernel = work / "vmlinuz"
    shutil.copyfile(vmlinuz, final_kernel)
    shutil.rmtree(kdir)
    shutil.rmtree(bbdir)
    stamp = {
        "format": ASSET_FORMAT,
        "kernel": str(final_kernel),
        "kernel_package": kdeb.name,
        "initrd": str(initrd),
        "extras": str(extras),
        "extra_packages": sorted(p.name for p in guest_debs.glob("*.deb")),
        "modules": [m.name for m in modules],
        "built_s": round(time.monotonic() - started, 1),
    }
    stamp_path.write_text(json.dumps(stamp, indent=1))
    log(f"assets built in {stamp['built_s']} s: {kdeb.name}, {len(modules)} modules, "
        f"packages {', '.join(stamp['extra_packages']) or '(none: the host has them)'}")  # fmt: skip
    return stamp


# -- the VM --------------------------------------------------------------------------


def choose_accel(requested: str) -> tuple[str, str]:
    """``kvm`` or ``tcg``, and why. A PVM host (``kvm_pvm``) runs only PVM-built guest kernels
    at speed: a stock Debian kernel sits in its decompressor for minutes there, so ``auto``
    takes software emulation instead."""
    if requested != "auto":
        return requested, f"--accel {requested}"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return "tcg", "/dev/kvm is PVM (kvm_pvm), which cannot run a stock kernel at speed: software emulation"
    return "kvm", "/dev/kvm"


def accel_args(accel: str) -> list[str]:
    if accel == "kvm":
        return ["-enable-kvm", "-cpu", "host"]
    return ["-accel", "tcg,thread=multi", "-cpu", "max"]


def host_shares() -> list[str]:
    """Host directories shared read-only, each mounted at the same path in the guest."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, str(REPO))}
    for top in HOST_TOP:
        host = Path("/") / top
        if host.is_dir() and not host.is_symlink():
            paths.add(str(host))
    kept: list[str] = []
    for p in sorted(paths):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def stage1_script(shares: list[tuple[str, str]], extras_tops: list[str]) -> str:
    """The busybox script that builds the guest's root and switches to it."""
    lines = [
        "set -e",
        "echo 'nfsh: stage1: building the root'",
        "mkdir -p /newroot && mount -t tmpfs -o mode=0755 root /newroot",
        "cd /newroot && mkdir -p proc sys dev run tmp var mnt srv nfsh .layers/extras",
        "chmod 1777 tmp",
        "M9='trans=virtio,version=9p2000.L,msize=524288,cache=loose,ro'",
        "mount -t 9p -o $M9 extras .layers/extras",
    ]
    for top in HOST_TOP:
        host = Path("/") / top
        if host.is_symlink():
            lines.append(f"ln -s {os.readlink(host)} {top}")
    for tag, path in shares:
        rel = path.lstrip("/")
        lines.append(f"mkdir -p .layers/{tag} {rel}")
        lines.append(f"mount -t 9p -o $M9 {tag} .layers/{tag}")
        if rel in extras_tops or rel in WRITABLE_TOP:
            # the host's directory with the packages' files layered over it; writable (tmpfs upper)
            lower = f"/newroot/.layers/{tag}"
            if rel in extras_tops:
                lower = f"/newroot/.layers/extras/{rel}:{lower}"
            lines.append(f"mkdir -p .layers/{tag}-up .layers/{tag}-work")
            lines.append(
                f"mount -t overlay overlay -o lowerdir={lower},"
                f"upperdir=/newroot/.layers/{tag}-up,workdir=/newroot/.layers/{tag}-work /newroot/{rel}"
            )
        else:
            lines.append(f"mount --bind .layers/{tag} {rel}")
    lines += [
        "[ -d .layers/extras/var ] && cp -a .layers/extras/var/. var/",
        "mount --move /ctl /newroot/nfsh",
        "mount --move /proc /newroot/proc",
        "mount --move /sys /newroot/sys",
        "mount --move /dev /newroot/dev",
        "echo 'nfsh: stage1: switching root'",
        f"exec switch_root /newroot /bin/sh {REPO}/tools/nfs/guest.sh",
    ]
    return "\n".join(lines) + "\n"


def run_vm(qemu: str, assets: dict[str, str], rundir: Path, args: argparse.Namespace) -> int | None:
    """Boot the VM, stream its console, return the guest's exit status (None: it did not finish)."""
    ctl = rundir / "ctl"
    ctl.mkdir(parents=True)
    extras = Path(assets["extras"])
    extras_tops = [p.name for p in extras.iterdir() if p.is_dir()]
    shares = [(f"h{i}", p) for i, p in enumerate(host_shares())]
    (ctl / "stage1.sh").write_text(stage1_script(shares, extras_tops))
    env = {
        "NFSH_PYTHON": sys.executable,
        "NFSH_REPO": str(REPO),
        "NFSH_SCENARIO_ARGS": " ".join(args.scenario_args),
    }
    (ctl / "env.sh").write_text("".join(f"export {k}='{v}'\n" for k, v in env.items()))
    opt9 = "security_model=none,multidevs=remap"
    cmd = [
        qemu, *accel_args(args.accel), "-smp", str(args.cpus), "-m", f"{args.memory_mb}",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-nic", "none",  # no network device: NFS runs over the guest's own loopback
        "-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
        "-kernel", assets["kernel"], "-initrd", assets["initrd"],
        "-append", "console=ttyS0 panic=-1 loglevel=4 quiet",
        "-virtfs", f"local,path={ctl},mount_tag=ctl,{opt9}",
        "-virtfs", f"local,path={extras},mount_tag=extras,readonly=on,{opt9}",
    ]  # fmt: skip
    for tag, path in shares:
        cmd += ["-virtfs", f"local,path={path},mount_tag={tag},readonly=on,{opt9}"]
    console = rundir / "console.log"
    deadline = time.monotonic() + args.timeout
    with console.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        pending = b""
        while True:
            chunk = proc.stdout.read()
            if chunk:
                out.write(chunk)
                out.flush()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace").rstrip("\r")
                    if args.verbose or text.startswith(("nfsh:", "Kernel panic", "qemu")):
                        print(f"  | {text}", file=_progress["to"], flush=True)
            elif proc.poll() is not None:
                break
            else:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    log(f"the VM did not finish within {args.timeout} s; killed")
                    return None
                time.sleep(0.05)
    rc_file = ctl / "rc"
    if not rc_file.exists():
        log(f"qemu exited with {proc.returncode} before the guest reported; see {console}")
        return None
    return int(rc_file.read_text().strip() or "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the VM assets and runs live")
    parser.add_argument("--refresh", action="store_true", help="rebuild the VM assets")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--verbose", "-v", action="store_true", help="echo the whole guest console")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the VM is killed (1800)")
    parser.add_argument("--accel", choices=("auto", "kvm", "tcg"), default=os.environ.get("NFS_HARNESS_ACCEL", "auto"))
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--memory-mb", type=int, default=4096)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (the scenarios' results; progress to stderr)"
    )
    parser.add_argument("scenario_args", nargs="*", help="passed to tools/nfs/scenarios.py in the guest")
    args = parser.parse_args(argv)
    _progress["to"] = sys.stderr if args.json else sys.stdout
    try:
        qemu, _kvm = find_qemu_and_kvm()
    except Skip as exc:
        print(json.dumps({"skipped": str(exc)}) if args.json else f"skipped: {exc}")
        return 0
    started = time.monotonic()
    try:
        assets = build_assets(args.cache, args.refresh)
    except (AssetError, OSError, StopIteration) as exc:
        print(f"nfs-harness: error: cannot build the VM assets: {exc}", file=sys.stderr)
        return 2
    assets_s = time.monotonic() - started
    (args.cache / "runs").mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.cache / "runs"))
    args.accel, why = choose_accel(args.accel)
    if args.accel == "tcg" and not any(a.startswith("--keys") for a in args.scenario_args):
        args.scenario_args = ["--keys", "96", *args.scenario_args]  # software emulation: ~20x slower
    log(f"booting {assets['kernel_package']} under {qemu} -accel {args.accel} ({why})")
    log(f"run directory {rundir}")
    vm_started = time.monotonic()
    rc = run_vm(qemu, assets, rundir, args)
    vm_s = time.monotonic() - vm_started
    result_file = rundir / "ctl" / "result.json"
    result: dict[str, object] = {"ok": False, "scenarios": []}
    if result_file.exists():
        from nfs.nfs_common import format_summary

        result = json.loads(result_file.read_text())
        print(format_summary(result), file=_progress["to"], flush=True)
    status = 0 if rc == 0 else 1
    total_s = time.monotonic() - started
    log(f"{'passed' if status == 0 else 'FAILED'}: assets {assets_s:.1f} s, VM {vm_s:.1f} s, "
        f"total {total_s:.1f} s (guest exit status {rc})")  # fmt: skip
    if args.json:
        result["harness"] = {
            "accel": args.accel, "kernel_package": assets["kernel_package"], "guest_exit_status": rc,
            "assets_s": round(assets_s, 1), "vm_s": round(vm_s, 1), "total_s": round(total_s, 1),
        }  # fmt: skip
        if isinstance(result.get("guest_uptime_s"), float) and vm_s > 0:
            # Seconds of the guest's clock per second of the host's: every figure is in the guest's.
            result["harness"]["guest_s_per_host_s"] = round(result["guest_uptime_s"] / vm_s, 2)
        print(json.dumps(result, indent=1), flush=True)
    if status == 0 and not args.keep:
        shutil.rmtree(rundir, ignore_errors=True)
    else:
        log(f"run directory kept: {rundir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
