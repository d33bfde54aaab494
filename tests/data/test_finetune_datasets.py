"""One end-to-end ``memascend finetune`` on the workflow of issue 23: a model id from a local Hugging
Face cache (offline) and a sharegpt parquet file read with ``datasets``."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest

from tests.conftest import run_cli

REPO_ID = "tiny-org/tokenizer-only"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def hub_parquet_run(tmp_path_factory, smollm2_tokenizer):
    """``--model REPO_ID`` (a snapshot with config + tokenizer in an HF cache built here, HF_HUB_OFFLINE=1;
    ``--from-scratch llama-tiny`` takes the architecture) and ``--data sharegpt.parquet``, one step."""
    import datasets

    tmp = tmp_path_factory.mktemp("hub-parquet")
    repo = tmp / "hf-hub" / ("models--" + REPO_ID.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    smollm2_tokenizer.save_pretrained(snap)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    rows = [{"conversations": [{"from": "human", "value": f"Count to {i}, please."},
                               {"from": "gpt", "value": ", ".join(str(k) for k in range(1, i + 2)) + "."}]}
            for i in range(60)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp / "sharegpt.parquet"))
    t0 = time.monotonic()
    proc = run_cli(["finetune", "--model", REPO_ID, "--from-scratch", "llama-tiny", "--data",
                    str(tmp / "sharegpt.parquet"), "--steps", "1", "--seq-len", "32", "--micro-batch", "2",
                    "--eval-blocks", "1", "--no-save-model", "--output", str(tmp / "out"),
                    "--nvme-path", str(tmp / "swap")], tmp,
                   env={"HF_HUB_CACHE": str(tmp / "hf-hub"), "HF_HUB_OFFLINE": "1",
                        "HF_DATASETS_CACHE": str(tmp / "ds-cache")})
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"end-to-end finetune (hub id + sharegpt parquet): {wall_s:.1f} s")
    shutil.rmtree(tmp / "swap", ignore_errors=True)
    return json.loads((tmp / "out" / "report.json").read_text())


def test_report_records_the_model_id_and_the_data(hub_parquet_run):
    rep = hub_parquet_run
    assert rep["model"]["source"] == REPO_ID
    assert rep["model"]["hub"] == {"id": REPO_ID, "revision": "main", "commit": COMMIT}
    assert rep["config"]["model"]["revision"] is None
    assert rep["config"]["data"]["format"] == "auto" and rep["config"]["data"]["columns"] == {}
    assert rep["data"]["documents"] == 60 and rep["data"]["train_blocks"] > 0
    assert rep["num_steps"] == 1 and math.isfinite(rep["steps"][0]["loss"])
