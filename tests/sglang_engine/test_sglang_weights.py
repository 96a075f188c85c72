"""Weight updates into real SGLang servers by every `--update-weight-transport`: the engines then serve exactly
the sent weights (their log-probs match transformers' on the same weights) under the new reported version;
a refused update stops with SGLang's message."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.sglang

PROMPT = [5, 12, 7, 30, 2, 9, 14]


def _perturbed_model(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def _hf_prompt_log_probs(model) -> torch.Tensor:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def _engine_prompt_log_probs(url: str) -> torch.Tensor:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    values = [logprob for logprob, _, _ in reply["meta_info"]["input_token_logprobs"]]
    return torch.tensor([value for value in values if value is not None][-(len(PROMPT) - 1) :])


def _update(urls, version: int, transport: str, model, tmp_path) -> None:
    """What the rollout manager and a training rank do for one update: pause, send, check the version, continue."""
    from slime.backend_interfaces import weight_dir
    from slime.engine_control import check_weight_version, continue_generation, pause_generation, post_engines
    from slime.weight_sync import WeightUpdate, send_weights

    pause_generation(urls, "retract", timeout=60)
    if transport == "disk":
        directory = weight_dir(tmp_path, version)
        model.save_pretrained(directory, safe_serialization=True)
        body = {"model_path": str(directory), "weight_version": str(version)}
        post_engines(urls, "/update_weights_from_disk", body, timeout=120)
    else:
        update = WeightUpdate(version, transport, tuple(urls), bucket_bytes=64 * 1024, timeout_s=120)
        send_weights(update, model.state_dict().items())
    check_weight_version(urls, version, timeout=30)
    continue_generation(urls, timeout=60)


@pytest.mark.parametrize("transport", ["disk", "distributed", "tensor"])
def test_each_transport_makes_the_engines_serve_the_sent_weights(two_engines, tiny_model, tmp_path, transport):
    urls = list(two_engines)
    version = {"disk": 101, "distributed": 102, "tensor": 103}[transport]
    model = _perturbed_model(tiny_model, seed=version)
    expected = _hf_prompt_log_probs(model)
    before = _engine_prompt_log_probs(urls[0])
    assert (before - expected).abs().max() > 0.01, "the perturbation must change the log-probs"

    _update(urls, version, transport, model, tmp_path)

    for url in urls:
        served = _engine_prompt_log_probs(url)
        assert torch.allclose(served, expected, atol=2e-3), (url, served, expected)
        info = httpx.get(f"{url}/model_info", timeout=10).json()
        assert info["weight_version"] == str(version)
        reply = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert reply.json()["meta_info"]["weight_version"] == str(version)


def test_a_refused_update_stops_with_the_engines_message(two_engines, tiny_model):
    from slime.engine_control import EngineRequestError, continue_generation
    from slime.weight_sync import WeightUpdate, send_weights

    url = two_engines[0]
    wrong = [("model.embed_tokens.weight", torch.zeros(3, 5))]  # not the served embedding's shape
    with pytest.raises(EngineRequestError) as caught:
        send_weights(WeightUpdate(7, "distributed", (url,), timeout_s=60), wrong)
    message = str(caught.value)
    assert url in message and "/update_weights_from_distributed" in message
    continue_generation([url], timeout=30)
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
