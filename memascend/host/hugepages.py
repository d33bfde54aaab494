"""Doctor check: are huge pages reserved, free, and is a hugetlbfs mounted?

Pinned buffers backed by 2 MiB (or 1 GiB) pages cost fewer TLB entries and page-table bytes than
4 KiB pages. Reads ``<proc>/meminfo``, ``<proc>/mounts`` and
``<sys>/kernel/mm/hugepages/hugepages-*/nr_hugepages``.
"""

from __future__ import annotations

from memascend.host.result import CheckResult, HostPaths, Status, format_bytes, read_text

FIX_RESERVE = "reserve pages: run `just provision HOST` (role hugepages, hugepages_count_2m) or `sysctl vm.nr_hugepages=N`"
FIX_MOUNT = (
    "mount one: run `just provision HOST` (role hugepages) or `mount -t hugetlbfs none /dev/hugepages`"
)


def read_meminfo(paths: HostPaths) -> dict[str, int]:
    """``<proc>/meminfo`` as ``{key: value}``; values in kB are converted to bytes, counts kept."""
    out: dict[str, int] = {}
    for line in (read_text(paths.proc / "meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        value = int(fields[0])
        out[key.strip()] = value * 1024 if len(fields) > 1 and fields[1] == "kB" else value
    return out


def hugetlbfs_mounts(paths: HostPaths) -> list[str]:
    """Mount points of type hugetlbfs listed in ``<proc>/mounts``."""
    points = []
    for line in (read_text(paths.proc / "mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "hugetlbfs":
            points.append(fields[1])
    return points


def gigantic_pages(paths: HostPaths) -> int:
    """Number of reserved 1 GiB pages (0 when the kernel has none or the file is absent)."""
    text = read_text(paths.sys / "kernel" / "mm" / "hugepages" / "hugepages-1048576kB" / "nr_hugepages")
    return int(text) if text and text.strip().isdigit() else 0


def check_hugepages(paths: HostPaths, *, required: bool = False) -> CheckResult:
    """Report reserved/free default-size huge pages, 1 GiB pages and hugetlbfs mounts.

    Args:
        paths: procfs/sysfs roots.
        required: when True a missing reservation or mount is a FAIL; otherwise a WARN
            (memascend falls back to normal pages).

    Returns:
        PASS when pages are reserved, some are free and a hugetlbfs is mounted.
    """
    info = read_meminfo(paths)
    if "HugePages_Total" not in info:
        return CheckResult(
            name="hugepages",
            status=Status.FAIL if required else Status.WARN,
            detail=f"no HugePages_Total in {paths.proc}/meminfo (kernel without hugetlb?)",
            fix="use a kernel with CONFIG_HUGETLBFS",
            required=required,
        )
    total, free = info["HugePages_Total"], info.get("HugePages_Free", 0)
    page_bytes = info.get("Hugepagesize", 2 << 20)
    mounts = hugetlbfs_mounts(paths)
    giant = gigantic_pages(paths)
    detail = (
        f"{total} x {format_bytes(page_bytes)} reserved, {free} free ({format_bytes(free * page_bytes)}); "
        f"1 GiB pages: {giant}; hugetlbfs: {', '.join(mounts) if mounts else 'none mounted'}"
    )
    bad = Status.FAIL if required else Status.WARN
    if total == 0 and giant == 0:
        return CheckResult(name="hugepages", status=bad, detail=detail, fix=FIX_RESERVE, required=required)
    if free == 0 and giant == 0:
        return CheckResult(
            name="hugepages",
            status=bad,
            detail=detail,
            fix="all reserved pages are in use: raise hugepages_count_2m or stop the process holding them",
            required=required,
        )
    if not mounts:
        return CheckResult(name="hugepages", status=bad, detail=detail, fix=FIX_MOUNT, required=required)
    return CheckResult(name="hugepages", status=Status.PASS, detail=detail, required=required)
