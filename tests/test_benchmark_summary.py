"""benchmarks/summarize.py: the one-screen summary of benchmark JSON files."""

from __future__ import annotations

import json

from benchmarks.summarize import main, summarize


def test_summary_reports_targets_fidelity_and_profiles(tmp_path, capsys):
    qps = {"commit": "abc1234", "targets": {"q1_median_ms": {"measured": 16.38, "target": 9.0, "met": False},
                                            "q64_speedup": {"measured": 41.0, "target": 40.0, "met": True}}}
    fidelity = {"benchmark": "fidelity", "commit": "abc1234",
                "engine_bf16_vs_fp32_reference": {"mean_tv": 0.022, "max_abs_dp": 0.11},
                "variants": {"bf16_residual": {"mean_tv": 0.0242}}}
    profile = {"rounds": [{"round": "lone", "questions": 1, "tokens": 2043, "device_ms_total": 9.07, "launches": 611,
                           "kernels": [{"kernel": "_state_scan_kernel", "calls": 54, "ms": 1.58}]}]}
    for name, data in (("qps.json", qps), ("fidelity.json", fidelity), ("profile.json", profile)):
        (tmp_path / name).write_text(json.dumps(data))
    assert summarize(tmp_path / "qps.json") == [
        "qps.json (commit abc1234)",
        "  q1_median_ms: 16.38 (target 9.0, NOT met)",
        "  q64_speedup: 41 (target 40.0, met)",
    ]
    lines = summarize(tmp_path / "fidelity.json")
    assert "  engine_bf16_vs_fp32_reference: mean TV 0.0220, max |dp| 0.11" in lines
    assert "  variant bf16_residual: mean TV 0.0242" in lines
    main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert "lone: 2043 tokens, 9.07 ms, 611 launches; _state_scan_kernel 1.58" in printed
    assert printed.index("fidelity.json") < printed.index("profile.json") < printed.index("qps.json")


def test_summary_reports_isolated_gdn_variants_beside_their_default_and_the_failed_ones(tmp_path):
    options = {"commit": "abc1234", "rounds": {"lone": {"tokens": 2020, "variants": {
        '{"scan_prefetch": 2}': {"graph": {"median_ms": 0.12}, "padded_as_the_engine": {"median_ms": 0.13},
                                 "default_in_this_process": {"graph_ms": 0.141, "padded_graph_ms": 0.153}}}}},
               "failed_variants": {'{"scan_stages": 3}': {"exit_status": 1, "stderr_tail": "illegal memory access"}}}
    (tmp_path / "gdn-options.json").write_text(json.dumps(options))
    assert summarize(tmp_path / "gdn-options.json") == [
        "gdn-options.json (commit abc1234)",
        '  lone: {"scan_prefetch": 2} unpadded/padded 0.12/0.13 (default 0.141/0.153)',
        '  variant {"scan_stages": 3} FAILED (exit status 1)',
    ]


def test_summary_lists_the_longest_kernels_of_ours_and_the_baseline(tmp_path):
    gdn = {"commit": "abc1234", "rounds": {"lone": {"ours": {"graph": {"median_ms": 0.142}}, "kernels": {
        "ours": [{"kernel": "_state_scan_kernel", "calls": 3, "ms": 0.062}, {"kernel": "_chunk_prep_kernel", "calls": 1,
                                                                              "ms": 0.046}],
        "fla": [{"kernel": "chunk_gated_delta_rule_fwd_kernel_h", "calls": 1, "ms": 0.04}]}}}}
    (tmp_path / "gdn.json").write_text(json.dumps(gdn))
    assert summarize(tmp_path / "gdn.json") == [
        "gdn.json (commit abc1234)",
        "  lone: ours 0.142",
        "    ours kernels: _state_scan_kernel 0.062, _chunk_prep_kernel 0.046",
        "    fla kernels: chunk_gated_delta_rule_fwd_k 0.04",
    ]


def test_results_of_every_model_size_and_variant_are_recorded_apart(tmp_path):
    """`readme_results --record` takes Gemma 4 sizes (E4B, 26B-A4B) and variants (vs_flide's -fp8) as well as
    Qwen3.5's; a variant is its own latest result and table row, and its history row names it. Mutation caught:
    the old name pattern (only <number>B or tiny) skips all three."""
    from benchmarks.readme_results import latest, record, table

    target = {"met": True, "measured": 0.7, "target": 0.75, "kind": "max"}
    names = ("vs_flide-4B", "vs_flide-4B-fp8", "vs_flide-E4B", "vs_flide-26B-A4B", "images-0.8B")
    for name in names:
        data = {"benchmark": name.split("-")[0], "date": "2026-12-07", "gpu": "H100", "commit": "abc1234",
                "command": "x", "targets": {"w1_q1_lone_sdk_over_flide": target}}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        record(tmp_path / f"{name}.json", tmp_path / "results")
    found = latest(tmp_path / "results" / "latest")
    assert list(found) == [("vs_flide", "4B"), ("vs_flide", "4B-fp8"), ("vs_flide", "E4B"), ("vs_flide", "26B-A4B"),
                           ("images", "0.8B")]
    row = "| vs_flide | 26B-A4B | w1_q1_lone_sdk_over_flide | 0.7 | ≤ 0.75 | yes |"
    assert row in table(tmp_path / "results" / "latest")
    history = (tmp_path / "results" / "history.csv").read_text().splitlines()
    assert len(history) == 1 + len(names) and ",4B,fp8," in history[2]
