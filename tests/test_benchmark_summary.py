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
