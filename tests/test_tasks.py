"""Tasks, tasksets and their loaders (envport.tasks).

Every loader reads real files written into ``tmp_path``: JSONL, Parquet/Arrow written
with ``datasets``, Harbor task directories with the real layout, and a Python taskset
found through a real ``module:Class`` path and a real entry point (a ``.dist-info``
directory on ``sys.path``).
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envport.errors import EnvportError
from envport.tasks import (
    MissingDependencyError,
    RubricSpec,
    Task,
    TaskFileError,
    TaskNotFoundError,
    Taskset,
    UnknownTasksetError,
    builtin_names,
    load,
    load_harbor,
    load_hf,
    load_jsonl,
)


def _tasks(n: int, prefix: str = "t") -> list[Task]:
    return [
        Task(id=f"{prefix}{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(n)
    ]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- Task ---------------------------------------------------------------------------------


def test_hash_ignores_id_location_and_key_order() -> None:
    a = Task.model_validate(
        {"id": "a", "prompt": "p", "env_options": {"x": 1, "y": [1, 2]}, "metadata": {"k": "v"}}
    )
    b = Task.model_validate(
        {"metadata": {"k": "v"}, "env_options": {"y": [1, 2], "x": 1}, "prompt": "p", "id": "b"}
    )
    moved = b.model_copy(update={"source": "elsewhere.jsonl:9", "root": "/elsewhere"})
    assert a.content_hash == b.content_hash == moved.content_hash
    assert len(a.content_hash) == 64


def test_hash_changes_with_content_not_with_explicit_defaults() -> None:
    base = Task(prompt="p", answer="1")
    assert Task(prompt="p", answer="1", metadata={}, rubric=()).content_hash == base.content_hash
    assert Task(prompt="p", answer="2").content_hash != base.content_hash
    assert Task(prompt="p", answer="1", seed=3).content_hash != base.content_hash
    assert Task(prompt="p", answer="1", env_options={"k": 1}).content_hash != base.content_hash


def test_task_defaults_its_id_from_the_hash_and_is_frozen() -> None:
    task = Task(prompt="hello")
    assert task.id == "task-" + task.content_hash[:12]
    assert {task, Task(prompt="hello")} == {task}  # hashable, equal by value
    with pytest.raises(ValueError, match="frozen"):
        task.prompt = "other"  # type: ignore[misc]


def test_task_accepts_the_flat_forms_of_task_files() -> None:
    task = Task.model_validate(
        {
            "prompt": [{"role": "user", "content": "fix it"}],
            "system_prompt": "be brief",
            "files": {"src/a.py": "print(1)\n", "data.bin": {"source": "blobs/data.bin"}},
            "rubric": {"type": "test_command", "command": "pytest", "weight": 2},
            "resources": {"cpus": 2, "memory_mb": 1024, "timeouts": {"agent": 30}},
        }
    )
    assert task.rubric == (RubricSpec(type="test_command", weight=2, params={"command": "pytest"}),)
    assert task.files["src/a.py"].content == "print(1)\n"
    assert task.resources.timeouts.agent == 30
    assert task.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "fix it"},
    ]
    assert Task(prompt="x", rubric="exact_match").rubric[0].type == "exact_match"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stay in the workspace"):
        Task.model_validate({"prompt": "x", "files": {"../escape": "no"}})


# --- JSONL ----------------------------------------------------------------------------------


def test_jsonl_loads_tasks_with_provenance(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "tasks.jsonl",
        [t.model_dump(mode="json", exclude_defaults=True) for t in _tasks(3)] + [""],
    )
    taskset = load_jsonl(path)
    tasks = list(taskset)
    assert [t.id for t in tasks] == ["t0", "t1", "t2"]
    assert tasks[1].answer == "2"
    assert tasks[1].source == f"{path}:2"
    assert tasks[0].root == str(tmp_path.resolve())
    assert [t.id for t in taskset] == ["t0", "t1", "t2"]  # re-iterable: read again
    assert taskset.get("t2").prompt == "What is 2 + 2?"


def test_the_jsonl_example_in_the_docs_loads_as_it_says(tmp_path: Path) -> None:
    from envport.rubrics import from_specs

    doc = (Path(__file__).parent.parent / "docs" / "runs.md").read_text()
    block = doc.split("```jsonl\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "tasks.jsonl"
    path.write_text(block)
    exact, numeric, unscored = load_jsonl(path)
    assert exact.rubric == (RubricSpec(type="exact_match"),)
    assert numeric.rubric == (
        RubricSpec(type="numeric_match", params={"abs_tol": 0.5}),
        RubricSpec(type="regex", weight=0, params={"pattern": "\\d+"}),
    )
    assert (exact.answer, numeric.answer, unscored.rubric) == ("5", 42, ())
    for task in (exact, numeric):
        from_specs(task.rubric)  # types and parameters that exist
    # The other forms it names: a single string or object, parameters under "params".
    alone = Task.model_validate({"prompt": "p", "rubric": "exact_match"})
    assert alone.rubric == exact.rubric
    nested = {"type": "numeric_match", "params": {"abs_tol": 0.5}}
    assert Task.model_validate({"prompt": "p", "rubric": nested}).rubric == numeric.rubric[:1]


def test_jsonl_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "tasks.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": '])
    with pytest.raises(TaskFileError) as info:
        list(load_jsonl(path))
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 3, None)
    assert str(err).startswith(f"{path}:3: invalid JSON")
    assert isinstance(err, EnvportError)


def test_jsonl_reads_a_bom_and_fails_only_the_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"id": "a", "prompt": "caf\xc3\xa9"}\r\n'  # BOM, then UTF-8
        b'{"id": "b", "prompt": "caf\xe9"}\n'  # Latin-1
        b'{"id": "c", "prompt": "ok"}\n'
    )
    invalid: list[TaskFileError] = []
    tasks = list(load_jsonl(path, invalid=invalid))
    assert [(t.id, t.prompt) for t in tasks] == [("a", "caf\u00e9"), ("c", "ok")]
    assert [(e.path, e.line, e.field) for e in invalid] == [(str(path), 2, None)]
    assert str(invalid[0]) == (
        f"{path}:2: not UTF-8 text: byte 0xe9 at column 27 (task files are UTF-8; save it as UTF-8)"
    )
    with pytest.raises(TaskFileError, match="not UTF-8 text") as info:
        list(load_jsonl(path))
    assert info.value.line == 2


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({"id": "a"}, "prompt", "Field required"),
        ({"prompt": 42}, "prompt", "must be text or a list of chat messages"),
        ({"prompt": "p", "resources": {"cpus": "many"}}, "resources.cpus", "valid number"),
        ({"prompt": [{"content": "hi"}]}, "prompt[0].role", "Field required"),
        ({"prompt": "p", "promt": "typo"}, "promt", "Extra inputs are not permitted"),
        ({"prompt": "p", "seed": "abc"}, "seed", "valid integer"),
        ({"prompt": "p", "seed": True}, "seed", "must be an integer, not a boolean (true)"),
    ],
)
def test_jsonl_invalid_task_names_line_and_field(
    tmp_path: Path, row: dict[str, Any], field: str, message: str
) -> None:
    path = _write_jsonl(tmp_path / "tasks.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(TaskFileError) as info:
        list(load_jsonl(path))
    assert (info.value.line, info.value.field) == (2, field)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:2: {field}: ")


def test_jsonl_rejects_duplicate_ids_and_non_objects(tmp_path: Path) -> None:
    dup = _write_jsonl(
        tmp_path / "dup.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}]
    )
    with pytest.raises(TaskFileError, match="duplicate id 'x' \\(first on line 1\\)") as info:
        list(load_jsonl(dup))
    assert (info.value.line, info.value.field) == (2, "id")
    arr = _write_jsonl(tmp_path / "arr.jsonl", [[1, 2]])
    with pytest.raises(TaskFileError, match="expected a JSON object, got list"):
        list(load_jsonl(arr))
    with pytest.raises(TaskFileError, match="no such file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_jsonl_columns_and_defaults(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "solution": "4", "junk": 1}])
    taskset = load_jsonl(
        path,
        columns={"question": "prompt", "solution": "answer", "junk": None},
        defaults={"env_id": "arithmetic-v1"},
    )
    (task,) = list(taskset)
    assert (task.prompt, task.answer, task.env_id) == ("2+2?", "4", "arithmetic-v1")
    with pytest.raises(ValueError, match="unknown Task field"):
        load_jsonl(path, columns={"question": "promtp"})


def test_head_reads_no_further_than_it_needs(tmp_path: Path) -> None:
    rows: list[Any] = [{"prompt": f"p{i}"} for i in range(4)] + ["{broken"]
    path = _write_jsonl(tmp_path / "tasks.jsonl", rows)
    assert [t.prompt for t in load_jsonl(path).head(4)] == ["p0", "p1", "p2", "p3"]
    with pytest.raises(TaskFileError):
        list(load_jsonl(path).head(5))

    pulled = 0

    def source() -> Iterator[Task]:
        nonlocal pulled
        for task in _tasks(1000):
            pulled += 1
            yield task

    taskset = Taskset(source)
    first = taskset.filter(lambda t: t.id != "t1").head(3)
    assert pulled == 0  # building derived tasksets reads nothing
    assert [t.id for t in first] == ["t0", "t2", "t3"]
    assert pulled == 4


# --- Taskset --------------------------------------------------------------------------------


def test_shuffle_is_deterministic_and_ignores_source_order() -> None:
    tasks = _tasks(30)
    forward = [t.id for t in Taskset(tasks).shuffle(seed=7)]
    backward = [t.id for t in Taskset(list(reversed(tasks))).shuffle(seed=7)]
    assert forward == backward == [t.id for t in Taskset(tasks).shuffle(seed=7)]
    assert sorted(forward) == sorted(t.id for t in tasks)
    assert forward != [t.id for t in tasks]
    assert forward != [t.id for t in Taskset(tasks).shuffle(seed=8)]


def test_split_by_hash_is_stable_disjoint_and_survives_additions() -> None:
    tasks = _tasks(200)
    parts = Taskset(tasks).split({"train": 0.8, "test": 0.2}, seed=1)
    train = {t.id for t in parts["train"]}
    test = {t.id for t in parts["test"]}
    assert train.isdisjoint(test)
    assert train | test == {t.id for t in tasks}
    assert 120 <= len(train) <= 190  # about 80 %
    again = Taskset(list(reversed(tasks))).split({"train": 0.8, "test": 0.2}, seed=1)
    assert {t.id for t in again["test"]} == test
    grown = Taskset(tasks + _tasks(50, prefix="new")).split([0.8, 0.2], seed=1)
    assert test <= {t.id for t in grown[1]}  # no old task changed sides
    other_seed = Taskset(tasks).split([0.8, 0.2], seed=2)
    assert {t.id for t in other_seed[1]} != test


def test_split_exact_sizes_and_bad_fractions() -> None:
    a, b, c = Taskset(_tasks(20)).split([0.5, 0.3, 0.2], seed=0, exact=True)
    ids = [[t.id for t in part] for part in (a, b, c)]
    assert [len(i) for i in ids] == [10, 6, 4]
    assert len({x for part in ids for x in part}) == 20
    for bad in ([0.5, 0.4], [1.2, -0.2], []):
        with pytest.raises(ValueError, match="sum to 1"):
            Taskset(_tasks(3)).split(bad)


def test_length_get_and_source_rules() -> None:
    listed = Taskset(_tasks(5), name="five")
    assert len(listed) == 5
    assert len(listed.head(2)) == 2
    assert listed.length == 5
    lazy = Taskset(lambda: iter(_tasks(5)))
    assert lazy.length is None
    assert lazy.count() == 5
    assert bool(lazy)
    with pytest.raises(TypeError, match="use count"):
        len(lazy)
    assert list(lazy) == list(lazy)  # the factory is called per iteration
    with pytest.raises(TaskNotFoundError, match="Did you mean 't3'"):
        listed.get("t33")
    assert "t4" in listed
    assert "nope" not in listed
    with pytest.raises(TypeError, match="one-shot iterator"):
        Taskset(iter(_tasks(2)))
    assert next(t.answer for t in listed.map(lambda t: t.model_copy(update={"answer": "x"}))) == "x"


def test_builtin_tasksets_load_and_are_valid() -> None:
    assert {"arithmetic", "guess-number", "sql"} <= set(builtin_names())
    arithmetic = list(load("builtin:arithmetic"))
    assert len(arithmetic) == 48
    assert all(t.env_id == "arithmetic-v1" and t.answer is not None for t in arithmetic)
    assert len({t.content_hash for t in arithmetic}) == 48
    assert all(t.env_id == "sql-db-v1" for t in load("builtin:sql"))
    guess = list(load("builtin:guess-number"))
    assert guess
    assert all(t.env_id == "guess-number-v1" for t in guess)
    with pytest.raises(UnknownTasksetError, match="Did you mean 'arithmetic'"):
        load("builtin:arithmetik")


@pytest.mark.parametrize("name", ["arithmetic", "sql"])
async def test_builtin_answers_match_their_environments(name: str) -> None:
    """Each built-in task's prompt and answer are what its env produces for its seed."""
    import envport

    for task in load(f"builtin:{name}"):
        assert task.env_id is not None
        env = envport.make(task.env_id)
        first = await env.reset(seed=task.seed, **task.env_options)
        state = await env.state()
        await env.close()
        assert first.observation.model_dump()["question"] == task.prompt
        assert state.model_dump()["reference_answer"] == task.answer


# --- Hugging Face datasets --------------------------------------------------------------


@pytest.fixture
def hf() -> Any:
    return pytest.importorskip("datasets", reason="the 'datasets' extra is not installed")


ROWS = [
    {
        "question": "1+1?",
        "answer": "2",
        "env_id": "arithmetic-v1",
        "level": 1,
        "system_prompt": None,
    },
    {
        "question": "2+3?",
        "answer": "5",
        "env_id": "arithmetic-v1",
        "level": 2,
        "system_prompt": "Be exact.",
    },
    {
        "question": "7*6?",
        "answer": "42",
        "env_id": "arithmetic-v1",
        "level": 3,
        "system_prompt": None,
    },
]


def test_hf_parquet_maps_columns_and_keeps_unknown_ones_as_metadata(
    hf: Any, tmp_path: Path
) -> None:
    path = tmp_path / "train.parquet"
    hf.Dataset.from_list(ROWS).to_parquet(str(path))
    taskset = load_hf(path, columns={"question": "prompt"}, cache_dir=tmp_path / "cache")
    assert len(taskset) == 3
    tasks = list(taskset)
    assert [t.prompt for t in tasks] == ["1+1?", "2+3?", "7*6?"]
    assert tasks[2].answer == "42"
    assert tasks[2].metadata == {"level": 3}
    assert tasks[0].system_prompt is None
    assert tasks[1].system_prompt == "Be exact."
    via_spec = load(str(path), columns={"question": "prompt"}, cache_dir=tmp_path / "cache")
    assert [t.content_hash for t in via_spec] == [t.content_hash for t in tasks]


def test_hf_chat_prompts_and_row_errors(hf: Any, tmp_path: Path) -> None:
    path = tmp_path / "chat.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "resources": {"cpus": 1.0}},
        {"prompt": [{"role": "robot", "content": "hi"}], "resources": {"cpus": 2.0}},
    ]
    hf.Dataset.from_list(rows).to_parquet(str(path))
    taskset = load_hf(path, cache_dir=tmp_path / "cache")
    first = next(iter(taskset))
    assert first.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(TaskFileError, match="row 1: ") as info:
        list(taskset)
    assert info.value.field == "prompt[0].role"


def test_hf_splits_from_disk_and_from_a_data_dir(hf: Any, tmp_path: Path) -> None:
    dd = hf.DatasetDict(
        {"train": hf.Dataset.from_list(ROWS[:2]), "test": hf.Dataset.from_list(ROWS[2:])}
    )
    saved = tmp_path / "saved"
    dd.save_to_disk(str(saved))
    with pytest.raises(TaskFileError, match="several splits \\(train, test\\)") as info:
        load_hf(saved, columns={"question": "prompt"})
    assert info.value.field == "split"
    test = load(f"hf:{saved}#test", columns={"question": "prompt"})
    assert [t.answer for t in test] == ["42"]

    data_dir = tmp_path / "repo"
    (data_dir / "data").mkdir(parents=True)
    dd["train"].to_parquet(str(data_dir / "data" / "train-00000-of-00001.parquet"))
    dd["test"].to_parquet(str(data_dir / "data" / "test-00000-of-00001.parquet"))
    train = load_hf(data_dir, "train", columns={"question": "prompt"}, cache_dir=tmp_path / "c")
    assert [t.answer for t in train] == ["2", "5"]

    arrow = next((saved / "train").glob("*.arrow"))
    assert [t.answer for t in load_hf(arrow, columns={"question": "prompt"})] == ["2", "5"]
    streamed = load_hf(arrow, columns={"question": "prompt"}, streaming=True)
    assert streamed.length is None
    assert streamed.count() == 2


def test_hf_csv_cells_are_text_and_integer_ids_become_text(hf: Any, tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text(
        "id,prompt,answer,seed,level\n"
        "1,What is 2+2?,4,3,2\n"
        "2,Spell 'not available',NA,,\n"
        "3,What is 0.10 as text?,0.10,,\n"
    )
    tasks = list(load_hf(path, cache_dir=tmp_path / "cache"))
    # Without text columns pandas read answer as floats (4.0: the column has a blank)
    # and the ids as ints, which Task.id refused.
    assert [(t.id, t.answer, t.seed) for t in tasks] == [
        ("1", "4", 3),
        ("2", "NA", None),
        ("3", "0.10", None),
    ]
    assert tasks[0].metadata == {"level": "2"}
    assert tasks[1].metadata == {}  # an empty cell is absent

    bad_seed = tmp_path / "bad_seed.csv"
    bad_seed.write_text("prompt,seed\nfine,1\nodd,true\n")
    with pytest.raises(TaskFileError, match="row 1: Input should be a valid integer") as info:
        list(load_hf(bad_seed, cache_dir=tmp_path / "cache"))
    assert info.value.field == "seed"

    twice = tmp_path / "twice.csv"
    twice.write_text("id,prompt,prompt\n1,a,b\n")
    with pytest.raises(TaskFileError, match=r"twice\.csv:1: column name\(s\) \['prompt'\] appear"):
        load_hf(twice, cache_dir=tmp_path / "cache")


def test_hf_parquet_integer_ids_become_text(hf: Any, tmp_path: Path) -> None:
    ints = tmp_path / "ints.parquet"
    hf.Dataset.from_dict({"id": [10, 11], "question": ["a?", "b?"]}).to_parquet(str(ints))
    tasks = list(load_hf(ints, columns={"question": "prompt"}, cache_dir=tmp_path / "cache"))
    assert [t.id for t in tasks] == ["10", "11"]
    floats = tmp_path / "floats.parquet"
    hf.Dataset.from_dict({"id": [1.0, None], "prompt": ["a", "b"]}).to_parquet(str(floats))
    tasks = list(load_hf(floats, cache_dir=tmp_path / "cache"))
    assert tasks[0].id == "1"
    assert tasks[1].id.startswith("task-")  # null: the id is derived from the content
    for name, ids in (("frac", [1.0, 1.5]), ("bools", [True, False])):
        path = tmp_path / f"{name}.parquet"
        hf.Dataset.from_dict({"id": ids, "prompt": ["a", "b"]}).to_parquet(str(path))
        with pytest.raises(TaskFileError, match=r"row [01]: must be text or a whole number"):
            list(load_hf(path, cache_dir=tmp_path / "cache"))


def test_hf_rejects_duplicate_ids_naming_both_rows(hf: Any, tmp_path: Path) -> None:
    path = tmp_path / "dup.parquet"
    rows = {"id": ["a", "b", "a"], "prompt": ["first", "second", "third"]}
    hf.Dataset.from_dict(rows).to_parquet(str(path))
    taskset = load_hf(path, cache_dir=tmp_path / "cache")
    assert [t.id for t in taskset.head(2)] == ["a", "b"]
    with pytest.raises(TaskFileError) as info:
        list(taskset)
    assert (info.value.path, info.value.line, info.value.field) == (str(path), None, "id")
    assert str(info.value) == f"{path}: id: row 2: duplicate id 'a' (first in row 0)"
    csv_path = tmp_path / "dup.csv"
    csv_path.write_text("id,prompt\n7,a\n7,b\n")
    with pytest.raises(TaskFileError, match="row 1: duplicate id '7' \\(first in row 0\\)"):
        list(load_hf(csv_path, cache_dir=tmp_path / "cache"))


def test_hf_refuses_remote_names_and_explains_missing_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets", reason="the 'datasets' extra is not installed")
    with pytest.raises(TaskFileError, match="no hub access"):
        load_hf("openai/gsm8k")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'envport\[datasets\]'"):
        load_hf(tmp_path)


# --- Harbor -------------------------------------------------------------------------------

TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "Ada"
difficulty = "medium"
category = "data-processing"
tags = ["csv", "python"]
future_key = "ignored"

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 600.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory_mb = 2048
storage_mb = 10240
allow_internet = true
"""


def _harbor_task(root: Path, name: str, toml: str = TASK_TOML, solution: bool = True) -> Path:
    task = root / name
    (task / "environment" / "data").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text(f"# {name}\n\nSum the second column of data/in.csv.\n")
    (task / "task.toml").write_text(toml)
    (task / "environment" / "Dockerfile").write_text(
        "FROM python:3.13-slim\nWORKDIR /app\nCOPY data /app/data\n"
    )
    (task / "environment" / "data" / "in.csv").write_text("a,1\nb,2\n")
    (task / "tests" / "test.sh").write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            mkdir -p /logs/verifier
            if python3 /tests/test_outputs.py; then echo 1 > /logs/verifier/reward.txt
            else echo 0 > /logs/verifier/reward.txt; fi
            """
        )
    )
    (task / "tests" / "test_outputs.py").write_text("assert open('/app/out.txt').read() == '3'\n")
    if solution:
        (task / "solution").mkdir()
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho -n 3 > /app/out.txt\n")
    return task


def test_harbor_task_dir_maps_onto_a_task(tmp_path: Path) -> None:
    task_dir = _harbor_task(tmp_path, "sum-csv")
    (task,) = list(load(str(task_dir)))
    assert task.id == "sum-csv"
    assert "Sum the second column" in str(task.prompt)
    res = task.resources
    assert (res.cpus, res.memory_mb, res.storage_mb) == (1, 2048, 10240)
    assert (res.timeouts.env_start, res.timeouts.agent, res.timeouts.scoring) == (600, 600, 120)
    (rubric,) = task.rubric
    assert rubric.type == "test_command"
    assert rubric.params["command"] == "bash /tests/test.sh"
    assert rubric.params["reward_file"] == "/logs/verifier/reward.txt"
    assert "tests_dir" not in rubric.params  # shell-v1 mounts tests/ at /tests itself
    assert list(task.files) == ["data/in.csv"]  # the Dockerfile is not a workspace file
    assert task.resolve(task.files["data/in.csv"].source or "").read_text() == "a,1\nb,2\n"
    # It runs in shell-v1, in the Dockerfile's WORKDIR; the Docker facts are metadata.
    assert task.env_id == "shell-v1"
    assert task.env_options == {"task_dir": ".", "workdir": "/app"}
    assert task.resolve(task.env_options["task_dir"]) == task_dir.resolve()
    harbor = task.metadata["harbor"]
    assert (harbor["dockerfile"], harbor["workdir"]) == ("environment/Dockerfile", "/app")
    assert harbor["docker_image"] is None
    assert task.metadata["difficulty"] == "medium"
    assert task.metadata["tags"] == ["csv", "python"]
    assert harbor["solution"] == "solution/solve.sh"

    # Moved, the task keeps its hash; only its root differs.
    moved = tmp_path / "elsewhere" / "sum-csv"
    shutil.copytree(task_dir, moved)
    moved_task = load_harbor(moved).get("sum-csv")
    assert moved_task.resolve(moved_task.env_options["task_dir"]) == moved.resolve()
    assert moved_task.content_hash == task.content_hash


def test_harbor_task_may_name_another_environment(tmp_path: Path) -> None:
    toml = '[metadata]\nenvport_env = "my-sandbox-v1"\n[environment]\ndocker_image = "img:1"\n'
    task_dir = _harbor_task(tmp_path, "elsewhere", toml=toml)
    (task_dir / "environment" / "Dockerfile").write_text("FROM x\nWORKDIR /usr/src/app\n")
    (task,) = list(load_harbor(task_dir))
    assert task.env_id == "my-sandbox-v1"
    assert task.env_options == {}
    (rubric,) = task.rubric
    assert task.resolve(rubric.params["tests_dir"]) == task_dir.resolve() / "tests"
    assert rubric.params["tests_mount"] == "/tests"
    assert task.metadata["harbor"]["docker_image"] == "img:1"
    assert task.metadata["harbor"]["workdir"] == "/usr/src/app"

    # A WORKDIR the sandbox itself provides is not used as shell-v1's workdir.
    (task_dir / "task.toml").write_text('version = "1.0"\n')
    (task,) = list(load_harbor(task_dir))
    assert task.env_options == {"task_dir": "."}

    (task_dir / "task.toml").write_text("[metadata]\nenvport_env = 3\n")
    with pytest.raises(TaskFileError, match="registered environment id") as info:
        list(load_harbor(task_dir))
    assert (info.value.line, info.value.field) == (2, "metadata.envport_env")


def test_harbor_dir_of_tasks_is_lazy_and_sorted(tmp_path: Path) -> None:
    _harbor_task(tmp_path, "b-task", solution=False)
    _harbor_task(tmp_path, "a-task", toml='version = "1.0"\n[environment]\nmemory = "4G"\n')
    bad = _harbor_task(tmp_path, "c-task")
    (bad / "instruction.md").unlink()
    (tmp_path / "notes").mkdir()  # not a task: skipped
    taskset = load(str(tmp_path))
    assert len(taskset) == 3
    first, second = list(taskset.head(2))
    assert (first.id, second.id) == ("a-task", "b-task")
    assert first.resources.memory_mb == 4096
    assert first.resources.timeouts.agent is None
    assert second.metadata["harbor"]["solution"] is None
    with pytest.raises(TaskFileError, match=r"instruction\.md") as info:
        list(taskset)
    assert info.value.field == "prompt"


@pytest.mark.parametrize(
    ("toml", "line", "field", "message"),
    [
        (TASK_TOML.replace("cpus = 1", 'cpus = "lots"'), 18, "environment.cpus", "valid number"),
        (
            TASK_TOML.replace("timeout_sec = 120.0", "timeout_sec = -5"),
            11,
            "verifier.timeout_sec",
            "greater than 0",
        ),
        (TASK_TOML.replace("[agent]", "[agent"), 13, None, "invalid TOML"),
        ('[environment]\nmemory = "lots"\n', 2, "environment.memory", "not a size"),
        (
            '[environment]\nstorage = "2048"\n',
            2,
            "environment.storage",
            "storage: not a size like '2G' or '512M' (a number and a unit: K, M, G or T), "
            "got '2048'",
        ),
    ],
)
def test_harbor_bad_task_toml_names_line_and_field(
    tmp_path: Path, toml: str, line: int, field: str | None, message: str
) -> None:
    task_dir = _harbor_task(tmp_path, "broken", toml=toml)
    with pytest.raises(TaskFileError) as info:
        list(load_harbor(task_dir))
    err = info.value
    assert (err.path, err.line, err.field) == (str(task_dir / "task.toml"), line, field)
    assert message in str(err)


def test_harbor_reads_a_bom_and_names_the_file_that_is_not_utf8(tmp_path: Path) -> None:
    task_dir = _harbor_task(tmp_path, "bom")
    (task_dir / "instruction.md").write_bytes(b"\xef\xbb\xbfDo it.\r\n")
    (task_dir / "task.toml").write_bytes(b"\xef\xbb\xbf" + TASK_TOML.encode())
    task = next(iter(load_harbor(task_dir)))
    assert task.prompt == "Do it.\n"
    assert task.resources.memory_mb == 2048

    (task_dir / "task.toml").write_bytes(b'version = "1.0"\n# caf\xe9\n')
    with pytest.raises(TaskFileError) as info:
        list(load_harbor(task_dir))
    assert (info.value.path, info.value.line) == (str(task_dir / "task.toml"), 2)
    assert "not UTF-8 text: byte 0xe9 at column 6" in str(info.value)

    (task_dir / "task.toml").write_text(TASK_TOML)
    (task_dir / "instruction.md").write_bytes(b"# Task\n\nCaf\xe9\n")
    with pytest.raises(TaskFileError) as info:
        list(load_harbor(task_dir))
    err = info.value
    assert (err.path, err.line, err.field) == (str(task_dir / "instruction.md"), 3, "prompt")
    assert "not UTF-8 text: byte 0xe9 at column 4" in str(err)


def test_harbor_sizes_read_as_harbor_reads_them() -> None:
    from envport.tasks.harbor import size_mb

    # Harbor's own forms give Harbor's numbers (fractions truncated, as it does) ...
    assert [size_mb(t) for t in ("2G", "2g", "512M", "1.5G", "1.0001G", "1024K")] == [
        2048, 2048, 512, 1536, 1024, 1,
    ]  # fmt: skip
    assert size_mb("2GiB") == size_mb("2GB") == 2048  # envport's tolerance
    # ... and a bare number, which Harbor rejects, is an error rather than bytes.
    for text in ("2048", "2048.0", "", "G"):
        with pytest.raises(ValueError, match="not a size like '2G'"):
            size_mb(text)


def test_harbor_requires_the_verifier(tmp_path: Path) -> None:
    task_dir = _harbor_task(tmp_path, "no-tests")
    (task_dir / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFileError, match=r"tests/test\.sh") as info:
        list(load_harbor(task_dir))
    assert info.value.field == "rubric"
    with pytest.raises(TaskFileError, match=r"no task\.toml"):
        load_harbor(tmp_path / "no-tests" / "tests")


# --- Python tasksets ----------------------------------------------------------------------

PLUGIN = '''
from envport.tasks import Task, Taskset


class CountingTasks(Taskset):
    """A Python taskset: tasks made in code."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(name="counting", length=n)
        self.n = n

    def tasks(self):
        for i in range(self.n):
            yield Task(id=f"count-{i}", prompt=f"Count to {i}.", answer=str(i))


def not_a_taskset():
    return 42
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on sys.path, and a distribution that registers it as an entry point."""
    module = f"envport_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    dist = tmp_path / "envport_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: envport-test-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[envport.tasksets]\ncounting = {module}:CountingTasks\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop(module, None)


def test_python_taskset_by_module_path_and_entry_point(plugin: str) -> None:
    by_path = load(f"{plugin}:CountingTasks", n=4)
    assert [t.id for t in by_path] == ["count-0", "count-1", "count-2", "count-3"]
    assert len(by_path) == 4
    assert by_path.name == "counting"
    by_entry_point = load("entrypoint:counting")
    assert sorted(t.answer for t in by_entry_point.shuffle(seed=0)) == ["0", "1", "2"]
    assert len(by_entry_point) == 3
    with pytest.raises(UnknownTasksetError, match="Did you mean 'counting'"):
        load("entrypoint:countin")
    with pytest.raises(UnknownTasksetError, match="returned int, not a Taskset"):
        load(f"{plugin}:not_a_taskset")
    with pytest.raises(UnknownTasksetError, match="has no attribute"):
        load(f"{plugin}:Missing")


def test_unknown_spec_lists_what_exists(tmp_path: Path) -> None:
    with pytest.raises(UnknownTasksetError, match="builtin:arithmetic") as info:
        load("no/such/thing")
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownTasksetError, match="unknown file type"):
        load(str(_write_jsonl(tmp_path / "tasks.txt", [])))
