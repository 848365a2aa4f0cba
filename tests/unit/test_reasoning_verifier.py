"""The reasoning calibration's verifier: explicit final answers only, compared as numbers by sympy."""
from benchmarks.reasoning import answers_equal, extract_answer, verify


def test_equivalent_forms_of_the_right_answer_are_accepted():
    for text in ("so 1234 in total.\nAnswer: 1234", "The answer is 1,234.", "Answer: 1234.0",
                 "We get \\boxed{1234}", "Answer: $1,234", "answer = 2468/2", "The answer is: 1234"):
        assert verify(text, "1234"), text
    assert verify("Answer: 0.75", "3/4") and verify("Answer: -4", "-4")


def test_wrong_missing_or_non_numeric_answers_are_rejected():
    assert not verify("Answer: 1235", "1234")
    assert not verify("1234 is what we get", "1234")  # no explicit final answer: no last-number guess
    assert not verify("Answer: -1234", "1234")
    assert not verify("Answer: 12345", "1234")
    assert not answers_equal(None, "1234") and not answers_equal("12a", "12")
    assert not verify("Answer: 0.7", "3/4")


def test_the_last_stated_answer_wins():
    assert extract_answer("Answer: 3 ... wait, the answer is 5") == "5"
    assert verify("Answer: 3\nActually the answer is 5.", "5") and not verify("Answer: 5\nAnswer: 3", "5")
