"""Rendering runs and traces for people: summary tables and readable transcripts."""

from __future__ import annotations

import json
import statistics
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from envport.evaluate import EvalSummary
from envport.trace import ModelCall, Trace, TraceStatus


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


class EvalProgress:
    """The live line of ``envport eval``: the rollouts finished so far, counted by the
    summary's rules (:func:`envport.evaluate.summarise`). The mean reward is over the
    completed rollouts that were scored, and reads ``—`` while none is (tasks without a
    rubric), as the summary's does."""

    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.rewards: list[float] = []

    def add(self, trace: Trace) -> None:
        if trace.status is TraceStatus.COMPLETED:
            self.completed += 1
            if trace.reward is not None:  # unscored: in no mean
                self.rewards.append(trace.reward)
        else:
            self.failed += 1

    @property
    def mean_reward(self) -> float | None:
        return statistics.fmean(self.rewards) if self.rewards else None

    def markup(self) -> str:
        return (
            f"[green]{self.completed} ok[/] [red]{self.failed} failed[/] "
            f"mean reward {_fmt(self.mean_reward)}"
        )


def summary_table(summary: EvalSummary) -> Table:
    table = Table(title=f"run {summary.run_id}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tasks", str(summary.tasks))
    done = f"{summary.rollouts} ({summary.completed} completed, {summary.failed} failed"
    done += f", {summary.skipped} resumed)" if summary.skipped else ")"
    table.add_row("rollouts", done)
    table.add_row("mean reward", _fmt(summary.mean_reward))
    for k, value in summary.pass_at_k.items():
        table.add_row(f"pass@{k}", _fmt(value))
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(summary.errors_by_kind.items()))
    table.add_row("errors by kind", errors or "none")
    for name, pcts in (
        ("rollout latency", summary.rollout_latency_s),
        ("model call latency", summary.model_latency_s),
    ):
        if pcts:
            cells = "  ".join(f"{q} {v * 1000:.1f} ms" for q, v in pcts.items())
            table.add_row(name, cells)
    table.add_row("wall time", f"{summary.wall_s:.2f} s")
    return table


def traces_table(traces: list[Trace]) -> Table:
    table = Table(title=f"{len(traces)} traces", title_justify="left")
    for col in ("trace", "run", "task", "attempt", "status", "reward", "stop", "calls", "error"):
        table.add_column(col, overflow="fold")
    for t in traces:
        error = f"{t.errors[0].kind.value}: {t.errors[0].message[:60]}" if t.errors else ""
        table.add_row(
            t.trace_id,
            t.run_id or "",
            t.task_id or "",
            str(t.attempt),
            t.status.value,
            _fmt(t.reward),
            t.stop_reason or "",
            str(len(t.model_calls)),
            error,
        )
    return table


def _all_tokens(call: ModelCall) -> Text:
    """Every token id (prompt, then each choice's completion) and logprob of a call."""
    lines = [f"prompt ids {call.prompt_token_ids}"]
    for choice in call.choices:
        lines.append(f"choice {choice.index} completion ids {choice.completion_token_ids}")
        lines.append(f"choice {choice.index} logprobs {choice.completion_logprobs}")
    return Text("\n".join(lines), style="dim")


def _tokens_line(call: ModelCall) -> Text:
    choice = call.choices[0] if call.choices else None
    ids = choice.completion_token_ids if choice else None
    logprobs = choice.completion_logprobs if choice else None
    prompt = call.prompt_token_ids
    parts = [
        f"model {call.response_model or call.model}",
        f"finish {choice.finish_reason if choice else '—'}",
        f"latency {call.latency_s * 1000:.1f} ms" if call.latency_s is not None else "",
        f"prompt tokens {len(prompt)}" if prompt is not None else "prompt ids: missing",
    ]
    if ids is not None:
        shown = ", ".join(str(i) for i in ids[:12]) + (" …" if len(ids) > 12 else "")
        parts.append(f"completion ids [{shown}] ({len(ids)})")
    else:
        parts.append("completion ids: missing")
    if logprobs:
        shown = ", ".join(f"{lp:.2f}" for lp in logprobs[:6]) + (" …" if len(logprobs) > 6 else "")
        parts.append(f"logprobs [{shown}]")
    return Text(" · ".join(p for p in parts if p), style="dim")


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def transcript(trace: Trace, *, all_tokens: bool = False) -> RenderableType:
    """The whole run: header, each message (with its model call's tokens), steps, scores;
    failed model calls; with ``all_tokens`` every token id and logprob of every call."""
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    for label, value in (
        ("trace", trace.trace_id),
        ("run / task", f"{trace.run_id} / {trace.task_id} (attempt {trace.attempt})"),
        ("env", trace.env_id or "—"),
        ("status", f"{trace.status.value} · stop: {trace.stop_reason or '—'}"),
        ("reward", _fmt(trace.reward)),
        ("timings", ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in trace.timings.items())),
    ):
        header.add_row(label, value)
    parts: list[RenderableType] = [header]
    calls = {c.id: c for c in trace.model_calls}
    steps_by_call = {s.tool_call_id: s for s in trace.steps if s.tool_call_id}
    colours = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}
    for message in trace.messages:
        body: list[RenderableType] = [Text(_content(message.content))]
        for tc in message.tool_calls:
            step = steps_by_call.get(tc.id)
            reward = f" → reward {step.reward}" if step and step.reward is not None else ""
            body.append(Text(f"⚙ {tc.name}({json.dumps(tc.arguments)}){reward}", style="bold"))
        call = calls.get(message.model_call_id or "")
        if call is not None:
            body.append(_tokens_line(call))
            if all_tokens:
                body.append(_all_tokens(call))
        parts.append(
            Panel(
                Group(*body),
                title=message.role,
                title_align="left",
                border_style=colours.get(message.role, "white"),
            )
        )
    text_steps = [s for s in trace.steps if not s.tool_call_id]
    for step in text_steps:
        parts.append(
            Text(
                f"step {step.index}: action {json.dumps(step.action, default=str)} → "
                f"reward {step.reward} terminated={step.terminated} truncated={step.truncated}"
            )
        )
    if trace.rewards:
        scores = Table("reward", "value", "weight", "reason", title="rubric", title_justify="left")
        for r in trace.rewards:
            scores.add_row(r.name, _fmt(r.value), f"{r.weight:g}", r.reason or "")
        parts.append(scores)
    for call in trace.model_calls:
        if call.error is not None:  # a call that failed: no message came of it
            took = f" after {call.latency_s * 1000:.1f} ms" if call.latency_s is not None else ""
            parts.append(Text(f"✗ model call failed{took}: {call.error.message}", style="red"))
    for error in trace.errors:
        parts.append(Text(f"✗ {error.kind.value} at {error.where}: {error.message}", style="red"))
    return Group(*parts)
