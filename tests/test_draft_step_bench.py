"""bench/draft_step.py runs at toy sizes and reports both of its tables."""
import json

from bench.draft_step import main


def test_draft_step_and_prompt_contexts_at_toy_sizes(tmp_path):
    out = tmp_path / "ds.json"
    res = main(["--small", "--batches", "2", "--contexts", "16", "--rows", "4", "--prompts", "1,2",
                "--prompt-len", "8", "--reps", "1", "--out-json", str(out)])
    assert [(p["batch"], p["context"], p["rows"]) for p in res["points"]] == [(2, 16, 4)]
    assert [p["prompts"] for p in res["prompt_points"]] == [1, 2]
    for point in res["prompt_points"]:
        assert all(point[f"{how}_{kind}_ms"] > 0 for how in ("together", "apart") for kind in ("wall", "host"))
    assert json.loads(out.read_text())["prompt_points"] == res["prompt_points"]
