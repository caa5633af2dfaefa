"""Rule-based rewards: hand cases per task (verl semantics) and the data_source dispatcher."""

import pytest

from dsrl.rewards import arithmetic, calculator, compute_score, gsm8k, worded
from dsrl.rewards import math as math_answer


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("She pays 3 + 4 = 7 dollars.\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas removed
        ("#### -12", "-12", 1.0),
        ("#### 3 then #### 8", "8", 1.0),  # the last marker counts
        ("#### 3 then #### 8", "3", 0.0),
        ("the answer is 7", "7", 0.0),  # strict: no marker, no reward
        ("####7", "7", 0.0),  # the marker needs its space
        ("#### 7.", "7", 0.0),  # exact string match, as verl
        ("#### 6", "7", 0.0),
        ("#### 7" + "x" * 400, "7", 0.0),  # only the last 300 characters are searched
    ],
)
def test_gsm8k_strict(response, truth, score):
    assert gsm8k.compute_score(response, truth) == score


def test_gsm8k_flexible_takes_the_last_number_as_written():
    assert gsm8k.extract_answer("so 3 apples, then 12 pears.", "flexible") == "12"
    assert gsm8k.extract_answer("total 1,234", "flexible") == "1,234"  # commas kept in flexible mode
    assert gsm8k.compute_score("I think it is 42 .", "42", method="flexible") == 1.0
    assert gsm8k.extract_answer("no digits here", "flexible") is None
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_answer("1", "loose")


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),  # single-character frac arguments braced
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),  # integer a/b
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces kept whole
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),  # \left \right and spaces removed
        ("\\boxed{10\\text{ inches}}", "10", 1.0),  # unit on the right
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),  # short left-hand side dropped
        ("first \\boxed{2}, finally \\boxed{3}", "3", 1.0),  # the last box counts
        ("first \\boxed{2}, finally \\boxed{3}", "2", 0.0),
        ("hence \\boxed 7$.", "7", 1.0),  # "\boxed " form, up to $
        ("\\boxed{4}", "5", 0.0),
        ("the answer is 5", "5", 0.0),  # no box
        ("\\boxed{5", "5", 0.0),  # unclosed
        ("\\fbox{5}", "5", 0.0),  # verl scores \fbox 0
        ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),  # string equivalence, not numeric
        ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # cannot be normalised -> raw strings compared
        ("\\boxed{\\sqrt}", "\\sqrt{}", 0.0),
    ],
)
def test_math(response, truth, score):
    assert math_answer.compute_score(response, truth) == score


def test_math_boxed_extraction_keeps_nesting():
    assert math_answer.last_boxed_answer("a \\boxed{\\frac{a}{\\sqrt{b}}} b") == "\\frac{a}{\\sqrt{b}}"
    assert math_answer.last_boxed_answer("\\boxed\\frac12") is None  # no brace right after \boxed


@pytest.mark.parametrize(
    "response, score",
    [
        ("82", 1.0),
        (" 82\n", 1.0),
        ("82<|im_end|>", 1.0),
        ("082", 1.0),
        ("83", 0.0),
        ("8 2", 0.0),
        ("82 83", 0.0),
        ("The answer is 82", 0.0),
        ("", 0.0),
        ("82<|im_end|>82", 0.0),
    ],
)
def test_arithmetic(response, score):
    assert arithmetic.compute_score(response, "82") == score


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
TOOL = "user\n<tool_response>\n56088\n</tool_response>\nassistant\n"  # decoded without special tokens


@pytest.mark.parametrize(
    "response, score",
    [
        (CALL + TOOL + "56088", 1.0),  # called, then copied the result
        (CALL + TOOL + "The answer is 56,088? No: 56088.", 1.0),  # the last integer counts
        ("56088", 1.0),  # no call: the whole response is the answer
        ("It is 56088\n", 1.0),
        (CALL + TOOL, 0.0),  # ended on the tool output: nothing after it
        (CALL + TOOL + "56089", 0.0),
        (CALL + TOOL + "56088 or 1", 0.0),
        (CALL + TOOL.replace("56088", "1") + "1" + TOOL + "56088", 1.0),  # after the last tool output
        (CALL + TOOL + "56088" + TOOL, 0.0),
        ("56088" + TOOL + "no number", 0.0),
        (CALL, 0.0),  # a call alone: its last integer is 456
        ("", 0.0),
        ("-56088", 0.0),
    ],
)
def test_calculator(response, score):
    assert calculator.compute_score(response, "56088") == score


def test_calculator_final_answer_is_after_the_last_tool_output():
    assert calculator.final_answer("a</tool_response>b</tool_response>c") == "c"
    assert calculator.final_answer("no tools") == "no tools"


@pytest.mark.parametrize(
    "response, score",
    [
        ("9", 1.0),
        ("4 + 5 = 9", 1.0),
        ("The answer is 9.", 1.0),
        ("4 + 5 = 10", 0.0),  # the last integer is the answer given
        ("9, or maybe 8", 0.0),
        ("The sum of 4 and", 0.0),  # cut off before any answer: the last integer is an operand
        ("The answer is", 0.0),
        ("-9", 0.0),
    ],
)
def test_worded(response, score):
    assert worded.compute_score(response, "9") == score
    assert compute_score("worded_arithmetic", response, "9") == score


def test_dispatch_by_data_source():
    assert compute_score("arithmetic", "7", "7") == 1.0
    assert compute_score("calculator", CALL + TOOL + "56088", "56088") == 1.0
    assert compute_score("openai/gsm8k", "#### 7", "7", extra_info={"split": "test"}) == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert compute_score(source, "\\boxed{7}", "7") == 1.0
    assert isinstance(compute_score("arithmetic", "7", "8"), float)


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(
        ValueError, match=r"no built-in reward.*'arithmetic'.*'openai/gsm8k'.*custom_reward_function.path"
    ):
        compute_score("my/dataset", "7", "7")
