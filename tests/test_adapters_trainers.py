"""verl and SkyRL adapters against the real packages, in their own venv.

verl 0.9.1 and skyrl-train 0.3.1 cannot share .venv (they pin transformers < 5.11 and
ray 2.51.1; .venv has transformers 5.2x and ray 2.60), so ``make trainers-venv`` builds
``.venvs/trainers`` (CPU torch, verl, skyrl-train without its GPU-only deps). This file
is both the pytest module (run in .venv) and the contract check (``python
tests/test_adapters_trainers.py`` in that venv, printing one JSON report): pytest runs
the check once in a subprocess and asserts on the report.

The check drives real envport rollouts (guess-number-v1, in-process) through each
trainer's own code path, with a deterministic token engine standing in for the
inference server (a GPU-only vLLM/SGLang build does not run here):

* verl: ``EnvportAgentLoop`` is registered with verl's ``register``, instantiated by
  verl's ``AgentLoopWorker._run_agent_loop`` (hydra, from the registry), run inside the
  event loop, post-processed by verl (padding, masks, positions) and batched into a
  ``DataProto`` by ``AgentLoopWorker._postprocess``;
* SkyRL: ``EnvportGenerator`` is a real ``GeneratorInterface``; its ``GeneratorOutput``
  goes through skyrl-train's ``validate_generator_output`` and
  ``convert_prompts_responses_to_batch_tensors`` (what the trainer feeds the model).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAINERS_PYTHON = ROOT / ".venvs" / "trainers" / "bin" / "python"

# A Qwen 2.5-style ChatML template with Hermes tool calls: the layout verl's and SkyRL's
# own tool-calling recipes use.
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set sys = messages[0].content %}\
{% set rest = messages[1:] %}\
{%- else %}{% set sys = '' %}{% set rest = messages %}{% endif -%}
{%- if tools or sys -%}
<|im_start|>system
{{ sys }}{% if tools %}

# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>{% endif %}<|im_end|>
{% endif -%}
{%- for m in rest -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.content %}{{ m.content }}{% if m.tool_calls %}
{% endif %}{% endif -%}
{%- for tc in m.tool_calls or [] -%}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>{% if not loop.last %}
{% endif %}{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def _bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def byte_tokenizer(chat_template: str | None = None) -> Any:
    """A Hugging Face tokenizer with envport's ByteTokenizer ids (bytes, then specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    tk = Tokenizer(BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    for text in SPECIALS:
        tk.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


class GuessEngine:
    """A deterministic token engine for guess-number: binary search from the prompt.

    It reads the bounds and the last feedback from the tool responses in the prompt and
    answers with a Hermes tool call. ``compact=True`` writes the arguments without the
    space the template puts back (``{"number":5}``): the re-rendered history then differs
    from what was sampled, so the row must split (labelled), never merge.
    """

    #: Every call of every engine, in order (trainers may copy the engine they are given).
    calls: list[tuple[list[int], list[int], list[float]]] = []

    def __init__(self, tokenizer: Any, *, compact: bool = False) -> None:
        self.tokenizer = tokenizer
        self.compact = compact

    def next_guess(self, text: str) -> int:
        high = int(re.findall(r"integer from 1 to (\d+)", text)[0])
        low = 1
        for reply in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL):
            obs = json.loads(reply)
            if obs["feedback"] == "higher":
                low = obs["last_guess"] + 1
            elif obs["feedback"] == "lower":
                high = obs["last_guess"] - 1
        return (low + high) // 2

    def __call__(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        guess = self.next_guess(self.tokenizer.decode(prompt_ids))
        sep = ":" if self.compact else ": "
        body = f'{{"name"{sep}"guess", "arguments"{sep}{{"number"{sep}{guess}}}}}'
        text = f"<tool_call>\n{body}\n</tool_call><|im_end|>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        logprobs = [-0.01 * (1 + (i * 7 + guess) % 11) for i in range(len(ids))]
        GuessEngine.calls.append((list(prompt_ids), ids, logprobs))
        return ids, logprobs


def _tasks(n: int) -> list[Any]:
    from envport.tasks import load

    return list(load("builtin:guess-number").head(n))


# --- the contract check (runs inside .venvs/trainers) -------------------------------------


def _rollout_config() -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": 2048, "response_length": 1536},
                "model": {},
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


async def check_verl() -> dict[str, Any]:

    from verl.experimental.agent_loop import agent_loop as al
    from verl.workers.rollout.replica import TokenOutput

    from envport.train.adapters import verl as adapter

    cls = adapter.register_agent_loop()
    report: dict[str, Any] = {
        "registered": al._agent_loop_registry.get("envport"),
        "is_subclass": issubclass(cls, al.AgentLoopBase),
    }
    tokenizer = byte_tokenizer(CHAT_TEMPLATE)

    class ServerManager:
        """verl's LLMServerClient.generate contract: token ids in, TokenOutput out."""

        def __init__(self, engine: GuessEngine) -> None:
            self.engine = engine
            self.request_ids: list[str] = []

        async def generate(
            self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
        ) -> TokenOutput:
            self.request_ids.append(request_id)
            ids, lps = self.engine(prompt_ids)
            return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed")

    config = _rollout_config()
    worker = object.__new__(al.AgentLoopWorker)  # the worker without ray or inference servers
    worker.config = config
    worker.rollout_config = config.actor_rollout_ref.rollout
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.hf_model_type = None
    worker.dataset_cls = None
    worker.tools = []
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}

    rows = adapter.verl_dataset(_tasks(2))
    outputs: list[Any] = []
    cases = []
    for compact in (False, True):
        engine = GuessEngine(tokenizer, compact=compact)
        worker.llm_client = ServerManager(engine)
        for i, row in enumerate(rows):
            kwargs = {
                "raw_prompt": row["prompt"],
                "extra_info": row["extra_info"],
                "index": i,
                "uid": f"uid-{i}",
            }
            trajectory = {"step": 0, "sample_index": i, "rollout_n": 0, "validate": False}
            before = len(GuessEngine.calls)
            internal = await worker._run_agent_loop(
                {"temperature": 1.0, "logprobs": True}, trajectory, agent_name="envport", **kwargs
            )
            outputs.append(internal)
            calls = GuessEngine.calls[before:]
            prompt_len = int(internal.attention_mask[0, :2048].sum())
            resp_len = int(internal.attention_mask[0, 2048:].sum())
            prompt_ids = internal.prompt_ids[0, 2048 - prompt_len :].tolist()
            response_ids = internal.response_ids[0, :resp_len].tolist()
            mask = internal.response_mask[0, :resp_len].tolist()
            logprobs = internal.response_logprobs[0, :resp_len].tolist()
            sampled = [t for t, m in zip(response_ids, mask, strict=True) if m]
            sampled_lps = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
            engine_sampled = [t for _, ids, _ in calls for t in ids]
            engine_lps = [lp for _, _, lps in calls for lp in lps]
            extra = internal.extra_fields
            cases.append(
                {
                    "compact": compact,
                    "turns": len(calls),
                    "prompt_is_first_call": prompt_ids == calls[0][0],
                    "prompt_is_last_call": prompt_ids == calls[-1][0],
                    "sequence_is_last_call": prompt_ids + response_ids
                    == calls[-1][0] + calls[-1][1],
                    "sampled_is_all_calls": sampled == engine_sampled,
                    "sampled_is_last_call": sampled == calls[-1][1],
                    "logprobs_are_all_calls": _close(sampled_lps, engine_lps),
                    "logprobs_are_last_call": _close(sampled_lps, calls[-1][2]),
                    "mask_has_zero": 0 in mask,
                    "reward_score": internal.reward_score,
                    "num_turns": internal.num_turns,
                    "split_reason": extra.get("envport_split_reason"),
                    "num_fragments": extra.get("envport_num_fragments"),
                    "status": extra.get("envport_status"),
                    "raw_prompt_kept": extra.get("raw_prompt") == row["prompt"],
                    "position_ids_shape": list(internal.position_ids.shape),
                }
            )
    # A rollout whose engine fails, first in the batch: verl batches rollout_log_probs
    # from the first output's and concatenates everyone's, so its stand-in needs them too.
    failed = await _verl_failed_output(worker, ServerManager, tokenizer, rows[0])
    report["failed"] = {
        "status": failed.extra_fields.get("envport_status"),
        "reward_score": failed.reward_score,
        "mask_sum": int(failed.response_mask.sum()),
        "has_logprobs": failed.response_logprobs is not None,
    }
    batch = worker._postprocess([failed, *outputs])
    report["cases"] = cases
    report["batch_keys"] = sorted(batch.batch.keys())
    report["batch_size"] = len(batch)
    report["rm_scores_sum"] = float(batch.batch["rm_scores"].sum())
    report["num_turns"] = batch.non_tensor_batch["__num_turns__"].tolist()
    report["bad_row"] = await _verl_bad_row(worker, ServerManager, tokenizer)
    return report


async def _verl_failed_output(worker: Any, server_cls: Any, tokenizer: Any, row: Any) -> Any:
    """verl's post-processed output of a rollout whose every model call fails."""

    class Down(server_cls):  # type: ignore[misc,valid-type]
        async def generate(self, request_id: str, **_: Any) -> Any:
            raise RuntimeError("engine down")

    worker.llm_client = Down(GuessEngine(tokenizer))
    trajectory = {"step": 0, "sample_index": 9, "rollout_n": 0, "validate": False}
    kwargs = {"raw_prompt": row["prompt"], "extra_info": row["extra_info"], "index": 9}
    return await worker._run_agent_loop(
        {"temperature": 1.0, "logprobs": True}, trajectory, agent_name="envport", **kwargs
    )


async def _verl_bad_row(worker: Any, server_cls: Any, tokenizer: Any) -> dict[str, Any]:
    """A row without an envport task is refused with a message that says what to do."""
    worker.llm_client = server_cls(GuessEngine(tokenizer))
    trajectory = {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False}
    try:
        await worker._run_agent_loop(
            {},
            trajectory,
            agent_name="envport",
            raw_prompt=[{"role": "user", "content": "hi"}],
            extra_info={},
        )
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))


async def check_skyrl() -> dict[str, Any]:
    from skyrl_train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl_train.generators.base import GeneratorInterface, TrajectoryID
    from skyrl_train.inference_engines.base import InferenceEngineOutput
    from skyrl_train.utils.trainer_utils import validate_generator_output

    from envport.train.adapters import skyrl as adapter

    tokenizer = byte_tokenizer(CHAT_TEMPLATE)
    engine = GuessEngine(tokenizer)

    class EngineClient:
        """skyrl-train's InferenceEngineClient.generate contract."""

        def __init__(self) -> None:
            self.sessions: list[Any] = []

        async def generate(self, batch: dict[str, Any]) -> InferenceEngineOutput:
            assert batch["prompts"] is None
            self.sessions += batch["session_ids"]
            ids, lps = engine(batch["prompt_token_ids"][0])
            return InferenceEngineOutput(
                responses=[tokenizer.decode(ids, skip_special_tokens=True)],
                response_ids=[ids],
                stop_reasons=["stop"],
                response_logprobs=[lps],
            )

    client = EngineClient()
    gen = adapter.EnvportGenerator(client, tokenizer)
    rows = adapter.skyrl_dataset(_tasks(2))
    n = 2  # samples per prompt
    batch = {
        "prompts": [r["prompt"] for r in rows for _ in range(n)],
        "env_classes": [r["env_class"] for r in rows for _ in range(n)],
        "env_extras": [{"envport_task": r["envport_task"]} for r in rows for _ in range(n)],
        "sampling_params": {"temperature": 1.0, "max_tokens": 512},
        "trajectory_ids": [TrajectoryID(r["uid"], k) for r in rows for k in range(n)],
        "batch_metadata": None,
    }
    out = await gen.generate(batch)
    validate_generator_output(len(batch["prompts"]), out)
    tensors = convert_prompts_responses_to_batch_tensors(
        tokenizer,
        out["prompt_token_ids"],
        out["response_ids"],
        out["rewards"],
        out["loss_masks"],
        out["rollout_logprobs"],
    )
    sequences, attention, response_mask, rewards, loss_mask, logprobs = tensors
    rollouts = gen.last_rollouts
    exact = []
    for i, rollout in enumerate(rollouts):
        calls = rollout.trace.model_calls
        served = [t for c in calls for t in (c.choices[0].completion_token_ids or [])]
        sampled = [
            t for t, m in zip(out["response_ids"][i], out["loss_masks"][i], strict=True) if m
        ]
        exact.append(sampled == served and rollout.trace.reward == sum(out["rewards"][i]))
    return {
        "is_generator": isinstance(gen, GeneratorInterface),
        "keys": sorted(out),
        "n": len(out["response_ids"]),
        "exact": exact,
        "loss_mask_zeros": [m.count(0) for m in out["loss_masks"]],
        "rewards_last": [r[-1] for r in out["rewards"]],
        "stop_reasons": out["stop_reasons"],
        "trajectory_ids": [t.to_string() for t in out["trajectory_ids"]],
        "groups": sorted({r.trace.group_id for r in rollouts}),
        "sessions_per_rollout": len(set(client.sessions)),
        "tensor_shapes": [list(t.shape) for t in (sequences, attention, response_mask, loss_mask)],
        "loss_mask_sum": int(loss_mask.sum()),
        "sampled_total": sum(sum(m) for m in out["loss_masks"]),
        "reward_tensor_sum": float(rewards.sum()),
        "logprobs_shape": list(logprobs.shape),
        "metrics": out["rollout_metrics"],
    }


def main() -> None:
    import asyncio
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    report = {"verl": asyncio.run(check_verl()), "skyrl": asyncio.run(check_skyrl())}
    print("ENVPORT-REPORT " + json.dumps(report, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
else:
    import pytest

    @pytest.fixture(scope="module")
    def report() -> dict[str, Any]:
        if not TRAINERS_PYTHON.exists():
            pytest.skip("the trainers venv is missing: run `make trainers-venv`")
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        proc = subprocess.run(
            [str(TRAINERS_PYTHON), str(Path(__file__).resolve())],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=ROOT,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENVPORT-REPORT ")]
        assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
        assert lines, proc.stdout[-2000:]
        data: dict[str, Any] = json.loads(lines[-1].removeprefix("ENVPORT-REPORT "))
        return data

    @pytest.mark.timeout(300)
    def test_verl_agent_loop_is_registered_and_built_by_verls_worker(
        report: dict[str, Any],
    ) -> None:
        verl = report["verl"]
        assert verl["is_subclass"]
        assert verl["registered"] == {"_target_": "envport.train.adapters.verl.EnvportAgentLoop"}
        assert "verl_dataset(tasks)" in (verl["bad_row"]["error"] or "")

    @pytest.mark.timeout(300)
    def test_verl_outputs_are_token_exact_and_batch_into_a_dataproto(
        report: dict[str, Any],
    ) -> None:
        verl = report["verl"]
        merged = [c for c in verl["cases"] if not c["compact"]]
        assert merged
        for case in merged:
            assert case["turns"] > 1
            assert case["num_fragments"] == 1
            assert case["split_reason"] is None
            assert case["prompt_is_first_call"]
            assert case["sequence_is_last_call"]
            assert case["sampled_is_all_calls"]
            assert case["logprobs_are_all_calls"]
            assert case["mask_has_zero"]  # tool responses are not trained on
            assert case["reward_score"] == 1.0
            assert case["status"] == "completed"
            assert case["raw_prompt_kept"]
        assert verl["batch_size"] == len(verl["cases"]) + 1  # and the failed rollout
        for key in ("prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores"):
            assert key in verl["batch_keys"]
        assert verl["rm_scores_sum"] == sum(c["reward_score"] for c in verl["cases"])

    @pytest.mark.timeout(300)
    def test_verl_batches_a_failed_rollout_beside_scored_ones(report: dict[str, Any]) -> None:
        """A failed rollout first in the batch used to have no logprobs while the others
        had them: verl's _postprocess then failed to concatenate rollout_log_probs."""
        failed = report["verl"]["failed"]
        assert failed == {
            "status": "failed",
            "reward_score": 0.0,
            "mask_sum": 0,
            "has_logprobs": True,
        }
        assert "rollout_log_probs" in report["verl"]["batch_keys"]

    @pytest.mark.timeout(300)
    def test_verl_unmergeable_rollout_stays_split_with_its_label(report: dict[str, Any]) -> None:
        split = [c for c in report["verl"]["cases"] if c["compact"]]
        assert split
        for case in split:
            # The template re-renders {"number":5} as {"number": 5}: history rewritten.
            assert case["split_reason"] == "template_rewrote_history"
            assert case["num_fragments"] == case["turns"]
            # The fragment handed to verl is the last call alone: its own prompt, its own
            # sampled ids under mask 1, nothing glued on.
            assert case["prompt_is_last_call"]
            assert case["sampled_is_last_call"]
            assert case["sequence_is_last_call"]
            assert case["logprobs_are_last_call"]

    @pytest.mark.timeout(300)
    def test_skyrl_generator_output_passes_skyrls_own_checks(report: dict[str, Any]) -> None:
        sky = report["skyrl"]
        assert sky["is_generator"]
        assert sky["n"] == 4
        assert all(sky["exact"])
        assert all(z > 0 for z in sky["loss_mask_zeros"])
        assert sky["rewards_last"] == [1.0] * 4
        assert sky["stop_reasons"] == ["tool_calls"] * 4
        assert sky["trajectory_ids"] == [
            "guess-number-000_0",
            "guess-number-000_1",
            "guess-number-001_0",
            "guess-number-001_1",
        ]
        assert len(sky["groups"]) == 2  # one GRPO group per prompt
        assert sky["sessions_per_rollout"] == 4
        assert sky["loss_mask_sum"] == sky["sampled_total"]
        assert sky["reward_tensor_sum"] == 4.0
        assert sky["metrics"]["envport/no_row"] == 0
        for key in (
            "prompt_token_ids",
            "response_ids",
            "rewards",
            "loss_masks",
            "stop_reasons",
            "rollout_metrics",
            "rollout_logprobs",
            "trajectory_ids",
            "is_last_step",
        ):
            assert key in sky["keys"]
