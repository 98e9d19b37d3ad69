"""The tiny PyTorch policy: sampler logprobs, hot-swapped weights, and its server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import openai
import pytest
import torch

from envport.policy import ByteTokenizer, SamplingParams
from envport.policy.base import Policy
from envport.policy.torch_policy import (
    TinyConfig,
    TinyTransformer,
    TorchPolicy,
    create_torch_policy_app,
    dump_state_dict,
)
from envport.serving import serve_in_thread
from envport.train.grpo import token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOK = ByteTokenizer()
ASK = [{"role": "user", "content": "What is 3 + 4? Answer with a single number."}]
SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, max_len=96, seed=1)


def policy(seed: int = 1, **kwargs: Any) -> TorchPolicy:
    return TorchPolicy(TinyTransformer(SMALL.model_copy(update={"seed": seed})), **kwargs)


def recomputed(module: TinyTransformer, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = token_logprobs(module, ids)[0]
    return logp[len(prompt) - 1 :].tolist()


def prompt_ids() -> list[int]:
    return TOK.encode(TOK.apply_chat_template(ASK))


# --- sampling --------------------------------------------------------------------------------


async def test_is_a_policy_and_logprobs_are_the_models_at_temperature_one() -> None:
    p = policy()
    assert isinstance(p, Policy)
    gen = await p.generate(ASK, None, SamplingParams(max_tokens=8, seed=3))
    assert list(gen.prompt_token_ids) == prompt_ids()
    assert 1 <= len(gen.token_ids) <= 8
    expected = recomputed(p.module_copy().eval(), prompt_ids(), list(gen.token_ids))
    assert gen.logprobs == pytest.approx(expected, abs=1e-5)
    assert gen.metadata["policy_version"] == 0


async def test_logprobs_at_other_temperatures_are_the_samplers() -> None:
    p = policy()
    gen = await p.generate(ASK, None, SamplingParams(temperature=0.5, max_tokens=4, seed=1))
    module = p.module_copy().eval()
    ids = torch.tensor([prompt_ids() + list(gen.token_ids)])
    with torch.no_grad():
        logits = module(ids)[0, len(prompt_ids()) - 1 : -1]
    scaled = torch.log_softmax(logits / 0.5, dim=-1)
    expected = scaled.gather(1, torch.tensor(gen.token_ids).unsqueeze(1)).squeeze(1).tolist()
    assert gen.logprobs == pytest.approx(expected, abs=1e-5)


async def test_seeded_and_greedy_sampling_repeat() -> None:
    p = policy()
    a = await p.generate(ASK, None, SamplingParams(max_tokens=6, seed=7))
    b = await p.generate(ASK, None, SamplingParams(max_tokens=6, seed=7))
    assert a.token_ids == b.token_ids
    g1 = await p.generate(ASK, None, SamplingParams(temperature=0, max_tokens=6))
    g2 = await p.generate(ASK, None, SamplingParams(temperature=0, max_tokens=6))
    assert g1.token_ids == g2.token_ids
    assert g1.finish_reason == "length"  # a random model rarely stops within 6 tokens
    top = await p.generate(ASK, None, SamplingParams(max_tokens=3, seed=1, top_logprobs=3))
    assert len(top.top_logprobs) == 3
    assert all(len(alts) == 3 for alts in top.top_logprobs)


async def test_max_tokens_and_context_length_are_respected() -> None:
    p = policy()
    gen = await p.complete(prompt_ids(), SamplingParams(max_tokens=2, seed=0))
    assert len(gen.token_ids) == 2
    assert gen.finish_reason == "length"
    long_prompt = [65] * (SMALL.max_len - 1)
    gen = await p.complete(long_prompt, SamplingParams(max_tokens=50, seed=0))
    assert len(gen.token_ids) == 1  # only one position left in the context
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await p.complete([9999], SamplingParams(max_tokens=1))


async def test_every_sample_is_recorded() -> None:
    p = policy()
    gens = [await p.generate(ASK, None, SamplingParams(max_tokens=4, seed=i)) for i in range(3)]
    records = p.records()
    assert [r.token_ids for r in records] == [g.token_ids for g in gens]
    assert [r.logprobs for r in records] == [g.logprobs for g in gens]
    assert {r.policy_version for r in records} == {0}
    p.clear_records()
    assert p.records() == []


# --- hot swap --------------------------------------------------------------------------------


async def test_hot_swap_changes_version_and_outputs() -> None:
    p = policy(seed=1)
    before = await p.generate(ASK, None, SamplingParams(temperature=0, max_tokens=4))
    other = TinyTransformer(SMALL.model_copy(update={"seed": 2})).state_dict()
    p.load_state_dict(other, version=1)
    assert p.version == 1
    after = await p.generate(ASK, None, SamplingParams(temperature=0, max_tokens=4))
    assert after.metadata["policy_version"] == 1
    assert after.logprobs != before.logprobs
    fresh = TinyTransformer(SMALL.model_copy(update={"seed": 2})).eval()
    assert after.logprobs == pytest.approx(
        recomputed(fresh, prompt_ids(), list(after.token_ids)), abs=1e-5
    )


class _Gated(TinyTransformer):
    """Blocks its first forward until released (class-level state survives deepcopy)."""

    entered: ClassVar[threading.Event] = threading.Event()
    release: ClassVar[threading.Event] = threading.Event()
    armed: ClassVar[bool] = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _Gated.armed:
            _Gated.armed = False
            _Gated.entered.set()
            assert _Gated.release.wait(10)
        return super().forward(ids)


def test_a_generation_in_flight_finishes_on_the_weights_it_started_with() -> None:
    old = _Gated(SMALL)
    old_copy = TinyTransformer(SMALL)
    old_copy.load_state_dict(old.state_dict())
    p = TorchPolicy(old)
    out: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: out.setdefault(
            "gen", p.sample(prompt_ids(), SamplingParams(max_tokens=4, seed=5), True)
        )
    )
    worker.start()
    try:
        assert _Gated.entered.wait(10)
        new = TinyTransformer(SMALL.model_copy(update={"seed": 9})).state_dict()
        p.load_state_dict(new, version=1)  # does not wait for the generation in flight
        assert p.version == 1
    finally:
        _Gated.release.set()
        worker.join(10)
    gen = out["gen"]
    assert gen.metadata["policy_version"] == 0
    assert gen.logprobs == pytest.approx(
        recomputed(old_copy.eval(), prompt_ids(), list(gen.token_ids)), abs=1e-5
    )
    assert [r.policy_version for r in p.records()] == [0]
    nxt = p.sample(prompt_ids(), SamplingParams(max_tokens=2, seed=5), True)
    assert nxt.metadata["policy_version"] == 1


def test_bad_weights_are_refused_and_the_old_ones_kept() -> None:
    p = policy()
    before = p.state_dict()
    wrong = TinyTransformer(SMALL.model_copy(update={"d_model": 16})).state_dict()
    with pytest.raises(ValueError, match="do not fit"):
        p.load_state_dict(wrong, version=1)
    assert p.version == 0
    assert all(torch.equal(before[k], v) for k, v in p.state_dict().items())
    p.load_state_dict(before, version=2)
    with pytest.raises(ValueError, match="older than the served version 2"):
        p.load_state_dict(before, version=1)
    with pytest.raises(ValueError, match="must be an int"):
        p.load_state_dict(before, version="3")  # type: ignore[arg-type]
    assert p.version == 2


def test_model_config_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TinyTransformer(TinyConfig(d_model=30, n_heads=4))
    with pytest.raises(ValueError, match="exceeds max_len"):
        TinyTransformer(SMALL)(torch.zeros((1, SMALL.max_len + 1), dtype=torch.long))


# --- served ----------------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[str, TorchPolicy]]:
    p = policy(max_new_tokens=6)
    with serve_in_thread(create_torch_policy_app(p)) as url:
        yield url, p


def test_served_through_the_openai_sdk_with_vllm_fields(served: tuple[str, TorchPolicy]) -> None:
    url, p = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        resp = client.chat.completions.create(
            model="anything", messages=ASK, logprobs=True, max_tokens=5, seed=4, n=2
        )
    assert resp.model == "envport-tiny"
    extra = resp.model_extra or {}
    assert extra["prompt_token_ids"] == prompt_ids()
    records = p.records()
    assert len(records) == 2
    for choice, record in zip(resp.choices, records, strict=True):
        assert (choice.model_extra or {})["token_ids"] == list(record.token_ids)
        assert choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert [t.logprob for t in choice.logprobs.content] == list(record.logprobs)
        assert record.prompt_ids == tuple(prompt_ids())


def test_weights_route_swaps_and_refuses_bad_bodies(served: tuple[str, TorchPolicy]) -> None:
    url, p = served
    with httpx.Client(base_url=url) as http:
        assert http.get("/policy/version").json() == {"model": "envport-tiny", "policy_version": 0}
        new = TinyTransformer(SMALL.model_copy(update={"seed": 5})).state_dict()
        r = http.post("/policy/weights?version=3", content=dump_state_dict(new))
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 3
        assert p.version == 3
        assert all(torch.equal(new[k], v) for k, v in p.state_dict().items())
        r = http.post("/policy/weights", content=dump_state_dict(new))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "missing_version"
        r = http.post("/policy/weights?version=4", content=b"not a state dict")
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_weights"
        r = http.post("/policy/weights?version=2", content=dump_state_dict(new))
        assert r.status_code == 400
        assert "older" in r.json()["error"]["message"]
        assert http.get("/policy/version").json()["policy_version"] == 3
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 1})
        samples = http.get("/policy/samples").json()["samples"]
        assert [s["policy_version"] for s in samples] == [3]
        assert http.get("/policy/samples?since=x").status_code == 400


def test_a_prompt_longer_than_the_context_is_a_clear_error(
    served: tuple[str, TorchPolicy],
) -> None:
    url, _ = served
    long = [{"role": "user", "content": "x" * (SMALL.max_len + 10)}]
    with httpx.Client(base_url=url) as http:
        r = http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_out_of_vocabulary_token_ids_are_a_client_error(
    served: tuple[str, TorchPolicy],
) -> None:
    url, p = served
    with httpx.Client(base_url=url) as http:
        for prompt in ([1, 2, SMALL.vocab_size], [-1]):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["param"] == "prompt"
    assert p.records() == []  # refused before sampling


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(
    served: tuple[str, TorchPolicy],
) -> None:
    url, p = served
    room = SMALL.max_len - len(TOK.encode("hello"))
    with httpx.Client(base_url=url) as http:
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": room + 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "max_tokens"
        assert "is too large" in r.json()["error"]["message"]
        assert p.records() == []  # refused before sampling
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_echo_reports_the_models_prompt_logprobs(served: tuple[str, TorchPolicy]) -> None:
    url, p = served
    ids = TOK.encode("hello there")
    with httpx.Client(base_url=url) as http:
        body = {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "seed": 2}
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("hello there")
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + len(choice["token_ids"])
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    module = p.module_copy().eval()
    with torch.no_grad():
        want = token_logprobs(module, torch.tensor([ids]))[0].tolist()
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-5)
    (record,) = p.records()
    assert lp["token_logprobs"][len(ids) :] == list(record.logprobs)
