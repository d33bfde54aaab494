from memascend.host import Status
from memascend.host.libraries import check_library


def test_missing_library_fails_with_apt_fix(tmp_path):
    result = check_library(
        "aio", "libaio.h", required=True, find_library=lambda _: None, include_dirs=[tmp_path]
    )
    assert result.status is Status.FAIL and result.blocks_run and "libaio1" in result.fix


def test_missing_optional_library_only_warns(tmp_path):
    result = check_library(
        "uring", "liburing.h", required=False, find_library=lambda _: None, include_dirs=[tmp_path]
    )
    assert result.status is Status.WARN and not result.blocks_run


def test_library_without_header_warns(tmp_path):
    result = check_library(
        "aio", "libaio.h", required=True, find_library=lambda _: "libaio.so.1", include_dirs=[tmp_path]
    )
    assert result.status is Status.WARN and "libaio-dev" in result.fix


def test_library_and_header_pass(tmp_path):
    (tmp_path / "libaio.h").write_text("/* */")
    result = check_library(
        "aio", "libaio.h", required=True, find_library=lambda _: "libaio.so.1", include_dirs=[tmp_path]
    )
    assert result.status is Status.PASS and str(tmp_path / "libaio.h") in result.detail


def test_real_host_libaio():
    assert check_library("aio", "libaio.h", required=True).status is not Status.FAIL
