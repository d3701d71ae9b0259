"""The multi-rank suite's error table fits 100 columns, whatever the comparison and output names."""

from mcore_ppo_testing.reports import error_table


def test_error_table_fits_100_columns():
    errors = {
        "layout vs tp1 [tp2 cp2 pp1 sp1 {'max_tokens_per_micro_batch': 64, 'micro_batch_size': 2}]": {
            "d_hidden (partial, all-reduced over the TP group)": 1e-15,
            "Δ every parameter: decoder.layers.0.mlp.linear_fc1.weight": 2e-14,
            "Δ every parameter: decoder.layers.1.mlp.linear_fc1.weight": 3e-14,
        },
        "short": {"log_prob": 1e-16},
    }
    lines = error_table(errors)
    assert len(lines) >= 3 and all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    assert lines[0].endswith("max rel err") and "1.00e-16" in lines[-1]
