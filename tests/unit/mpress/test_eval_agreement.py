"""benchmarks/mpress_paper.py agrees(): ours agrees with a number the paper prints only at the
precision it prints it with ("3.1 x": one decimal), never within a tolerance of our own choosing."""
from __future__ import annotations

from decimal import Decimal

import pytest

from benchmarks import mpress_paper as paper


@pytest.mark.parametrize("text, value, decimals, unit", [
    ("17.4%", "17.4", 1, "%"), ("3.1 x", "3.1", 1, "x"), ("3.1 ×", "3.1", 1, "x"), ("578.70", "578.70", 2, ""),
    ("121GB", "121", 0, "GB"), ("0%", "0", 0, "%"), ("42", "42", 0, ""),
])
def test_parse_stated_keeps_the_printed_precision(text, value, decimals, unit):
    assert paper.parse_stated(text) == (Decimal(value), decimals, unit)


@pytest.mark.parametrize("text", ["20.6-23.8%", "identical", "more than doubled", "1.4 - 2.3x", ""])
def test_parse_stated_refuses_what_is_not_one_number(text):
    with pytest.raises(ValueError):
        paper.parse_stated(text)


def test_agrees_only_when_ours_rounds_to_the_stated_number():
    assert paper.agrees(3.14, "3.1 x").agrees and paper.agrees(3.05000001, "3.1 x").agrees
    assert not paper.agrees(3.16, "3.1 x").agrees  # 3.2 at one decimal
    assert paper.agrees(578.7, "578.70").agrees and not paper.agrees(578.71, "578.70").agrees
    assert paper.agrees(49.44, "49").agrees and not paper.agrees(49.6, "49").agrees
    a = paper.agrees(3.5, "3.1 x")
    assert not a.agrees and a.differs_by == Decimal("0.4") and str(a) == "differs by +0.4x (ours 3.5x, paper 3.1 x)"
    assert str(paper.agrees(17.44, "17.4%")) == "agrees (17.4%)"


def test_agrees_rounds_half_to_even_from_the_shortest_decimal():
    # 0.125 is exact in binary: half to even gives 0.12; 0.135 prints as 0.135 and goes to 0.14
    assert paper.agrees(0.125, "0.12").agrees and paper.agrees(0.135, "0.14").agrees


def _ratio(form: str, stated: str) -> paper.Ratio:
    return paper.Ratio("bert_1b67", "dgx1", "mpress", "recompute", 1.0, 1.0, "here", stated, stated=stated, form=form)


def test_claim_agreement_reads_a_ratio_as_the_paper_states_it():
    better = _ratio("better", "143.4%")  # "outperforms by 143.4%": num/den = 2.434
    assert paper.claim_agreement(better, 2.4344).agrees and not paper.claim_agreement(better, 2.4356).agrees
    assert paper.claim_agreement(_ratio("x", "1.8 x"), 1.84).agrees
    assert not paper.claim_agreement(_ratio("x", "1.8 x"), 1.86).agrees
    assert paper.claim_agreement(_ratio("reduction", "67%"), 0.334).agrees  # 66.6 % -> 67 %
    loss = _ratio("loss", "19.5%")  # either reading agrees: 1 + 19.5 % or 1 / (1 - 19.5 %)
    assert paper.claim_agreement(loss, 1.195).agrees and paper.claim_agreement(loss, 1 / (1 - 0.195)).agrees
    far = paper.claim_agreement(loss, 1.008)
    assert not far.agrees and far.differs_by == Decimal("-18.7")  # the closer reading: 0.8 % against 19.5 %
    identical = _ratio("identical", "identical")
    assert paper.claim_agreement(identical, 1.0004).agrees and not paper.claim_agreement(identical, 1.0006).agrees
    assert paper.claim_agreement(_ratio("range", "20.6-23.8%"), 1.2) is None
