"""Tasks and tasksets: what to run, and collections of it.

``Task`` is frozen data (``task.py``); ``Taskset`` a lazy collection with ``head``,
``shuffle``, ``filter``, ``split`` and ``get`` (``taskset.py``); loaders read JSONL,
local Hugging Face datasets, Harbor task directories and Python tasksets
(``loaders.py``, ``harbor.py``)::

    from envport.tasks import load

    train, test = load("builtin:arithmetic").split([0.8, 0.2], seed=0)
    for task in train.shuffle(seed=1).head(4):
        print(task.id, task.prompt, task.answer)
"""

from envport.tasks.errors import (
    MissingDependencyError,
    TaskFileError,
    TaskNotFoundError,
    TasksetError,
    UnknownTasksetError,
)
from envport.tasks.harbor import read_harbor_task
from envport.tasks.loaders import (
    ENTRY_POINT_GROUP,
    builtin_names,
    load,
    load_builtin,
    load_entry_point,
    load_harbor,
    load_hf,
    load_jsonl,
    load_object,
    taskset_entry_points,
)
from envport.tasks.task import ChatMessage, Resources, RubricSpec, Task, TaskFile, Timeouts
from envport.tasks.taskset import Taskset

__all__ = [
    "ENTRY_POINT_GROUP",
    "ChatMessage",
    "MissingDependencyError",
    "Resources",
    "RubricSpec",
    "Task",
    "TaskFile",
    "TaskFileError",
    "TaskNotFoundError",
    "Taskset",
    "TasksetError",
    "Timeouts",
    "UnknownTasksetError",
    "builtin_names",
    "load",
    "load_builtin",
    "load_entry_point",
    "load_harbor",
    "load_hf",
    "load_jsonl",
    "load_object",
    "read_harbor_task",
    "taskset_entry_points",
]
