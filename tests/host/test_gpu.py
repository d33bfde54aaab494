import torch

from memascend.host import Status
from memascend.host.gpu import check_cuda, check_gds, driver_version


def test_driver_version_from_procfs(fake_host):
    d = fake_host.paths.proc / "driver" / "nvidia"
    d.mkdir(parents=True)
    (d / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder@U16-I1-N07-12-3)\n"
    )
    assert driver_version(fake_host.paths) == "575.57.08"


def test_no_driver_in_fake_procfs(fake_host):
    assert driver_version(fake_host.paths) is None


def test_cuda_requirement_follows_torch_build(fake_host):
    result = check_cuda(fake_host.paths)
    if torch.version.cuda is None:
        assert result.status is Status.SKIP and not result.required
        forced = check_cuda(fake_host.paths, required=True)
        assert forced.status is Status.FAIL and forced.blocks_run and "CUDA build of torch" in forced.fix
    else:  # CUDA torch with no driver in the fake procfs (nvidia-smi is not consulted for fake roots)
        assert result.status is Status.FAIL and "driver" in result.fix


def test_gds_needs_module_and_config(fake_host):
    result = check_gds(fake_host.paths)
    assert result.status is Status.WARN and not result.required and "nvidia-gds" in result.fix
    (fake_host.paths.proc / "modules").write_text("nvidia_fs 262144 0 - Live 0x0000000000000000\n")
    assert check_gds(fake_host.paths).status is Status.WARN
    (fake_host.paths.etc / "cufile.json").write_text("{}")
    assert check_gds(fake_host.paths).status is Status.PASS
