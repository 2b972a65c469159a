"""bench/tree_select.py runs and reports the trees it times."""
import json

from bench.tree_select import _depth, main


def test_depth_of_parent_lists():
    assert _depth([-1]) == 0
    assert _depth([-1, 0, 1, 1, 0]) == 2


def test_peaked_logits_give_chains_down_every_depth(tmp_path):
    out = tmp_path / "ts.json"
    res = main(["--sessions", "1,3", "--peak", "0,6", "--reps", "2", "--out-json", str(out)])
    rows = {(r["peak"], r["sessions"]): r for r in res["rows"]}
    assert rows[(6.0, 1)]["nodes"] == 17 and rows[(0.0, 3)]["nodes"] == 17  # every tree at its budget
    assert rows[(6.0, 3)]["max_depth"] >= 12 > 8 >= rows[(0.0, 3)]["max_depth"]
    assert json.loads(out.read_text())["rows"] == res["rows"]
