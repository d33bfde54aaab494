"""memascend/units.py: the one size parser every size option uses, and the shared constants."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memascend.errors import UserError
from memascend.units import DTYPE_BYTES, GIB, MIB, parse_size_bytes


def test_binary_letters_and_iec_units_are_the_same_decimal_units_are_si():
    assert parse_size_bytes("16G") == parse_size_bytes("16GiB") == parse_size_bytes("16 gib") == 16 * GIB
    assert parse_size_bytes("300M") == parse_size_bytes("300MiB") == 300 * MIB
    assert parse_size_bytes("4GB") == 4_000_000_000
    assert parse_size_bytes("2tb") == 2 * 1000**4
    assert parse_size_bytes("1.5G") == 3 << 29
    assert parse_size_bytes("1048576") == 1 << 20
    assert parse_size_bytes("4e9") == 4_000_000_000
    assert parse_size_bytes(12345) == 12345


@pytest.mark.parametrize("bad", ["", "lots", "0", "0GiB", "-1G", "12XB", "GiB", "0.1b"])
def test_not_a_size_is_one_user_error(bad):
    with pytest.raises(UserError, match=r"^not a memory size: .* \(e\.g\. 16GiB, 300MiB\)$"):
        parse_size_bytes(bad)


@pytest.mark.parametrize("big", ["1e999", "9" * 400])
def test_past_float_range_is_too_large(big):
    with pytest.raises(UserError, match="is too large"):
        parse_size_bytes(big)


def test_every_size_option_reads_2G_as_two_gibibytes(monkeypatch):
    """doctor --lock-bytes read 2G as 2e9 while regress --memory-cap read it as 2 GiB; now both binary."""
    import memascend.cli.doctor as doctor_cli
    from memascend.cli.params import SIZE_BYTES
    from memascend.cli.regress import regress

    assert SIZE_BYTES.convert("2G", None, None) == 2 * GIB
    sizes = {p.name: p.type for p in doctor_cli.doctor.params if p.name in ("lock_bytes", "nvme_bytes")}
    sizes["memory_cap"] = next(p.type for p in regress.params if p.name == "memory_cap")
    assert {k: t.convert("2G", None, None) for k, t in sizes.items()} == dict.fromkeys(sizes, 2 * GIB)
    result = CliRunner().invoke(regress, ["--memory-cap", "lots"])
    assert result.exit_code == 2 and "not a memory size: 'lots'" in result.output


def test_dtype_bytes():
    assert DTYPE_BYTES == {"bf16": 2, "fp16": 2, "fp32": 4}
