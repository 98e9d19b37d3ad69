"""Write traces into a SQLite trace store forever, printing each acknowledged id.

Usage: ``python trace_writer.py DB_PATH PREFIX``. Prints ``ready`` once the store is
open, then ``ack <trace_id>`` (flushed) after each ``put`` returns. Tests SIGKILL it
mid-loop and check that every acknowledged trace survived in a valid database.
"""

from __future__ import annotations

import sys

from envport.trace import Message, ModelCall, SQLiteTraceStore, StepRecord, Trace, TraceStatus
from envport.trace.model import Choice


def make_trace(prefix: str, i: int) -> Trace:
    trace = Trace(
        trace_id=f"{prefix}-{i:06d}",
        run_id=f"run-{prefix}",
        task_id=f"task-{i % 7}",
        status=TraceStatus.COMPLETED if i % 3 else TraceStatus.FAILED,
        reward=(i % 10) / 10,
    )
    parent = None
    for turn in range(4):
        user = Message(role="user", content=f"turn {turn} of {i} " * 20, parent_id=parent)
        reply = Message(role="assistant", content="ok " * 50, parent_id=user.id)
        trace.messages += [user, reply]
        parent = reply.id
        trace.model_calls.append(
            ModelCall(
                model="m",
                prompt_token_ids=list(range(400)),
                choices=[
                    Choice(
                        message_id=reply.id,
                        finish_reason="stop",
                        completion_token_ids=list(range(200)),
                        completion_logprobs=[-0.5] * 200,
                    )
                ],
            )
        )
        trace.steps.append(StepRecord(index=turn, action={"turn": turn}, reward=0.1))
    return trace


def main() -> None:
    path, prefix = sys.argv[1], sys.argv[2]
    store = SQLiteTraceStore(path)
    print("ready", flush=True)
    i = 0
    while True:
        trace = make_trace(prefix, i)
        store.put(trace)
        print(f"ack {trace.trace_id}", flush=True)
        i += 1


if __name__ == "__main__":
    main()
