"""Memory stays flat over many calls with random prompt lengths (the short CI version of `bench soak`)."""

from specrt.bench.soak import SoakConfig, run_soak


def test_rss_is_flat_over_random_prompt_lengths(demo_bundle, tmp_path):
    cfg = SoakConfig(bundle=demo_bundle, out=tmp_path, label="ci", num_calls=60, settle_calls=20, batch_sizes=(1,),
                     threads=2)
    data = run_soak(cfg)
    (row,) = data["rows"]
    assert len(row["rss_mb"]) == 61 and all(50 <= n <= 1900 for (n,) in row["prompt_lengths"])
    assert max(n for (n,) in row["prompt_lengths"]) > 1500  # long prompts were in the mix
    assert row["growth"] <= 0.10 and row["rss_peak_mb"] < 1000, row
    assert data["passed"] and (tmp_path / "soak-ci.md").is_file()
