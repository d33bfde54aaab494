"""The config package is the one home of configuration: it sits below every other layer (it imports
nothing of memascend but ``errors`` and ``units``), and the modules it replaced are gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layers import PACKAGE, imports

CONFIG = PACKAGE / "config"


@pytest.mark.parametrize("path", sorted(CONFIG.glob("*.py")), ids=lambda p: p.name)
def test_config_imports_only_errors_and_units(path: Path):
    found = {name for name in imports(path) if name.startswith("memascend.")}
    outside = {name for name in found if not name.startswith(("memascend.config", "memascend.errors",
                                                                "memascend.units"))}
    assert not outside, f"{path.name} imports {sorted(outside)}"


@pytest.mark.parametrize("old", ["config.py", "settings.py", "validate.py", "ds_conflicts.py", "resolve.py",
                                 "families.py", "integrations/deepspeed/sizing.py",
                                 "integrations/deepspeed/settings.py"])
def test_the_replaced_modules_are_gone(old):
    assert not (PACKAGE / old).exists()


def test_the_seam_exports_the_config_package_s_sizing():
    import memascend.integrations.deepspeed as seam
    from memascend.config import sizing
    from memascend.config.settings import MemAscendSettings

    assert seam.prepare_ds_config is sizing.prepare_ds_config
    assert seam.rewrite_ds_config is sizing.rewrite_ds_config
    assert seam.MemAscendSettings is MemAscendSettings
