from memascend.host import Status
from memascend.host.storage import check_nvme_path, o_direct_works


def test_folder_with_room_passes(tmp_path):
    assert o_direct_works(tmp_path) is None
    result = check_nvme_path(tmp_path, need_bytes=1 << 20)
    assert result.status is Status.PASS and "O_DIRECT ok" in result.detail
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_not_enough_space_fails(tmp_path):
    result = check_nvme_path(tmp_path, need_bytes=1 << 60)
    assert result.status is Status.FAIL and "free space" in result.fix


def test_missing_folder_fails(tmp_path):
    result = check_nvme_path(tmp_path / "nope", need_bytes=1)
    assert result.status is Status.FAIL and "mkdir -p" in result.fix
