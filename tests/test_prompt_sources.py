"""Where prompts come from: `--prompt-data` locations (files, `datasets` directories, Hub ids), weighted mixtures
laid out per epoch and resumed from the cursor, tools and chat-template keyword arguments in the rendered prompt."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.data.data_source import RolloutDataSource, record_to_sample
from slime.data.prompt_settings import PromptSettings
from slime.data.prompt_sources import (
    PromptSource,
    mixture_counts,
    mixture_epoch,
    parse_chat_template_kwargs,
    parse_prompt_data,
    read_prompt_records,
)
from slime.rollout.settings import RolloutSettings
from slime.rollout.sglang_rollout import _prompt_ids

REQUIRED = {"input": "--input-key"}


def _jsonl(path: Path, prefix: str, count: int) -> str:
    path.write_text("".join(json.dumps({"input": f"{prefix}{i}", "label": str(i)}) + "\n" for i in range(count)))
    return str(path)


# --- parsing ---------------------------------------------------------------------------------------------------


def test_one_location_or_a_weighted_mixture_parses():
    assert parse_prompt_data("p.jsonl") == (PromptSource("p.jsonl"),)
    assert parse_prompt_data(["a.jsonl:0.7", "owner/set:0.3"]) == (
        PromptSource("a.jsonl", 0.7),
        PromptSource("owner/set", 0.3),
    )
    assert parse_prompt_data(["a.jsonl", "b.jsonl"]) == (PromptSource("a.jsonl"), PromptSource("b.jsonl"))
    assert str(PromptSource("a.jsonl", 0.7)) == "a.jsonl:0.7"


def test_an_existing_file_whose_name_ends_in_a_number_is_not_a_weight(tmp_path):
    odd = tmp_path / "prompts:2"
    odd.write_text('{"input": "x"}\n')
    assert parse_prompt_data(str(odd)) == (PromptSource(str(odd)),)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["a.jsonl:0.7", "b.jsonl"], "give every location of a mixture a weight"),
        (["a.jsonl:0", "b.jsonl:1"], "a mixture weight must be positive"),
        (["a.jsonl:1", "a.jsonl:2"], "a location is named twice"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_prompt_data(values)
    assert str(error.value).startswith("--prompt-data ")


def test_chat_template_kwargs_are_a_json_object():
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad in ("enable_thinking=false", "[1, 2]"):
        with pytest.raises(ValueError, match="--apply-chat-template-kwargs"):
            parse_chat_template_kwargs(bad)


# --- reading ---------------------------------------------------------------------------------------------------


@pytest.fixture
def datasets():
    return pytest.importorskip("datasets", reason="pip install 'slime-rl[data]'")


def test_a_saved_dataset_directory_is_read_with_its_split(tmp_path, datasets):
    rows = [{"input": f"q{i}", "label": str(i)} for i in range(3)]
    single = tmp_path / "single"
    datasets.Dataset.from_list(rows).save_to_disk(str(single))
    assert read_prompt_records(single, required_keys=REQUIRED) == rows

    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(splits))
    assert read_prompt_records(splits, required_keys=REQUIRED) == rows  # training reads train
    assert read_prompt_records(splits, required_keys=REQUIRED, preferred_split="test") == rows[:1]  # eval, test
    assert read_prompt_records(splits, required_keys=REQUIRED, split="test") == rows[:1]
    with pytest.raises(ValueError, match=r"has the splits test, train, not 'dev': choose one with --prompt-data-split"):
        read_prompt_records(splits, split="dev")


def test_rows_of_a_dataset_need_the_runs_fields(tmp_path, datasets):
    directory = tmp_path / "set"
    datasets.Dataset.from_list([{"question": "q"}]).save_to_disk(str(directory))
    with pytest.raises(KeyError, match=r"set row 1: the row has no 'input' field \(--input-key input\)"):
        read_prompt_records(directory, required_keys=REQUIRED)


def test_a_plain_directory_or_a_missing_file_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="not one `datasets` saved"):
        read_prompt_records(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--prompt-data .*data/prompts.jsonl does not exist"):
        read_prompt_records(str(tmp_path / "data" / "prompts.jsonl"))


def test_an_unreachable_hub_dataset_names_the_id_and_the_fix(monkeypatch, datasets):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as error:
        read_prompt_records("no-such-owner/no-such-set", source="--eval-prompt-data held")
    message = str(error.value)
    assert message.startswith("--eval-prompt-data held no-such-owner/no-such-set: ")
    assert "HF_HUB_OFFLINE is set" in message and "save_to_disk(DIR)" in message


# --- mixtures --------------------------------------------------------------------------------------------------


def test_a_mixture_epoch_holds_the_sources_in_proportion_and_visits_each_prompt_before_repeating():
    sizes, weights = [4, 20], [0.5, 0.5]
    assert mixture_counts(sizes, weights) == [12, 12]
    epoch = mixture_epoch(sizes, weights, 0, shuffle=False, seed=1)
    assert len(epoch) == 24
    small = [index for index in epoch if index < 4]
    assert small == [0, 1, 2, 3] * 3  # the small source repeats, in order, each prompt once per pass
    # Interleaved: every prefix holds the two sources within one prompt of their 1:1 share.
    for end in range(1, len(epoch) + 1):
        first = sum(index < 4 for index in epoch[:end])
        assert abs(first - end / 2) <= 1, (end, epoch[:end])
    # The large source continues where the last epoch stopped.
    large = [index - 4 for index in epoch if index >= 4] + [
        index - 4 for index in mixture_epoch(sizes, weights, 1, shuffle=False, seed=1) if index >= 4
    ]
    assert large[:20] == list(range(20))


def test_a_shuffled_mixture_epoch_is_reproducible_and_keeps_the_counts():
    sizes, weights = [5, 10], [1.0, 3.0]
    first = mixture_epoch(sizes, weights, 2, shuffle=True, seed=7)
    assert first == mixture_epoch(sizes, weights, 2, shuffle=True, seed=7)
    assert first != mixture_epoch(sizes, weights, 2, shuffle=True, seed=8)
    counts = Counter(index < 5 for index in first)
    assert counts == {True: 4, False: 11}  # 15 prompts, split 1:3 (rounded)


def _mixture_source(tmp_path: Path, weights: tuple[float, float] = (0.75, 0.25), **extra) -> RolloutDataSource:
    a, b = _jsonl(tmp_path / "a.jsonl", "a", 6), _jsonl(tmp_path / "b.jsonl", "b", 2)
    args = SimpleNamespace(
        prompt_data=[f"{a}:{weights[0]}", f"{b}:{weights[1]}"],
        n_samples_per_prompt=2,
        save=str(tmp_path / "save"),
        load=str(tmp_path / "save"),
        **extra,
    )
    return RolloutDataSource(args)


def test_a_mixture_data_source_serves_the_weights_and_resumes_from_its_cursor(tmp_path):
    source = _mixture_source(tmp_path)
    groups = source.get_samples(16)  # two epochs of 8
    prompts = [group[0].prompt for group in groups]
    assert Counter(prompt[0] for prompt in prompts) == {"a": 12, "b": 4}
    assert all(len(group) == 2 and group[0].prompt == group[1].prompt for group in groups)
    source.save(3)
    upcoming = [group[0].prompt for group in source.get_samples(5)]

    resumed = _mixture_source(tmp_path)
    resumed.load(3)
    assert [group[0].prompt for group in resumed.get_samples(5)] == upcoming

    reweighted = _mixture_source(tmp_path, weights=(0.5, 0.5))
    with pytest.raises(ValueError, match="resume with the same locations and weights"):
        reweighted.load(3)


# --- tools and chat-template keyword arguments ----------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_tools_come_from_the_tool_key_and_need_a_chat_prompt():
    settings = PromptSettings(tool_key="tools", apply_chat_template=True)
    sample = record_to_sample({"input": "1+1", "tools": json.dumps(TOOLS)}, settings)
    assert sample.prompt == [{"role": "user", "content": "1+1"}] and sample.metadata["tools"] == TOOLS
    assert "tools" not in record_to_sample({"input": "1+1"}, settings).metadata
    with pytest.raises(ValueError, match="add --apply-chat-template"):
        record_to_sample({"input": "1+1", "tools": TOOLS}, PromptSettings(tool_key="tools"))
    with pytest.raises(ValueError, match="a list of JSON objects"):
        record_to_sample({"input": "1+1", "tools": "[1]"}, settings)


def test_the_rendered_prompt_carries_the_tools_and_the_chat_template_kwargs():
    from slime.plugins.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% if tools %}tools:{{ tools | map(attribute='function.name') | join(',') }};{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}quiet;{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    settings = PromptSettings(tool_key="tools", apply_chat_template=True)
    sample = record_to_sample({"input": "1+1", "tools": TOOLS}, settings)
    rollout = RolloutSettings.from_args(SimpleNamespace(apply_chat_template_kwargs='{"enable_thinking": false}'))
    state = SimpleNamespace(tokenizer=tokenizer, settings=rollout)
    ids = _prompt_ids(state, sample)
    assert isinstance(ids, list) and tokenizer.decode(ids) == "tools:add;quiet;1+1"
    plain = SimpleNamespace(tokenizer=tokenizer, settings=RolloutSettings.from_args(SimpleNamespace()))
    assert tokenizer.decode(_prompt_ids(plain, record_to_sample({"input": "1+1"}, settings))) == "1+1"
