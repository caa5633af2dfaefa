"""Calculator reward: the last integer of the final answer, i.e. of the text after the last tool output.

The response of a tool-integrated rollout (data_source ``"calculator"``, ``dsrl.data.calculator``)
holds every turn, decoded: the model's calls, the tool outputs rendered by the chat template as
``<tool_response>\\n...\\n</tool_response>``, and its later turns. The final answer is the text after
the last ``</tool_response>`` (the whole response when the model called nothing); it scores 1.0 when
its last integer equals the ground truth. So the model must copy a tool's result into a turn of its
own: a response that ends on a tool output (the turn budget ran out) scores 0.
"""

from dsrl.rewards import worded

TOOL_RESPONSE_END = "</tool_response>"


def final_answer(solution_str: str) -> str:
    """The text after the last tool output, or the whole response when there is none."""
    return solution_str.rpartition(TOOL_RESPONSE_END)[2]


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last integer of ``final_answer(solution_str)`` equals ``ground_truth``, else 0.0."""
    return worded.compute_score(final_answer(solution_str), ground_truth)
