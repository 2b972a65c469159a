"""bench/serve.py's own logic: the step breakdown from scraped histograms, and --colocate's checks."""
from __future__ import annotations

import pytest

from bench.serve import STEP_PARTS, parse_args, step_breakdown


def sample(name: str, total_s: float, count: float) -> dict[str, float]:
    return {name + "_sum": total_s, name + "_count": count}


def test_step_breakdown_leaves_out_what_nothing_observed():
    """Per link message, in ms; a part nothing observed in the run (no verifier service, no draft
    in plain decoding) is None, and `other` is what the drafter's own parts leave of the step."""
    before = {**sample(STEP_PARTS["rpc"], 1.0, 10), **sample(STEP_PARTS["vstep"], 0.5, 10),
              **sample(STEP_PARTS["draft"], 0.0, 0)}
    after = {**sample(STEP_PARTS["rpc"], 1.5, 110), **sample(STEP_PARTS["vstep"], 0.5, 10),
             **sample(STEP_PARTS["draft"], 0.2, 100), **sample(STEP_PARTS["build"], 0.1, 100)}
    parts = step_breakdown(before, after, wall=1.0)
    assert parts["messages"] == 100 and parts["step_ms"] == pytest.approx(10.0)
    assert parts["rpc_ms"] == pytest.approx(5.0) and parts["draft_ms"] == pytest.approx(2.0)
    assert parts["build_ms"] == pytest.approx(1.0)
    assert parts["vstep_ms"] is None and parts["vfwd_ms"] is None  # unchanged / absent
    assert parts["other_ms"] == pytest.approx(2.0)
    plain = step_breakdown(before, {**after, **sample(STEP_PARTS["draft"], 0.0, 0),
                                    **sample(STEP_PARTS["build"], 0.0, 0)}, wall=1.0)
    assert plain["draft_ms"] is None and plain["other_ms"] == pytest.approx(5.0)
    assert step_breakdown(before, before, wall=1.0)["step_ms"] is None  # no message: nothing to split


def test_colocate_takes_no_link_options(capsys):
    a = parse_args(["--models", "qwen3-8b", "--small", "--colocate", "--quick"])
    assert a.colocate
    for extra in (["--delay-ms", "5"], ["--lockstep"], ["--verifier-tp", "2"]):
        with pytest.raises(SystemExit):
            parse_args(["--models", "qwen3-8b", "--small", "--colocate", "--quick", *extra])
        assert "--colocate" in capsys.readouterr().err
