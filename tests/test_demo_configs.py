"""`make demo`'s configurations (serve_compare.py): the EAGLE-3 pair first, at equal budget."""

from vllm_tree_spec.serve_compare import configs


def test_eagle3_pair_first_at_equal_budget():
    rows = configs(6, "HEAD")
    assert [name for name, _ in rows[:3]] == ["no speculation", "vLLM eagle3, linear k=6", "tree eagle3, 6 nodes"]
    assert rows[1][1]["num_speculative_tokens"] == rows[2][1]["num_speculative_tokens"] == 6  # equal budget
    for _, spec in rows[1:3]:
        assert spec["model"] == "HEAD"


def test_no_head_no_eagle_rows():
    assert not any("eagle" in name for name, _ in configs(6, None))
