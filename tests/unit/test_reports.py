"""How the ranks' round outcomes merge (TP/PP): freed blocks are the intersection, private-block slots the
union (a rank that wrote into a private block needs it, even where another rank left that slot empty)."""

from vllm_contour.integration.messages import ContourReport, Noop, PlanFailed, Recompute, Round
from vllm_contour.integration.messages import merge as merge_outcomes


def _round(freed, replaced=(), region=10, kept=2):
    return Round(1, region, kept, freed=tuple(freed), replaced=tuple(replaced))


def test_freed_is_the_intersection_and_replaced_the_union():
    # rank a keeps 2 blocks (slots 0, 1 into private 50, 51), rank b keeps 3 (slot 2 into private 52 too)
    a = _round([(2, 12), (3, 13), (4, 14)], [(0, 10, 50), (1, 11, 51)])
    b = _round([(3, 13), (4, 14)], [(0, 10, 50), (1, 11, 51), (2, 12, 52)], kept=3)
    m = merge_outcomes(a, b)
    assert isinstance(m, Round) and m.kept_blocks == 3
    assert m.freed == ((3, 13), (4, 14))
    assert m.replaced == ((0, 10, 50), (1, 11, 51), (2, 12, 52))
    assert merge_outcomes(b, a).freed == ((3, 13), (4, 14))


def test_in_place_rounds_merge_as_before_and_disagreement_recomputes():
    m = merge_outcomes(_round([(2, 12), (3, 13)]), _round([(3, 13)]))
    assert m.freed == ((3, 13),) and m.replaced == ()
    assert isinstance(merge_outcomes(_round([]), _round([], region=9)), Recompute)
    assert isinstance(merge_outcomes(_round([]), Noop(1)), Recompute)
    r = ContourReport({"x": _round([(2, 12)], [(0, 10, 50)])}).aggregate(ContourReport({"x": _round([(2, 12)])}))
    assert r.entries["x"].replaced == ((0, 10, 50),) and r.entries["x"].freed == ((2, 12),)


def test_pipeline_stages_free_a_block_only_when_every_stage_freed_it():
    """Two pipeline stages (each of two tensor-parallel ranks) report their own layers' rounds: a stage whose
    layers keep more pages keeps more blocks; vLLM aggregates every worker's report, and a block goes back to
    the pool only when every stage and rank freed it."""
    stage0 = [_round([(3, 13), (4, 14)], kept=3), _round([(3, 13), (4, 14)], kept=3)]
    stage1 = [_round([(2, 12), (3, 13), (4, 14)], kept=2), _round([(2, 12), (3, 13), (4, 14)], kept=2)]
    report = ContourReport({"x": stage1[0]})
    for r in stage1[1:] + stage0:
        report = report.aggregate(ContourReport({"x": r}))
    assert report.entries["x"].freed == ((3, 13), (4, 14)) and report.entries["x"].kept_blocks == 3
    late = ContourReport({"x": stage0[0]}).aggregate(ContourReport({"x": PlanFailed(1, "stage 1")}))
    assert isinstance(late.entries["x"], Recompute)  # stages that disagree: the request starts over
