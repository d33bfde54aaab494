"""memascend/cli/finetune.py's summary table: it says whose peak it shows (rank 0, or a host's ranks)."""

from memascend.cli.finetune import _print_summary
from memascend.train import report as report_mod

GIB = 1 << 30


def _report(rank_peaks):
    memory = report_mod._memory_section({"peak_rss_bytes": rank_peaks[0]["peak_rss_bytes"],
                                         "peak_locked_bytes": rank_peaks[0]["peak_locked_bytes"]}, rank_peaks)
    return {"engine": "memascend", "memory": memory, "eval": {"loss_before": 3.5, "loss_after": 3.25},
            "num_steps": 2, "median_step_s": 1.0, "median_tokens_per_s": 100.0, "steps": [{"step": 1}],
            "nvme": {"read_bytes": GIB, "write_bytes": GIB}}


def test_one_rank_shows_its_peaks(capsys):
    _print_summary(_report([{"rank": 0, "peak_rss_bytes": 2 * GIB, "peak_locked_bytes": GIB // 2}]), "out")
    err = capsys.readouterr().err
    assert "peak RSS" in err and "2.00 GiB" in err and "rank 0 / host" not in err


def test_two_hosts_show_rank_0_and_the_largest_host(capsys):
    ranks = [{"rank": r, "node_rank": r // 2, "hostname": f"h{r // 2}", "peak_rss_bytes": (r + 1) * GIB,
              "peak_locked_bytes": GIB // 4} for r in range(4)]
    _print_summary(_report(ranks), "out")
    err = capsys.readouterr().err
    assert "peak RSS rank 0 / host" in err and "1.00 / 7.00 GiB" in err
    assert "peak locked rank 0 / host" in err and "0.25 / 0.50 GiB" in err
    assert "4 / 2" in err and "the largest host" in " ".join(err.split())
