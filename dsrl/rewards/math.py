"""MATH reward: the last ``\\boxed{...}`` answer, equivalent to the ground truth after normalisation.

Semantics of the Hendrycks MATH grader (Hendrycks et al. 2021, https://arxiv.org/abs/2103.03874)
as lm-evaluation-harness and verl's ``math_reward.py`` apply it, so that a verl user gets the
same scores:

- Answer: the content of the last ``\\boxed{...}`` (braces matched, so nesting is kept), or the
  text after the last ``"\\boxed "`` up to ``$``. No boxed answer, an unclosed brace, or an
  ``\\fbox`` scores 0.
- Equivalence: both strings normalised by :func:`normalize_answer` and compared exactly. When a
  string cannot be normalised (two ``\\text{ `` units, a dangling ``\\sqrt`` or ``\\frac``), the raw
  strings are compared instead.

Score 1.0 if equivalent, else 0.0. All operations are linear string scans (no regex, no sympy), so
a pathological response cannot make this hang.
"""


def last_boxed_answer(text: str) -> str | None:
    """The content of the last boxed answer in ``text`` (see module doc), or None."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    open_at = start + len("\\boxed")
    if start < 0 or text[open_at : open_at + 1] != "{":
        return None
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def _drop_text_units(s: str) -> str:
    # In MATH, "\text{ " (with a space) only ever introduces a unit on the right.
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one \\text{ unit")
    return parts[0]


def _brace_sqrt_arguments(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (single-character arguments only)."""
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise ValueError("\\sqrt without an argument")
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _brace_frac_arguments(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (single characters only)."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise ValueError("\\frac without arguments")
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s
        numerator, second = part[0], part[1]
        if second == "{":
            out.append("\\frac{" + numerator + "}" + part[1:])
        else:
            out.append("\\frac{" + numerator + "}{" + second + "}" + part[2:])
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are plain integers."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{numerator}/{denominator}":
        return s
    return f"\\frac{{{numerator}}}{{{denominator}}}"


def normalize_answer(answer: str) -> str:
    """Canonical form of a MATH answer string; ValueError when it cannot be normalised.

    Removes line breaks, ``\\!``, ``\\left``/``\\right``, degree marks, ``\\$``, a right-hand
    ``\\text{ unit}``, ``\\%`` and spaces; ``tfrac``/``dfrac`` -> ``frac``; ``.5`` -> ``0.5``;
    drops a short left-hand side (``x = 3`` -> ``3``); braces single-character ``\\sqrt`` and
    ``\\frac`` arguments; ``0.5`` -> ``\\frac{1}{2}``; integer ``a/b`` -> ``\\frac{a}{b}``.
    """
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _drop_text_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs_rhs = s.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:
        s = lhs_rhs[1]
    s = _brace_sqrt_arguments(s)
    s = s.replace(" ", "")
    s = _brace_frac_arguments(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Normalised string equality; raw equality when either string cannot be normalised."""
    try:
        return normalize_answer(answer) == normalize_answer(ground_truth)
    except ValueError:
        return answer == ground_truth


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    answer = last_boxed_answer(solution_str)
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0
