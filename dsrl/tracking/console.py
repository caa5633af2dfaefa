"""What a run prints: log lines, the progress of training, the start-up and the final summary, the refusals.

Log lines (``setup_logging``), one per record of the ``dsrl`` logger and its children, on stdout::

    [dsrl r0 18:42:07] resumed from checkpoints/dsrl/grpo/global_step_4 (step 4; loaded in 1.20 s)
    [dsrl r0 18:42:07] warning: dropped 2 of 10 prompts longer than data.max_prompt_length=40 tokens ...

Rank 0 prints every record; other ranks print only the records logged with
``extra={"all_ranks": True}`` (what a rank says about itself, e.g. a signal it received). A warning
prints once: a second record with the same level and text is dropped. Python ``warnings`` raised in
dsrl's own files become such warning records (once per category and text; rank 0 only, every rank
for ``RankWarning``); warnings from other packages are shown as Python shows them.

Training progress (``ProgressConsole``, the Tracker's console backend, rank 0 only). On a terminal, a
tqdm bar over the training steps (as verl's ``tqdm(total=total_training_steps,
initial=global_steps)``; resumed runs start at their step; ETA and rate from the mean step time) with
the key numbers as its postfix; validation results and log lines are written above the bar. When
stdout is not a terminal (CI, ``> log``, the deepspeed launcher's pipe), one line per step::

    [dsrl r0 18:42:10] step  3/10 score=0.25 resp_len=31.4 kl=0.0012 step_s=1.50 tok/s=812 eta 0:00:11
    [dsrl r0 18:42:10] validation at step 3: val-core/arithmetic/acc/mean@1=0.375

Labels: ``score`` = critic/score/mean (mean sequence reward), ``resp_len`` = response_length/mean
(tokens), ``kl`` = actor/kl_loss, else actor/reward_kl_penalty, ``step_s`` = timing_s/step
(seconds), ``tok/s`` = perf/throughput (prompt + response tokens per second per rank, verl's
definition), ``eta`` = the mean wall time per step of this run so far (validation and checkpoints
included) times the steps left. Failure counts follow only when non-zero: ``reward_exceptions``,
``reward_timeouts``, ``reward_invalid``, ``reward_crashes`` (reward/fail_exception, reward/fail_timeout,
reward/fail_invalid, reward/fail_crash), ``tracking_failures``, ``tracking_dropped``
(tracking/failures, tracking/dropped), ``rollout_mismatch`` (training/rollout_mismatch_streak: steps in a row
whose rollout-vs-actor gap is above algorithm.rollout_mismatch.max_probs_diff); on a validation line, the reward
failures of the validation (val-aux/reward/fail_*). Metrics logged at a step not after the last one shown (the
validation before training, at step 0 or at the resumed step) print as a validation line only.

Summaries (``startup_summary``, ``final_summary``): ``key: value`` blocks under a title, to log with
``logger.info``; the keys of their ``facts`` are in their docstrings. Every log line, a record's
traceback included, goes through ``dsrl.runtime.redaction.redact_text``: a secret that reached a path (e.g.
``trainer.default_local_dir``) prints as ``***``. Nothing here imports torch or MLflow; tqdm is
imported when a bar is drawn.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

from dsrl.runtime.redaction import redact_text

logger = logging.getLogger("dsrl")

_DSRL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dsrl/
_active_bar: Any = None  # the tqdm bar drawn now (log lines are written above it), or None


class RankWarning(UserWarning):
    """A Python warning about this rank alone: shown on every rank (other dsrl warnings on rank 0)."""


def line_prefix(rank: int, when: float | None = None) -> str:
    """``[dsrl r<rank> HH:MM:SS]`` (local time ``when``, default now)."""
    return f"[dsrl r{rank} {time.strftime('%H:%M:%S', time.localtime(when))}]"


def _write_line(text: str, stream: TextIO) -> None:
    """One line on ``stream``, above the progress bar when one is drawn there."""
    bar = _active_bar
    if bar is not None and bar.fp == stream:
        bar.write(text, file=stream)
    else:
        stream.write(text + "\n")
    stream.flush()


class _Formatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return redact_text(f"{line_prefix(self.rank, record.created)} {text}")


class _ConsoleHandler(logging.Handler):
    """Writes to ``stream`` (default: ``sys.stdout`` at the time of the record); rank filter; warnings once."""

    def __init__(self, rank: int, stream: TextIO | None):
        super().__init__()
        self.rank = rank
        self._stream = stream
        self._warned: set[tuple] = set()
        self.setFormatter(_Formatter(rank))

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.rank != 0 and not getattr(record, "all_ranks", False):
                return
            if record.levelno >= logging.WARNING:
                key = (record.levelno, getattr(record, "warning_category", None), record.getMessage())
                if key in self._warned:
                    return
                self._warned.add(key)
            _write_line(self.format(record), self.stream)
        except Exception:
            self.handleError(record)


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while ``setup_logging`` is in effect: dsrl's warnings become log records."""
    if os.path.abspath(filename).startswith(_DSRL_DIR):
        text = str(message) if category is UserWarning else f"{message} ({category.__name__})"
        extra = {"all_ranks": issubclass(category, RankWarning), "warning_category": category.__name__}
        logger.warning(text, extra=extra)
        return
    _showwarning.previous(message, category, filename, lineno, file, line)


_showwarning.previous = warnings.showwarning


def setup_logging(rank: int = 0, *, stream: TextIO | None = None) -> logging.Logger:
    """Make the ``dsrl`` logger print ``[dsrl r<rank> HH:MM:SS] message`` lines (INFO and up) to
    ``stream`` (default: ``sys.stdout`` when each record is written); see the module docstring for
    the rank filter and warnings. Idempotent: calling it again replaces its handler. Records still
    propagate to the root logger (where nothing prints unless a program installs a handler, as
    pytest's ``caplog`` does). Returns the ``dsrl`` logger."""
    for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(_ConsoleHandler(rank, stream))
    logger.setLevel(logging.INFO)
    if warnings.showwarning is not _showwarning:
        _showwarning.previous = warnings.showwarning
        warnings.showwarning = _showwarning
    return logger


# ---- training progress ---------------------------------------------------------------------------

# (label, the metric keys it shows (the first present), format)
STEP_FIELDS = (
    ("score", ("critic/score/mean",), "{:.4g}"),
    ("resp_len", ("response_length/mean",), "{:.1f}"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty"), "{:.3g}"),
    ("step_s", ("timing_s/step",), "{:.2f}"),
    ("tok/s", ("perf/throughput",), "{:.0f}"),
)
# (label, metric key): counts shown only when non-zero
FAILURE_FIELDS = (
    ("reward_exceptions", "reward/fail_exception"),
    ("reward_timeouts", "reward/fail_timeout"),
    ("reward_invalid", "reward/fail_invalid"),
    ("reward_crashes", "reward/fail_crash"),
    ("tracking_failures", "tracking/failures"),
    ("tracking_dropped", "tracking/dropped"),
    ("rollout_mismatch", "training/rollout_mismatch_streak"),
)


def refuse(header: str, problems: list[str]) -> int:
    """Exit code 2 with the problems (one line each) printed once, by rank 0; a run of several ranks has
    gathered every rank's (the preflight, ``dsrl.trainer.setup.problems_of_every_rank``)."""
    if os.environ.get("RANK", "0") == "0":
        print(redact_text(f"dsrl: {header}:"), file=sys.stderr)
        for problem in problems:
            print(redact_text(f"  {problem}"), file=sys.stderr, flush=True)
    return 2


def validation_keys(metrics: dict[str, float]) -> list[str]:
    """The ``val-core/<data_source>/<var>/mean@N`` keys of ``metrics``, sorted."""
    return sorted(k for k in metrics if k.startswith("val-core/") and k.rpartition("/")[2].startswith("mean@"))


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``0:00:11``)."""
    return str(timedelta(seconds=round(seconds)))


def _fields(metrics: dict[str, float]) -> str:
    shown = []
    for label, keys, fmt in STEP_FIELDS:
        key = next((k for k in keys if k in metrics), None)
        if key is not None:
            shown.append(f"{label}={fmt.format(metrics[key])}")
    rounds = metrics.get("train/num_gen_batches", 1)  # dynamic sampling's generation rounds (algorithm.filter_groups)
    if rounds > 1:
        shown.append(f"rounds={rounds:.0f}")
    return " ".join(shown + _failures(metrics))


def _failures(metrics: dict[str, float], prefix: str = "") -> list[str]:
    """``label=count`` of the FAILURE_FIELDS whose ``prefix + key`` is non-zero."""
    shown = []
    for label, key in FAILURE_FIELDS:
        value = metrics.get(prefix + key, 0)
        if value and not (isinstance(value, float) and math.isnan(value)):
            shown.append(f"{label}={value:.0f}")
    return shown


class ProgressConsole:
    """The console backend of the Tracker (rank 0): a tqdm bar on a terminal, else a line per step.

    ``log_metrics(metrics, step)`` once per training step (and for validation results), ``finish()``
    at the end (idempotent). ``stream`` (default ``sys.stdout``) is where it writes; ``tty`` overrides
    ``stream.isatty()``; ``clock`` (seconds) times the steps for the ETA. ``facts()`` returns what it
    saw for ``final_summary``: ``validation`` ({step: score}), ``tokens``, ``last_step``.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        initial_step: int = 0,
        stream: TextIO | None = None,
        tty: bool | None = None,
        rank: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total_steps = total_steps
        self.initial_step = initial_step
        self.rank = rank
        self._stream = stream
        self._clock = clock
        self._start = clock()  # the start of the first step of this run (reset after a validation before it)
        self.last_step = initial_step
        self.validation: dict[int, float] = {}
        self.tokens = 0
        self.bar = None
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        if tty:
            self._open_bar()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _open_bar(self) -> None:
        global _active_bar
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total_steps,
            initial=self.initial_step,
            file=self.stream,
            desc="dsrl",
            unit="step",
            dynamic_ncols=True,
            smoothing=0,  # rate and ETA from the mean step time
            mininterval=0,
            miniters=1,
        )
        _active_bar = self.bar

    def _write(self, text: str) -> None:
        _write_line(f"{line_prefix(self.rank)} {text}", self.stream)

    def log_params(self, params: dict[str, Any]) -> None:
        pass  # the resolved config is printed once at start-up by the CLI

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        keys = validation_keys(metrics)
        if keys:
            self.validation[step] = sum(metrics[k] for k in keys) / len(keys)
        if step > self.last_step:
            self._log_step(metrics, step)
        if keys:
            shown = [f"{k}={metrics[k]:.4g}" for k in keys] + _failures(metrics, prefix="val-aux/")
            self._write(f"validation at step {step}: " + " ".join(shown))
        if step <= self.initial_step and self.last_step == self.initial_step:  # before the first step
            self._start = self._clock()
            if self.bar is not None:
                self.bar.unpause()  # the validation's time is not a step's

    def _log_step(self, metrics: dict[str, float], step: int) -> None:
        self.tokens += int(metrics.get("perf/total_num_tokens", 0))
        self.last_step = step
        fields = _fields(metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(fields, refresh=False)
            if not self.bar.update(step - self.bar.n):
                self.bar.refresh()
            return
        mean = (self._clock() - self._start) / (step - self.initial_step)
        eta = f"eta {format_duration(mean * max(self.total_steps - step, 0))}"
        width = len(str(self.total_steps))
        self._write(" ".join(x for x in (f"step {step:>{width}}/{self.total_steps}", fields, eta) if x))

    def facts(self) -> dict[str, Any]:
        """``validation`` ({step: mean of the val-core mean@N values}), ``tokens`` (sum of
        perf/total_num_tokens over the steps shown), ``last_step``: keys of ``final_summary``."""
        return {"validation": dict(self.validation), "tokens": self.tokens, "last_step": self.last_step}

    def finish(self) -> None:
        global _active_bar
        if self.bar is not None:
            self.bar.close()
            if _active_bar is self.bar:
                _active_bar = None
            self.bar = None
        self.stream.flush()


# ---- summaries -----------------------------------------------------------------------------------


def format_count(n: float | None) -> str:
    """``494M``, ``7.6B``, ``1.2M``, ``35K``, ``812`` (one decimal below 10)."""
    if n is None:
        return "n/a"
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            value = n / size
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{n:.0f}"


def _block(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(key) for key, _ in rows) + 1
    return "\n".join([title, *(f"  {key + ':':<{width}} {value}" for key, value in rows)])


def _na(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _role(role: dict | None) -> str:
    if not role:
        return "none"
    if role.get("adapters_off"):
        return "the actor with its LoRA adapters off (no reference engine)"
    offload = [name for name in ("params", "optimizer") if role.get(f"offload_{name}")]
    parts = [
        f"ZeRO-{_na(role.get('zero_stage'))}",
        "offload " + "+".join(offload) if offload else "no offload",
        _na(role.get("dtype")),
        f"{format_count(role.get('params'))} params",
    ]
    if role.get("sequence_parallel"):
        parts.append(f"Ulysses sequence parallelism over {role['sequence_parallel']} ranks")
    if "gradient_checkpointing" in role:
        parts.append("gradient checkpointing" if role["gradient_checkpointing"] else "no gradient checkpointing")
    if role.get("lora"):
        lora = role["lora"]
        parts.append(f"LoRA rank {lora['rank']} alpha {lora['alpha']}, {format_count(lora['trainable'])} trainable")
    return ", ".join(parts)


def _micro_batches(role: dict) -> str:
    """A forward-only role's micro-batches: ``micro_batch_size`` rows, or ``max_token_len`` tokens when it is set."""
    if role.get("max_token_len"):
        return f"micro-batches of {role['max_token_len']} tokens per rank (dynamic batch size)"
    return f"micro-batches of {_na(role.get('micro_batch_size'))} rows per rank"


def _judges(facts: dict) -> list[tuple[str, str]]:
    """The rows of the reward model, the teacher and the distillation loss; none for those off."""
    rows = []
    rm, distill = facts.get("reward_model"), facts.get("distillation")
    if rm:
        rows.append(("reward model", f"{rm['path']}, {_role(rm)}, {_micro_batches(rm)}, "
                                     f"sequences up to {rm['max_length']} tokens"))  # fmt: skip
    if distill:
        teacher = distill["teacher"]
        rows.append(("teacher", f"{teacher['path']}, {_role(teacher)}, {_micro_batches(teacher)} (the reference's)"))
        how = (
            "a policy-gradient reward (minus the divergence is each token's advantage)"
            if distill["use_policy_gradient"]
            else "a supervised loss (the divergence backpropagated)"
        )
        beside = (
            f"added x {distill['coef']:g} to the task rewards' policy loss"
            if distill["use_task_rewards"]
            else "alone (use_task_rewards false)"
        )
        rows.append(("distillation", f"{distill['loss_mode']} as {how}, {beside}"))
    return rows


def _kl(facts: dict) -> str:
    loss, reward = facts.get("kl_loss"), facts.get("kl_in_reward")
    parts = [f"loss {loss['type']} coef {loss['coef']:g}" if loss else "loss off"]
    if reward:
        parts.append(f"in reward {reward['penalty']} coef {reward['coef']:g} ({reward.get('ctrl', 'fixed')})")
    else:
        parts.append("in reward off")
    return "; ".join(parts)


def _prompts(stats: dict | None) -> str:
    if not stats:
        return "none"
    return (
        f"{stats['kept']} of {stats['rows']} kept, {stats['filtered_overlong']} filtered (over-long), "
        f"{stats['truncated']} truncated"
    )


def _mlflow(info: dict | None) -> str:
    if not info:
        return "off"
    parts = [info["tracking_uri"]]
    if info.get("experiment_id") is not None:
        parts.append(f"experiment {info['experiment_id']}")
    parts.append(f"run {info['run_id']}" if info.get("run_id") else "no run (failed to start)")
    return ", ".join(parts)


def startup_summary(facts: dict[str, Any]) -> str:
    """The start-up block. ``facts`` (a missing value prints as ``n/a``):

    - ``world_size`` (int), ``device`` (str: ``"cpu"``, ``"cuda (NVIDIA H200)"``)
    - ``hosts`` (str or None): the ranks' nodes from the preflight (``dsrl.trainer.preflight.Cluster.describe``)
    - ``roles``: {``"actor"``, ``"reference"``, ``"critic"``: a dict or None (absent)}, each dict with
      ``zero_stage`` (int), ``offload_params``, ``offload_optimizer`` (bool), ``dtype`` (str),
      ``params`` (int), ``sequence_parallel`` (int; omit without), ``gradient_checkpointing`` (bool; omit for a
      role without backward), ``lora`` ({``rank``,
      ``alpha``, ``target_modules``, ``trainable``}; a LoRA actor only); or {``adapters_off``: True} for a LoRA
      run's reference
    - ``reward_model``: None (off) or a role's dict (above) with ``path`` (str), ``micro_batch_size`` (int, per rank),
      ``max_token_len`` (int or None: the token budget per rank with dynamic batch sizes), ``max_length`` (int: the
      longest sequence it reads)
    - ``distillation``: None (off) or {``teacher``: a role's dict with ``path``, ``micro_batch_size``,
      ``max_token_len``; ``loss_mode`` (str), ``use_policy_gradient``, ``use_task_rewards`` (bool), ``coef``}
    - ``rollout`` (str: the engine, e.g. ``"vllm (tp 2)"``)
    - ``estimator``, ``policy_loss``, ``loss_agg_mode`` (str)
    - ``kl_loss``: None or {``type``, ``coef``}; ``kl_in_reward``: None or {``penalty``, ``coef``, ``ctrl``}
    - ``prompts_per_step``, ``n`` (int): responses per step = their product
    - ``optimizer_steps``: {``"actor"``: int, ``"critic"``: int or None} per training step
    - ``micro_batch_size`` (int, per rank) or ``max_token_len`` (int, the token budget per rank
      with dynamic batch sizes; shown instead when set)
    - ``prompts``: {``"train"``: stats, ``"val"``: stats or None}, stats = ``load_prompts``'
      {``rows``, ``kept``, ``filtered_overlong``, ``truncated``}
    - ``total_steps``, ``start_step`` (int), ``resume_from`` (str or None)
    - ``checkpoint_dir`` (str), ``save_freq`` (int; <= 0: off)
    - ``mlflow``: None (off) or {``tracking_uri``, ``experiment_id``, ``run_id``}
    """
    roles = facts.get("roles") or {}
    steps = facts.get("optimizer_steps") or {}
    prompts, n = facts.get("prompts_per_step"), facts.get("n")
    responses = prompts * n if isinstance(prompts, int) and isinstance(n, int) else None
    if facts.get("max_token_len"):
        micro = f"token budget {facts['max_token_len']} per rank (dynamic batch size)"
    else:
        micro = f"{_na(facts.get('micro_batch_size'))} per rank"
    save_freq = facts.get("save_freq")
    start, resume = facts.get("start_step", 0), facts.get("resume_from")
    rows = [
        ("world", f"{facts.get('hosts') or _na(facts.get('world_size')) + ' rank(s)'}, {_na(facts.get('device'))}"),
        *((name, _role(roles.get(name))) for name in ("actor", "reference", "critic")),
        *_judges(facts),
        ("rollout", _na(facts.get("rollout"))),
        ("estimator", _na(facts.get("estimator"))),
        ("policy loss", f"{_na(facts.get('policy_loss'))}, loss_agg_mode {_na(facts.get('loss_agg_mode'))}"),
        ("kl", _kl(facts)),
        ("batch", f"{_na(prompts)} prompts x {_na(n)} = {_na(responses)} responses per step"),
        ("optimizer steps", f"actor {_na(steps.get('actor'))}, critic {steps.get('critic') or 'none'} per step"),
        ("micro-batches", micro),
        ("train prompts", _prompts((facts.get("prompts") or {}).get("train"))),
        ("val prompts", _prompts((facts.get("prompts") or {}).get("val"))),
        ("steps", f"{_na(facts.get('total_steps'))}" + (f", resuming at step {start} from {resume}" if resume else "")),
        (
            "checkpoints",
            f"{_na(facts.get('checkpoint_dir'))}, "
            + (f"every {save_freq} steps and at the end" if isinstance(save_freq, int) and save_freq > 0 else "off"),
        ),
        ("mlflow", _mlflow(facts.get("mlflow"))),
    ]
    return _block("start-up summary", rows)


def _local_store(uri: str, cwd: str) -> str:
    """A local MLflow store URI made absolute, so that it works from any directory."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.normpath(os.path.join(cwd, uri[len("sqlite:///") :]))
    if "://" not in uri and not uri.startswith("file:"):
        return os.path.normpath(os.path.join(cwd, uri))
    return uri


def mlflow_hint(info: dict | None, cwd: str | None = None) -> str | None:
    """How to open the run: ``mlflow ui --backend-store-uri <uri>`` for a local store (a relative
    sqlite or file path made absolute against ``cwd``), ``open <uri>/#/experiments/<id>/runs/<run>``
    for a tracking server; None when MLflow is off."""
    if not info:
        return None
    uri = info["tracking_uri"]
    exp, run = info.get("experiment_id"), info.get("run_id")
    page = f"#/experiments/{exp}/runs/{run}" if exp is not None and run else ""
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}/{page}"
    command = f"mlflow ui --backend-store-uri {shlex.quote(_local_store(uri, cwd or os.getcwd()))}"
    return command + (f"  (then open http://127.0.0.1:5000/{page})" if page else "")


def final_summary(facts: dict[str, Any]) -> str:
    """The final block. ``facts`` (``ProgressConsole.facts()`` gives the first three):

    - ``validation``: {step: score} (mean val-core mean@N) -> best and last score and their steps
    - ``tokens`` (int: prompt + response tokens processed), ``last_step`` (int)
    - ``total_steps``, ``initial_step`` (int: the step this run started at)
    - ``wall_time_s`` (float), ``status`` (str, default ``"finished"``, e.g. ``"stopped by SIGTERM"``)
    - ``model_dir`` (str or None: the exported model), ``adapter_dir`` (str or None: a LoRA actor's adapter,
      exported with the merged model), ``checkpoint_dir`` (str), ``last_checkpoint`` (str or None)
    - ``mlflow``: None (off) or {``tracking_uri``, ``experiment_id``, ``run_id``}
    - ``cwd`` (str, default the current directory: where a relative sqlite/file store lies)
    """
    validation = facts.get("validation") or {}
    if validation:
        best = max(validation, key=lambda s: (validation[s], -s))
        last = max(validation)
        val = f"best {validation[best]:.4g} (step {best}), last {validation[last]:.4g} (step {last})"
    else:
        val = "none"
    last_step, initial = facts.get("last_step"), facts.get("initial_step", 0)
    steps = f"{_na(last_step)}/{_na(facts.get('total_steps'))}"
    if isinstance(last_step, int) and initial:
        steps += f" ({last_step - initial} in this run, resumed at step {initial})"
    tokens = facts.get("tokens")
    wall = facts.get("wall_time_s")
    rows = [
        ("status", facts.get("status") or "finished"),
        ("steps", steps),
        ("validation score", val),
        ("wall time", format_duration(wall) if wall is not None else "n/a"),
        ("tokens", f"{tokens:,} ({format_count(tokens)})" if tokens is not None else "n/a"),
        ("model", facts.get("model_dir") or "not exported"),
        *([("LoRA adapter", facts["adapter_dir"])] if facts.get("adapter_dir") else []),
        ("checkpoints", f"{_na(facts.get('checkpoint_dir'))} (last: {facts.get('last_checkpoint') or 'none'})"),
        ("mlflow", _mlflow(facts.get("mlflow"))),
    ]
    hint = mlflow_hint(facts.get("mlflow"), facts.get("cwd"))
    if hint:
        rows.append(("open the run", hint))
    return _block("final summary", rows)
