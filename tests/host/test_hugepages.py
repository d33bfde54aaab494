from memascend.host import Status
from memascend.host.hugepages import check_hugepages, hugetlbfs_mounts, read_meminfo

MOUNT = "none /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0"


def test_no_pages_warns_or_fails_when_required(fake_host):
    warn = check_hugepages(fake_host.paths)
    assert warn.status is Status.WARN and not warn.blocks_run and "hugepages_count_2m" in warn.fix
    fail = check_hugepages(fake_host.paths, required=True)
    assert fail.status is Status.FAIL and fail.blocks_run


def test_reserved_but_unmounted_asks_for_mount(fake_host):
    fake_host.set_meminfo(64, 64)
    result = check_hugepages(fake_host.paths, required=True)
    assert result.status is Status.FAIL and "hugetlbfs" in result.fix
    assert "64 x 2.00 MiB reserved, 64 free (128.00 MiB)" in result.detail


def test_all_pages_in_use(fake_host):
    fake_host.set_meminfo(64, 0)
    fake_host.set_mounts([MOUNT])
    result = check_hugepages(fake_host.paths, required=True)
    assert result.status is Status.FAIL and "in use" in result.fix


def test_reserved_free_and_mounted_passes(fake_host):
    fake_host.set_meminfo(64, 10)
    fake_host.set_mounts(["proc /proc proc rw 0 0", MOUNT])
    assert hugetlbfs_mounts(fake_host.paths) == ["/dev/hugepages"]
    assert read_meminfo(fake_host.paths)["Hugepagesize"] == 2 << 20
    result = check_hugepages(fake_host.paths, required=True)
    assert result.status is Status.PASS and "/dev/hugepages" in result.detail


def test_gigantic_pages_count(fake_host):
    d = fake_host.paths.sys / "kernel" / "mm" / "hugepages" / "hugepages-1048576kB"
    d.mkdir(parents=True)
    (d / "nr_hugepages").write_text("2\n")
    fake_host.set_mounts([MOUNT])
    result = check_hugepages(fake_host.paths, required=True)
    assert result.status is Status.PASS and "1 GiB pages: 2" in result.detail
