r"""Math answer verification with math-verify, shared by training (a TRL reward function) and evaluation.

Training and ``opefo-eval`` call the same :func:`verify_completion`, so a completion is scored identically in both.

Answer extraction (:func:`extract_answer`):

- The final answer is whichever comes last in the completion: the last ``\boxed{...}`` (Qwen2.5-Math prompts) or the
  last line of the form ``Answer: ...`` (DAPO-Math prompts; ``**Answer:**`` also accepted). A bare ``Answer:`` line is
  parsed as LaTeX (``Answer: 3\sqrt{13}`` gives ``3*sqrt(13)``, not ``3``); ``$...$`` inside it is honoured and a
  lone ``$`` (``Answer: $42``, DAPO's ``$Answer`` placeholder taken literally) is dropped.
- Otherwise math-verify's anchored extraction ("the final answer is $x$") is used; a completion with no answer
  scores 0.

Modes (``math_reward_mode``, :mod:`opefo_trl.data.reward_modes`; README's "The math reward: what it pays" has a table
of examples):

- ``"equivalent"`` (default, :func:`math_accuracy_reward`): any answer math-verify finds equal to the gold is paid,
  an expression included, so a restated question ("The answer is 6 + 3." against 9) is paid.
- ``"strict"`` (:func:`build_math_accuracy_reward`): an answer that still holds arithmetic on numbers
  (:func:`leaves_arithmetic`: ``6 + 3``, ``3 \times 9``, ``2^{10}``, ``54/2``, ``3 * 9 = 27``) scores 0 with status
  ``"not_final"``, unless the gold answer is written the same way; and a completion that is nothing but a number or
  expression (one of math-verify's own unanchored patterns spans all of it: ``27``, ``$\frac{1}{2}$``) is read as
  its answer, after the ``\boxed`` and ``Answer:`` forms and before the anchored phrases. math-verify reduces a LaTeX
  fraction of integers while parsing, so ``\boxed{\frac{54}{2}}`` is read as 27 and paid.

Gold answers are parsed as LaTeX (a bare ``3\sqrt{13}`` is read as ``\boxed{3\sqrt{13}}``; TRL's ``accuracy_reward``
parses a bare gold as a plain expression and reads it as ``3``). A list of gold answers (OlympiadBench's
``final_answer``) is one answer made of several values. A gold answer that cannot be parsed gives ``None`` -- never 0
-- and TRL then leaves that completion out of the advantage baseline.

Failures: a timeout or an exception while parsing or comparing gives ``None`` (the completion is left out rather
than punished as wrong), is counted in :data:`VERIFICATION_FAILURES`, logged as a warning, and, inside a TRL
trainer, logged as the metric ``rewards/math_accuracy_reward/failures`` (mean failed completions per reward call and
process). math-verify's timeouts use ``signal.alarm``, which only exists in the main thread: GRPOTrainer and
``opefo-eval`` call the reward there. Called from another thread the reward still works, but without timeouts, so
a pathological expression (e.g. a tower of powers) can take arbitrarily long there.

``trl.rewards.accuracy_reward`` is not reused directly: it reads only ``\boxed``/``$...$`` answers (a DAPO
``Answer: 42`` line scores 0), takes conversational completions only, and turns verification errors into 0.

Example:
    >>> from opefo_trl.data.rewards import math_accuracy_reward, score_completion, extract_answer
    >>> score_completion(r"... so the total is \boxed{\frac{1}{2}}.", "0.5")
    1.0
    >>> score_completion("Step 1 ...\nAnswer: 41", "42")
    0.0
    >>> extract_answer("Step 1 ...\nAnswer: 3\\sqrt{13}")
    '3*sqrt(13)'
    >>> completions = [[{"role": "assistant", "content": "Answer: 42"}], [{"role": "assistant", "content": "no idea"}]]
    >>> math_accuracy_reward(completions, solution=["42", "42"])
    [1.0, 0.0]
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from opefo_trl._extras import needs_extra
from opefo_trl.data.prompts import completion_to_text, gold_to_text
from opefo_trl.data.reward_modes import DEFAULT_MATH_REWARD_MODE, STRICT, check_math_reward_mode

with needs_extra("math", "math_verify", "The math-verify reward (opefo_trl.data.rewards, math_accuracy_reward)"):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException
    from math_verify.parser import get_extraction_regexes
    from sympy import Add, Basic, Dummy, Mul, Number, Pow, UnevaluatedExpr
    from sympy.functions.combinatorial.factorials import factorial

logger = logging.getLogger(__name__)

REWARD_NAME = "math_accuracy_reward"
FAILURES_METRIC = f"rewards/{REWARD_NAME}/failures"
GOLD_UNPARSEABLE_METRIC = f"rewards/{REWARD_NAME}/gold_unparseable"
NOT_FINAL_METRIC = f"rewards/{REWARD_NAME}/not_final"

# math-verify timeouts (seconds) used on the main thread; off the main thread signal.alarm is unavailable.
PARSING_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5

# Statuses of a Verification.
CORRECT = "correct"
WRONG = "wrong"
NO_ANSWER = "no_answer"
GOLD_UNPARSEABLE = "gold_unparseable"
FAILED = "failed"
NOT_FINAL = "not_final"  # strict mode: the answer leaves arithmetic on numbers undone ("6 + 3"), scored 0

_BOXED_RE = re.compile(r"\\boxed\b|\\fbox\b")
# A line "Answer: ...", optionally in markdown bold ("**Answer:** 42", "**Answer: 42**").
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_ANSWER_LINE_RE = re.compile(r"(?im)^[ \t>*_#]*answer[ \t*_]*:[ \t*_]*(?P<answer>\S.*?)[ \t*_]*$")

# Extraction from a whole completion when it has neither \boxed nor an "Answer:" line: anchored only, so stray
# numbers in the reasoning are not taken as the answer.
_ANCHORED_EXTRACTION = [
    LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
    ExprExtractionConfig(try_extract_without_anchor=False),
]
# math-verify's default LaTeX normalisation (units, malformed operators such as \frac12, ...), as lighteval uses.
_BOXED_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0)]
# Strict mode: a completion that is nothing but a number or expression ("27", "1 + 7", "$\frac{1}{2}$") is its
# own answer. It is one when one of math-verify's own extraction patterns (unanchored) spans all of it.
_BARE_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
_BARE_PATTERNS = [pattern for patterns, _ in get_extraction_regexes(_BARE_EXTRACTION) for pattern, _ in patterns]


class FailureCounter:
    """A thread-safe count of verifications that timed out or raised, with the last error seen.

    Example:
        >>> from opefo_trl.data.rewards import VERIFICATION_FAILURES
        >>> before = VERIFICATION_FAILURES.count  # grows whenever a completion could not be verified
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.last_error: str | None = None

    def add(self, error: str) -> None:
        with self._lock:
            self.count += 1
            self.last_error = error

    def reset(self) -> None:
        with self._lock:
            self.count = 0
            self.last_error = None


VERIFICATION_FAILURES = FailureCounter()


class VerificationFailure(RuntimeError):
    """math-verify timed out or raised while parsing or comparing an answer."""


@dataclass(frozen=True)
class Verification:
    """The outcome of checking one completion against one gold answer.

    Attributes:
        score: 1.0 (correct), 0.0 (wrong or no answer) or ``None`` (gold unparseable or verification failed).
        status: one of ``"correct"``, ``"wrong"``, ``"no_answer"``, ``"gold_unparseable"``, ``"failed"``.
        answer: the extracted answer in canonical (SymPy string) form, used for majority voting; ``None`` if none.
        error: what went wrong when ``status == "failed"``.
        gold_failed: the failure was in parsing the gold answer (the problem, not this completion, is unscorable).
    """

    score: float | None
    status: str
    answer: str | None = None
    error: str | None = None
    gold_failed: bool = False

    @property
    def gold_scorable(self) -> bool:
        """Whether the gold answer could be read, so that the problem can be scored at all."""
        return self.status != GOLD_UNPARSEABLE and not self.gold_failed


def _timeouts() -> tuple[int | None, int | None]:
    """(parsing, verify) timeouts: math-verify's signal.alarm timeouts only work on the main thread."""
    if threading.current_thread() is threading.main_thread():
        return PARSING_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None


def _parse(text: str, extraction_config, extraction_mode: str = "first_match") -> list:
    """math-verify parse that raises VerificationFailure instead of returning [] on a timeout or an error."""
    parsing_timeout, _ = _timeouts()
    try:
        return parse(
            text,
            extraction_config=extraction_config,
            extraction_mode=extraction_mode,
            fallback_mode="no_fallback",
            parsing_timeout=parsing_timeout,
            raise_on_error=True,
        )
    except TimeoutException as err:
        raise VerificationFailure(f"math-verify parsing timed out after {parsing_timeout} s") from err
    except Exception as err:
        raise VerificationFailure(f"math-verify parsing raised {type(err).__name__}: {err}") from err


@lru_cache(maxsize=8192)
def _parse_gold(gold_text: str) -> tuple:
    """Parse a gold answer; () when it cannot be parsed. Cached: a group of G completions shares one gold."""
    if not gold_text:
        return ()
    if _BOXED_RE.search(gold_text) or "$" in gold_text:
        parsed = _parse(gold_text, _BOXED_EXTRACTION + [ExprExtractionConfig()], extraction_mode="any_match")
    else:
        parsed = _parse(f"\\boxed{{{gold_text}}}", _BOXED_EXTRACTION)
    return tuple(parsed)


def _answer_region(text: str, mode: str = DEFAULT_MATH_REWARD_MODE) -> tuple[str, list]:
    """Choose where the final answer is and the extraction config that reads it.

    The last ``\boxed`` and the last ``Answer:`` line compete: whichever starts later wins. In strict mode a
    completion that is only a number or expression comes next, before the anchored phrases.
    """
    boxed_starts = [m.start() for m in _BOXED_RE.finditer(text)]
    answer_lines = list(_ANSWER_LINE_RE.finditer(text))
    last_boxed = boxed_starts[-1] if boxed_starts else -1
    last_answer = answer_lines[-1] if answer_lines else None
    if last_answer is not None and last_answer.start() > last_boxed:
        answer = last_answer.group("answer").strip().rstrip(".").strip()
        dollars = len(_UNESCAPED_DOLLAR_RE.findall(answer))
        if _BOXED_RE.search(answer) or (dollars and dollars % 2 == 0):
            return answer, _BOXED_EXTRACTION  # "$...$" or \boxed inside the line: math-verify reads it as is
        # Bare LaTeX, or DAPO's literal "$Answer" placeholder style ("Answer: $42"): drop stray dollars and box it.
        return f"\\boxed{{{_UNESCAPED_DOLLAR_RE.sub('', answer).strip()}}}", _BOXED_EXTRACTION
    if last_boxed >= 0:
        # Only the last \boxed: math-verify would merge several boxed answers into a set.
        return text[last_boxed:], _BOXED_EXTRACTION
    if mode == STRICT:
        bare = text.strip().removesuffix(".").strip()
        if bare and any(pattern.fullmatch(bare) for pattern in _BARE_PATTERNS):
            return bare, _BARE_EXTRACTION
    return text, _ANCHORED_EXTRACTION


def _extract(text: str, mode: str = DEFAULT_MATH_REWARD_MODE) -> list:
    region, config = _answer_region(text, mode)
    return _parse(region, config)


# The operations whose undone form ("6 + 3", "3 \times 9", "2^{10}", "3!") strict mode refuses; an equation is
# refused for its sides ("3 * 9 = 27" holds 3 * 9).
_OPERATIONS = (Add, Mul, Pow, factorial)


def _is_written_number(node) -> bool:
    """A number as one writes it: ``27``, ``27.0``, ``-3``, or a fraction of two numbers that is not a whole number
    (``1/2``, ``-3/4``; ``54/2`` is a division left undone)."""
    if isinstance(node, Number):
        return True
    factors = node.args if isinstance(node, Mul) else (node,) if isinstance(node, Pow) else None
    if factors is None:
        return False
    numerators = [f for f in factors if isinstance(f, Number) and f != -1]
    denominators = [f for f in factors if isinstance(f, Pow) and f.exp == -1 and isinstance(f.base, Number)]
    if len(numerators) + len(denominators) + sum(f == -1 for f in factors) != len(factors):
        return False  # a factor that is neither a number, a sign nor 1/number
    if len(numerators) > 1 or len(denominators) > 1:
        return False
    if not denominators:
        return True  # a signed number
    value = node.doit()  # 54/2 (or 54/2.0: math-verify reads "54/2." with a decimal point) is a whole 27
    return not (value.is_Integer or (value.is_Float and value.is_finite and float(value).is_integer()))


def _undone_arithmetic(node) -> bool:
    """Whether ``node`` holds an operation on numbers only that sympy would still carry out to a number."""
    if not isinstance(node, Basic) or _is_written_number(node):
        return False
    if isinstance(node, _OPERATIONS) and not node.free_symbols:
        value = node.doit()
        if isinstance(value, Number):
            return True
    return any(_undone_arithmetic(arg) for arg in node.args)


def leaves_arithmetic(answer) -> bool:
    r"""Whether a parsed answer (a math-verify / SymPy expression) still holds arithmetic on numbers: ``6 + 3``,
    ``3 \times 9``, ``2^{10}``, ``54/2``, ``3 * 9 = 27``. A number (``27``, ``27.0``, ``-3``, ``1/2``, ``50\%``) or an
    expression with nothing left to compute (``3\sqrt{13}``, ``\frac{\pi}{2}``, ``x^2 + 1``) does not.

    Example:
        >>> from math_verify import parse
        >>> leaves_arithmetic(parse("$6 + 3$")[0]), leaves_arithmetic(parse("$3\\sqrt{13}$")[0])
        (True, False)
    """
    if not isinstance(answer, Basic):
        return False
    # math-verify holds a percentage as n * UnevaluatedExpr(1/100): "50%" is a number, not 50 * 1/100 to compute.
    percentages = {held: Dummy() for held in answer.atoms(UnevaluatedExpr)}
    return _undone_arithmetic(answer.xreplace(percentages))


def _canonical(parsed: Sequence) -> str | None:
    return str(parsed[0]) if parsed else None


def _compare(gold: Sequence, answer: Sequence) -> bool:
    """True if any (gold, answer) pair verifies; raises VerificationFailure only if none did and one failed."""
    _, verify_timeout = _timeouts()
    failure = None
    for g in gold:
        for a in answer:
            try:
                if verify(g, a, timeout_seconds=verify_timeout, raise_on_error=True):
                    return True
            except TimeoutException:
                failure = f"math-verify comparison timed out after {verify_timeout} s"
            except Exception as err:
                failure = f"math-verify comparison raised {type(err).__name__}: {err}"
    if failure is not None:
        raise VerificationFailure(failure)
    return False


def verify_completion(text: str, gold: Any, mode: str = DEFAULT_MATH_REWARD_MODE) -> Verification:
    r"""Check ``text`` (a completion) against ``gold`` and say how it went.

    Never raises for bad input or math-verify errors: those become ``status="failed"`` (counted in
    :data:`VERIFICATION_FAILURES`) or ``status="gold_unparseable"``. ``mode``: the ``math_reward_mode``
    (:mod:`opefo_trl.data.reward_modes`); in ``"strict"`` mode an answer that leaves arithmetic undone
    (:func:`leaves_arithmetic`) and is not written as the gold is gets ``status="not_final"``, score 0, no answer.

    Example:
        >>> verify_completion("Answer: $\\frac{2}{4}$", "1/2")
        Verification(score=1.0, status='correct', answer='1/2', error=None, gold_failed=False)
        >>> verify_completion(r"\boxed{7}", r"\frac{").status
        'gold_unparseable'
        >>> restated = "The answer is 6 + 3."
        >>> verify_completion(restated, "9").score, verify_completion(restated, "9", "strict")
        (1.0, Verification(score=0.0, status='not_final', answer=None, error=None, gold_failed=False))
    """
    if not isinstance(text, str):
        raise TypeError(f"A completion must be a str, got {type(text).__name__}.")
    check_math_reward_mode(mode)
    try:
        gold_parsed = _parse_gold(gold_to_text(gold))
    except VerificationFailure as err:
        VERIFICATION_FAILURES.add(str(err))
        return Verification(score=None, status=FAILED, error=f"gold answer {gold!r}: {err}", gold_failed=True)
    if not gold_parsed:
        return Verification(score=None, status=GOLD_UNPARSEABLE)
    try:
        answer = _extract(text, mode)
    except VerificationFailure as err:
        VERIFICATION_FAILURES.add(str(err))
        return Verification(score=None, status=FAILED, error=str(err))
    if not answer:
        return Verification(score=0.0, status=NO_ANSWER)
    if mode == STRICT:
        # Written as the gold is written ("2^{10}" against "2^{10}"): the answer's form, computation or not.
        answer = [a for a in answer if not leaves_arithmetic(a) or any(a == g for g in gold_parsed)]
        if not answer:
            return Verification(score=0.0, status=NOT_FINAL)
    try:
        correct = _compare(gold_parsed, answer)
    except VerificationFailure as err:
        VERIFICATION_FAILURES.add(str(err))
        return Verification(score=None, status=FAILED, answer=_canonical(answer), error=str(err))
    return Verification(score=1.0 if correct else 0.0, status=CORRECT if correct else WRONG, answer=_canonical(answer))


def score_completion(text: str, gold: Any, mode: str = DEFAULT_MATH_REWARD_MODE) -> float | None:
    r"""1.0 if the final answer in ``text`` equals ``gold`` (math-verify), 0.0 if not or absent, ``None`` if the gold
    answer cannot be parsed or verification failed (counted in :data:`VERIFICATION_FAILURES`). ``mode``: see
    :func:`verify_completion`.

    Example:
        >>> score_completion(r"The final answer is \boxed{42}.", "42"), score_completion("Answer: 41", "42")
        (1.0, 0.0)
        >>> score_completion("27", "27", "strict"), score_completion(r"\boxed{3 \times 9}", "27", "strict")
        (1.0, 0.0)
    """
    return verify_completion(text, gold, mode).score


def extract_answer(text: str, mode: str = DEFAULT_MATH_REWARD_MODE) -> str | None:
    r"""The final answer of a completion in canonical form (a SymPy string), or ``None`` when there is none (in
    ``"strict"`` mode, also when the answer leaves arithmetic undone: see :func:`leaves_arithmetic`).

    Equal answers written differently map to the same string, which is what majority voting needs.

    Example:
        >>> extract_answer(r"so \boxed{\frac{1}{2}}"), extract_answer("Answer: 1/2"), extract_answer("no answer")
        ('1/2', '1/2', None)
        >>> extract_answer("Answer: 3 * 9"), extract_answer("Answer: 3 * 9", "strict"), extract_answer("27", "strict")
        ('3*9', None, '27')
    """
    if not isinstance(text, str):
        raise TypeError(f"A completion must be a str, got {type(text).__name__}.")
    check_math_reward_mode(mode)
    try:
        answer = _extract(text, mode)
        if mode == STRICT:
            answer = [a for a in answer if not leaves_arithmetic(a)]
        return _canonical(answer)
    except VerificationFailure as err:
        VERIFICATION_FAILURES.add(str(err))
        logger.warning("Could not extract an answer: %s", err)
        return None


def math_accuracy_reward(
    completions: list,
    solution: list,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    r"""TRL reward function: 1.0 for a correct final answer, 0.0 for a wrong or missing one, ``None`` when the gold
    answer cannot be parsed or verification failed (TRL then ignores the completion). Math reward mode
    ``"equivalent"``: any answer math-verify finds equal to the gold is paid; :func:`build_math_accuracy_reward`
    makes the ``"strict"`` one.

    Args:
        completions: Conversational completions (lists of messages; the last assistant message is scored, see
            :func:`opefo_trl.data.prompts.completion_to_text`) or plain strings.
        solution: Gold answers, one per completion (the data set's ``solution`` column). Lists are allowed.
        log_metric: Passed by TRL's GRPOTrainer; receives ``rewards/math_accuracy_reward/failures`` (failed
            verifications in this call) and ``rewards/math_accuracy_reward/gold_unparseable``.
        log_extra: Passed by TRL's GRPOTrainer; adds ``answer`` and ``verification`` columns to the completions table.
        **kwargs: Other columns and trainer arguments, ignored.

    Example:
        >>> from opefo_trl.data.rewards import math_accuracy_reward
        >>> math_accuracy_reward([r"\boxed{4}", "Answer: 5", r"\boxed{4}"], solution=["4", "4", r"\frac{"])
        [1.0, 0.0, None]
        >>> # GRPOTrainer(..., reward_funcs=math_accuracy_reward, train_dataset=ds_with_solution_column)
    """
    return _score_batch(completions, solution, DEFAULT_MATH_REWARD_MODE, log_metric, log_extra)


def build_math_accuracy_reward(mode: str = DEFAULT_MATH_REWARD_MODE) -> Callable[..., list[float | None]]:
    r"""The TRL reward function ``math_accuracy_reward`` in a given ``math_reward_mode``
    (:mod:`opefo_trl.data.reward_modes`). It is named ``math_accuracy_reward`` in either mode, so its metrics are
    ``rewards/math_accuracy_reward/...``; in ``"strict"`` mode it also logs ``rewards/math_accuracy_reward/not_final``
    (completions refused for leaving arithmetic undone).

    Example:
        >>> strict_reward = build_math_accuracy_reward("strict")
        >>> strict_reward(["The answer is 6 + 3.", "The answer is 9.", "9"], solution=["9", "9", "9"])
        [0.0, 1.0, 1.0]
        >>> math_accuracy_reward(["The answer is 6 + 3.", "The answer is 9.", "9"], solution=["9", "9", "9"])
        [1.0, 1.0, 0.0]
    """
    check_math_reward_mode(mode)
    if mode == DEFAULT_MATH_REWARD_MODE:
        return math_accuracy_reward

    def reward(completions, solution, log_metric=None, log_extra=None, **kwargs):
        return _score_batch(completions, solution, mode, log_metric, log_extra)

    reward.__name__ = reward.__qualname__ = REWARD_NAME
    reward.__doc__ = f"math_accuracy_reward in math_reward_mode={mode!r}: see opefo_trl.data.rewards."
    return reward


def _score_batch(completions, solution, mode, log_metric, log_extra) -> list[float | None]:
    if len(completions) != len(solution):
        raise ValueError(
            f"math_accuracy_reward got {len(completions)} completions but {len(solution)} solutions; "
            "the data set needs a `solution` column with one gold answer per prompt."
        )
    results = [
        verify_completion(completion_to_text(c), gold, mode) for c, gold in zip(completions, solution, strict=True)
    ]
    failures = [r for r in results if r.status == FAILED]
    num_gold_unparseable = sum(r.status == GOLD_UNPARSEABLE for r in results)
    if failures:
        logger.warning(
            "%d of %d completions could not be verified and get reward None (excluded), first error: %s",
            len(failures),
            len(results),
            failures[0].error,
        )
    if log_metric is not None:
        log_metric(FAILURES_METRIC, float(len(failures)))
        log_metric(GOLD_UNPARSEABLE_METRIC, float(num_gold_unparseable))
        if mode == STRICT:
            log_metric(NOT_FINAL_METRIC, float(sum(r.status == NOT_FINAL for r in results)))
    if log_extra is not None:
        log_extra("answer", [r.answer if r.answer is not None else "" for r in results])
        log_extra("verification", [r.status for r in results])
    return [r.score for r in results]


math_accuracy_reward.__name__ = REWARD_NAME
