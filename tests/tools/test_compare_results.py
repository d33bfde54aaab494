"""tools.compare_results: losses compared bit for bit, peaks reported."""

from __future__ import annotations

import copy
import json

from tools.compare_results import compare, main


def _results(loss: float) -> dict:
    run = {"losses": [2.5, loss], "peak_rss_bytes": 2**30, "peak_locked_bytes": 2**29}
    return {"configs": [{"config": {"name": "row"}, "baseline": dict(run), "memascend": dict(run)}]}


def test_equal_losses_pass_and_one_ulp_fails(tmp_path):
    old = _results(1.25)
    lines, same = compare(copy.deepcopy(old), old)
    assert same and len(lines) == 2 and "bit-identical" in lines[0]
    off = _results(1.25)
    off["configs"][0]["memascend"]["losses"][1] = float.fromhex("0x1.4000000000001p+0")  # one ulp above 1.25
    _, same = compare(off, old)
    assert not same
    (tmp_path / "a.json").write_text(json.dumps(off))
    (tmp_path / "b.json").write_text(json.dumps(old))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert main([str(tmp_path / "b.json"), str(tmp_path / "b.json")]) == 0


def test_a_golden_file_is_refused_with_one_line(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(_results(1.25)))
    golden = tmp_path / "smoke.json"
    golden.write_text(json.dumps({"matrix": "smoke", "configs": {"row": {"baseline": {}}}}))
    assert main([str(tmp_path / "results.json"), str(golden)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compare_results: error:") and "smoke.json" in err[0]
