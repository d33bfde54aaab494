"""Host checks behind ``memascend doctor``: one function per check, each returning a :class:`CheckResult`."""

from memascend.host.doctor import DoctorOptions, exit_code, run_checks
from memascend.host.result import CheckResult, HostPaths, Status

__all__ = ["CheckResult", "DoctorOptions", "HostPaths", "Status", "exit_code", "run_checks"]
